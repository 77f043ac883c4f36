"""NVIDIA's recovery actions: what drains, what ends a drain, and the decoded Xids
(74, 144-150, 154), judged on real kernel-log lines (``tests/fixtures/xid``)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import XidCheckSection
from slurm_resilience.health import steps, xid_catalog, xid_repairs
from slurm_resilience.health.checks import xid as xid_check
from slurm_resilience.health.collectors import xid as xid_collector
from slurm_resilience.health.collectors.xid import KernelLogSnapshot
from slurm_resilience.health.findings import Finding, Severity
from slurm_resilience.health.gate import GateReport
from slurm_resilience.health.verdict import decide
from slurm_resilience.health.xid_catalog import Ending

XID_DIR = REAL_FIXTURES / "xid"
NOW = time.time()
FATAL = xid_catalog.DEFAULT_FATAL


def collected(xid: int, needle: str = "") -> str:
    """The real line of ``xid-lines_collected.txt`` with that code (and text)."""
    lines = (XID_DIR / "xid-lines_collected.txt").read_text().splitlines()
    return next(ln for ln in lines if f"): {xid}, " in ln and needle in ln)


def text_of(line: str) -> str:
    fields = xid_collector.parse_message(line)
    assert fields is not None, line
    return fields.text


def read(lines: list[str], uptime: float = 1.2e8) -> KernelLogSnapshot:
    """What the collector returns for a file of ``lines`` on a node up ``uptime`` s."""
    got = xid_collector.parse_lines(lines, "b1", NOW - uptime, NOW)
    return KernelLogSnapshot("file", "", "b1", NOW - uptime, tuple(got.events))


def run(snap: KernelLogSnapshot, state: xid_check.XidState | None = None, now: float = NOW,
        cfg: XidCheckSection | None = None, **kw: Any) -> tuple[list[Finding], xid_check.XidState]:
    r = xid_check.check(snap, cfg or XidCheckSection(), state or xid_check.XidState(), now=now,
                        **kw)
    return r.findings, r.state


def failing(findings: list[Finding]) -> list[str]:
    return [f.message for f in findings if f.severity is Severity.FAIL]


def test_xid_79_with_154_node_reboot_is_never_ended_by_a_reset() -> None:
    """The real Xid 79 line, then Xid 154 asking for a node reboot: the GPU answering
    NVML again (a reset) ends neither; both name 'reboot required'."""
    lines = (XID_DIR / "dmesg_xid79-then-xid154-node-reboot_assembled.log").read_text()
    snap = read(lines.splitlines())
    assert [e.xid for e in snap.events] == [79, 154]
    gpu = {"00000000:91:00.0": False}
    _, state = run(snap, gpus_ok=gpu)
    findings, _ = run(snap, state, now=NOW + 60, gpus_ok={"00000000:91:00.0": True})
    assert sorted(failing(findings)) == [
        m for m in sorted(failing(findings)) if m.endswith(", reboot required")]
    assert len(failing(findings)) == 2
    assert not any("ended" in f.message for f in findings)


def test_154_makes_a_reset_xid_need_a_reboot_and_nvml_does_too() -> None:
    """Xid 119 (RESET_GPU) ends with a reset, unless Xid 154 or NVML's recovery action
    (NODE_REBOOT = 2) on the same GPU asks for a reboot."""
    x119 = collected(119)
    reboot154 = ("[Sun Feb 23 16:24:30 2025] NVRM: Xid (PCI:0000:9b:00): 154, GPU recovery "
                 "action changed from 0x0 (None) to 0x2 (Node Reboot Required)")
    lost, back = {"00000000:9B:00.0": False}, {"00000000:9B:00.0": True}
    for lines, recovery, ends in (([x119], {}, True), ([x119, reboot154], {}, False),
                                  ([x119], {"00000000:9B:00.0": 2}, False)):
        snap = read(lines)
        _, state = run(snap, gpus_ok=lost, recovery=recovery)
        findings, _ = run(snap, state, now=NOW + 60, gpus_ok=back, recovery=recovery)
        assert (not failing(findings)) == ends, (lines, recovery, findings)
        if not ends:
            assert all(m.endswith("reboot required") for m in failing(findings))


def test_real_gb200_nvlink_lines_decode_as_nvidia_decodes_them() -> None:
    """Real GB200 lines: NETIR_LINK_EVT link-down (peer device) and NETIR need a reset;
    RLW_SRC_TRACK status 0x8 follows Xid 154 (none here: restart the application); SAW_MVB
    and RLW_RXPIPE status 0x8 are IGNORE; Xid 154 to Drain and Reset needs a reset."""
    cases = {
        (149, "NETIR_LINK_EVT"): Ending.RESET, (149, "NETIR Fatal"): Ending.RESET,
        (145, "RLW_SRC_TRACK"): Ending.NONE, (145, "RLW_RXPIPE"): Ending.NONE,
        (144, "SAW_MVB"): Ending.NONE, (154, "to 0x4 (Drain and Reset)"): Ending.RESET,
        (154, "to 0x1 (GPU Reset Required)"): Ending.RESET,
    }
    for (xid, needle), ending in cases.items():
        j = xid_catalog.judge(xid, text_of(collected(xid, needle)), FATAL)
        assert j.ending is ending, (xid, needle, j)
    assert xid_catalog.judge(145, text_of(collected(145, "RLW_SRC_TRACK")),
                             FATAL).action == "XID_154_EVAL"


def test_xid_149_link_down_rows_nvidia_ignores_do_not_drain() -> None:
    """The two NETIR_LINK_EVT reasons NVIDIA's decode marks IGNORE (0x26, 0x28 in IntrInfo
    bits 25:20) do not drain although the driver prints 'Fatal'; the real line's reason
    (0x21, a peer device) does. The IntrInfo values are the real line's with the reason
    changed."""
    real = text_of(collected(149, "NETIR_LINK_EVT"))
    assert "(0x021425c6 " in real
    for reason, ending in ((0x21, Ending.RESET), (0x26, Ending.NONE), (0x28, Ending.NONE)):
        intr = (0x021425c6 & ~(0x3F << 20)) | reason << 20
        text = real.replace("0x021425c6", f"{intr:#010x}")
        assert xid_catalog.judge(149, text, FATAL).ending is ending, hex(reason)


def test_xid_74_registers_decide() -> None:
    """The real Xid 74 line (3rd register bit 16) drains until a reset; bits NVIDIA calls
    safe to ignore (1st register bit 0, 5th bit 20) or sympathetic (1st register bit 1)
    do not drain."""
    real = text_of(collected(74))
    j = xid_catalog.judge(74, real, FATAL)
    assert (j.ending, "reg3 bit 16" in j.basis) == (Ending.RESET, True)
    for regs, ending in (("0x1, 0x0, 0x0, 0x0, 0x100000, 0x0, 0x0", Ending.NONE),
                         ("0x2, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0", Ending.NONE),
                         ("0x12, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0", Ending.RESET),
                         ("0x0, 0x0, 0x0, 0x40000, 0x0, 0x0, 0x0", Ending.RESET)):
        text = real.replace("0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0", regs)
        assert xid_catalog.judge(74, text, FATAL).ending is ending, regs


def test_xid_109_drains_until_a_reset() -> None:
    """The real Xid 109 (context switch timeout) line: NVIDIA's action is RESET_GPU
    (R570+), so it drains, and the reason says a reset is needed."""
    findings, _ = run(read([collected(109)]))
    assert [m.rsplit(", ", 1)[1] for m in failing(findings)] == ["reset required"]


@pytest.mark.parametrize(("xid", "need"), [(54, "reboot required"), (167, "reboot required"),
                                           (169, "reset required"), (151, "reboot required"),
                                           (171, "reset required"), (142, None),
                                           (157, None), (165, None)])
def test_added_codes(xid: int, need: str | None) -> None:
    """Codes the catalogue lacked: 54 (aux power, re-seat), 167 (PCIe fatal timeout) and
    151 end with a new boot; 169 and 171 with a reset; 142, 157, 165 never drain."""
    line = f"[ 100.0] NVRM: Xid (PCI:0000:9b:00): {xid}, pid='<unknown>', name=<unknown>, x"
    findings, _ = run(read([line], uptime=3600))
    got = failing(findings)
    assert [m.rsplit(", ", 1)[1] for m in got] == ([need] if need else [])
    assert xid in xid_catalog.ENTRIES and xid_catalog.meaning(xid) != "unlisted Xid"


def test_every_difference_from_nvidia_says_why() -> None:
    """An entry whose ending is not what NVIDIA's action implies says why."""
    implied = {xid_catalog.Action.RESTART_BM: Ending.BOOT,
               xid_catalog.Action.RESET_GPU: Ending.RESET,
               xid_catalog.Action.WORKFLOW_XID_48: Ending.RESET,
               xid_catalog.Action.RESTART_APP: Ending.NONE,
               xid_catalog.Action.IGNORE: Ending.NONE}
    for xid, e in xid_catalog.ENTRIES.items():
        if e.action in implied and implied[e.action] is not e.ending:
            assert e.differs, xid
        if e.action in (xid_catalog.Action.CONTACT_SUPPORT, xid_catalog.Action.NONE_GIVEN,
                        xid_catalog.Action.CHECK_UVM, xid_catalog.Action.CHECK_MECHANICALS,
                        xid_catalog.Action.RESTART_VM, xid_catalog.Action.WORKFLOW_XID_45):
            assert e.differs or e.action is xid_catalog.Action.NONE_GIVEN, xid


def test_repeated_xid_13_asks_for_the_diagnostic_and_a_pass_ends_it() -> None:
    """The real dmesg with Xid 13 bursts on one GPU over hours: NVIDIA sends repeats to
    DCGM EUD, so the finding names it (a warning, no drain) and the epilog's after-failure
    diagnostic is asked for; a passing diagnostic ends the request, a lone burst never
    raises it."""
    lines = (XID_DIR / "dmesg-decode-iso_node_xid13-sm-exception_xid43-burst_gpud.log")
    snap = read(lines.read_text().splitlines())
    last = max(e.time for e in snap.events if e.time is not None)
    cfg = XidCheckSection(window_s=10 ** 9)
    findings, state = run(snap, now=last + 60, cfg=cfg)
    ask = [f for f in findings if f.data.get("diagnose")]
    assert [(f.severity, f.data["xid"]) for f in ask] == [(Severity.WARN, 13)]
    assert "DCGM EUD" in ask[0].message and not failing(findings)
    report = GateReport("epilog", "n1", decide(findings, {"xid": "fail-open"}))
    assert report.verdict.healthy and steps.gpu_failed(report)
    pci = ask[0].data["pci"]
    findings, _ = run(snap, state, now=last + 120, cfg=cfg, repairs=[xid_repairs.Repair(
        pci, last + 90, xid_repairs.DIAG_EVIDENCE, xid_repairs.DIAG)])
    assert not any(f.data.get("diagnose") for f in findings)
    lone = [ln for ln in lines.read_text().splitlines() if "): 13, " in ln][:3]
    findings, _ = run(read(lone), cfg=cfg)
    assert not any(f.data.get("diagnose") for f in findings)


def test_a_diagnostic_never_ends_a_reset_or_reboot_xid() -> None:
    """Xids 48 (reset) and 79 (reboot) stay failed after a recorded passing diagnostic."""
    line = "[ 100.0] NVRM: Xid (PCI:0000:9b:00): {}, pid='<unknown>', name=<unknown>, x"
    snap = read([line.format(48), line.format(79)], uptime=3600)
    _, state = run(snap)
    findings, _ = run(snap, state, now=NOW + 60, repairs=[xid_repairs.Repair(
        "0000:9b:00", NOW + 30, xid_repairs.DIAG_EVIDENCE, xid_repairs.DIAG)])
    assert len(failing(findings)) == 2
