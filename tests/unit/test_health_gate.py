"""The gate end to end on stand-in hardware: collectors in children, checks, verdict, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import logged

from slurm_resilience import config
from slurm_resilience.config import Config
from slurm_resilience.fakes import nvml
from slurm_resilience.health import childproc, gate
from slurm_resilience.health.findings import Severity, fail, unknown
from slurm_resilience.health.verdict import decide
from slurm_resilience.sandbox import faults, hardware

NODE = "node1"


def conf(tmp_path: Path, **health: Any) -> dict[str, Any]:
    root = f"{tmp_path}/nodes/{{node}}"
    section: dict[str, Any] = {
        "backend": "fake", "scenario_dir": f"{tmp_path}/scenarios", "collector_timeout_s": 10,
        "gpu": {"expected_count": 8, "pci_sysfs_root": f"{root}/sys/bus/pci/devices"},
        "xid": {"source": "file", "path": f"{root}/kmsg", "boot_id_file": f"{root}/boot_id"},
        "infiniband": {"sysfs_root": f"{root}/sys/class/infiniband", "min_rate_gbps": 400,
                       "expected_hcas": [f"mlx5_{i}" for i in range(8)]},
        "nvme": {"path": f"{root}/nvme", "size_limit": 100 << 30, "min_free": 10 << 30,
                 "smart": False},
        # "/" is reachable and a mount point wherever the tests run.
        "mounts": {"paths": ["/"], "timeout_s": 2.0},
    }
    for key, value in health.items():
        if isinstance(value, dict):
            section.setdefault(key, {}).update(value)
        else:
            section[key] = value
    return {"node": {"state_dir": f"{root}/state"},
            "logging": {"file": f"{tmp_path}/log.jsonl", "syslog": False},
            "health": section}


def load(tmp_path: Path, **health: Any) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(conf(tmp_path, **health)))
    return config.load(str(path))


@pytest.fixture
def node(tmp_path: Path) -> Path:
    hardware.prepare_node_hardware(tmp_path, [NODE])
    return tmp_path


def blocking(report: gate.GateReport) -> list[str]:
    return [f.message for f in report.verdict.blocking]


def test_healthy_stand_ins_pass_every_check(node: Path) -> None:
    """8 GPUs, 8 HCAs, an empty kernel log and an empty NVMe: healthy, every check ran."""
    report = gate.run(load(node), NODE, "healthcheck")
    assert report.verdict.healthy, blocking(report)
    # services: no units configured here (they need systemctl); diag: only when named.
    assert {f.check for f in report.findings} == set(gate.CHECKS) - {"services", *gate.ACTIVE}


@pytest.mark.parametrize(("fault", "reason"), [
    ("gpu-xid:3:79", "gpu3 lost (NVML GPU_IS_LOST; expected present)"),
    ("gpu-ecc:2", "gpu2 1 uncorrectable ECC errors (expected <=0)"),
    # The GPU gone is named by the index, address and serial it had.
    ("gpu-missing:5", "7 GPUs visible (expected 8; gone: gpu5 0000:AB:00.0 sn 1650124031597)"),
    ("gpu-throttle:1:hw_thermal", "gpu1 HW thermal slowdown (expected none)"),
    ("gpu-remap-pending:6", "gpu6 row remap pending (reset the GPU)"),
    ("ib-down:mlx5_2:1", "mlx5_2 port1 DOWN (expected ACTIVE 400Gb/s)"),
    ("nvme-full", "nvme 0B free of 100.0GiB (expected >=10.0GiB)"),
    ("kernel-log:readonly-remount", "nvme0n1p1 filesystem read-only x1 in the kernel log "
                                    "(tolerated 0): EXT4-fs (nvme0n1p1): Remounting filesystem "
                                    "read-only"),
    ("kernel-log:mce", "host uncorrected machine check x1 in the kernel log (tolerated 0): "
                       "mce: Uncorrected hardware memory error in user-access at 3c5a1e2000"),
])
def test_each_injected_fault_blocks_with_its_reason(node: Path, fault: str, reason: str) -> None:
    """Every sandbox fault makes the gate fail with a reason naming actual and expected."""
    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")  # baselines
    faults.inject(node, NODE, fault)
    report = gate.run(cfg, NODE, "prolog")
    assert reason in blocking(report)
    faults.heal(node, NODE)
    assert gate.run(cfg, NODE, "prolog").verdict.healthy


def test_xid_79_reason_names_gpu_xid_meaning_time_and_action(node: Path) -> None:
    """After Xid 79 on GPU 3 the reason names it and what ends it: ``gpu3 XID 79 (GPU fell
    off the bus) HH:MM:SS, reboot required`` (NVIDIA's immediate action: RESTART_BM).

    The lost GPU no longer reports its PCI address; the gate remembers it from earlier runs.
    """
    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")
    faults.inject(node, NODE, "gpu-xid:3:79")
    report = gate.run(cfg, NODE, "prolog")
    xid = [f for f in report.verdict.blocking if f.check == "xid"]
    assert len(xid) == 1
    assert xid[0].message.startswith("gpu3 XID 79 (GPU fell off the bus) ")
    clock, need = xid[0].message.split(") ", 1)[1].split(", ")
    assert time.strptime(clock, "%H:%M:%S") and need == "reboot required"
    assert "gpu3 XID 79 (GPU fell off the bus)" in report.verdict.reason()
    assert report.verdict.reason().split(" [")[0].endswith("reboot required")


def test_gpu_reset_without_reboot_never_ends_xid_79(node: Path) -> None:
    """Xid 79, then a GPU reset (no reboot): the GPU answers NVML again, but NVIDIA's action
    for 79 is a restart of the node, so the GPU stays failed until a new boot."""
    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")
    faults.inject(node, NODE, "gpu-xid:3:79")
    assert not gate.run(cfg, NODE, "prolog").verdict.healthy
    faults.inject(node, NODE, "gpu-reset:3")
    report = gate.run(cfg, NODE, "prolog")
    assert ["gpu3 XID 79" in r and r.endswith("reboot required")
            for r in blocking(report)] == [True], blocking(report)
    faults.heal(node, NODE)  # as after a reboot
    assert gate.run(cfg, NODE, "prolog").verdict.healthy


def test_fatal_xid_on_a_visible_gpu_waits_for_recorded_repair(node: Path) -> None:
    """Xid 48 leaves the GPU visible: only a recorded reset (or a reboot) ends it; a
    recorded passing diagnostic does not (NVIDIA: a GPU reset or node reboot clears it)."""
    from slurm_resilience.health import xid_repairs

    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")
    faults.inject(node, NODE, "gpu-xid:2:48")
    assert "gpu2 XID 48" in " ".join(blocking(gate.run(cfg, NODE, "prolog")))
    scenario = nvml.read_scenario(str(hardware.locate(node, NODE).scenario))
    assert scenario is not None
    bus_id = scenario["gpus"][2]["pci_bus_id"]
    xid_repairs.record(gate.state_dir(cfg, NODE), xid_repairs.Repair(
        bus_id, time.time(), "dcgm diag level 3 passed", xid_repairs.DIAG))
    assert "gpu2 XID 48" in " ".join(blocking(gate.run(cfg, NODE, "prolog")))
    xid_repairs.record(gate.state_dir(cfg, NODE), xid_repairs.Repair(
        bus_id, time.time(), "operator: nvidia-smi -r", xid_repairs.RESET))
    report = gate.run(cfg, NODE, "prolog")
    assert report.verdict.healthy, blocking(report)


def test_clean_active_diagnostic_ends_only_what_a_diagnostic_clears(
        node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Xid 48 on GPU 2 and a repeated Xid 13 on GPUs 1 and 2 (NVIDIA: repeats call for a
    diagnostic). A DCGM run that passed on GPUs 0 and 1 (the recorded schema) ends GPU 1's
    diagnostic request only: GPU 2's request stays, and its Xid 48 (reset required) too."""
    from conftest import REAL_FIXTURES

    cfg = load(node, xid={"repeat_bursts": 1})
    gate.run(cfg, NODE, "healthcheck")
    for fault in ("gpu-xid:1:13", "gpu-xid:2:13", "gpu-xid:2:48"):
        faults.inject(node, NODE, fault)
    report = gate.run(cfg, NODE, "prolog")
    asks = {f.subject for f in report.findings if f.data.get("diagnose")}
    assert asks == {"gpu1", "gpu2"}
    assert [r for r in blocking(report) if "XID" in r] == [
        r for r in blocking(report) if "gpu2 XID 48" in r and r.endswith("reset required")]
    tool = tmp_path / "bin" / "dcgmi"
    tool.parent.mkdir()
    passed = REAL_FIXTURES / "dcgm" / "dcgmi-diag-r2-j_dcgm3-schema_h100x2_pass_handwritten.txt"
    tool.write_text(f"#!/bin/sh\ncat {passed}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:/usr/bin:/bin")
    gate.run(cfg, NODE, "manual", only=("diag", "xid"))
    after = gate.run(cfg, NODE, "prolog")
    assert {f.subject for f in after.findings if f.data.get("diagnose")} == {"gpu2"}
    assert "gpu2 XID 48" in " ".join(blocking(after))


def test_operator_records_a_repair_from_the_cli(node: Path) -> None:
    """`slurm-resilience xid-repaired --gpu 2` after a reset ends GPU 2's Xid 48; an
    unknown index is refused with the reason."""
    from slurm_resilience.cli import main

    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")
    faults.inject(node, NODE, "gpu-xid:2:48")
    assert not gate.run(cfg, NODE, "prolog").verdict.healthy
    args = ["--config", str(node / "config.yaml"), "xid-repaired", "--node", NODE]
    assert main([*args, "--gpu", "2", "--evidence", "nvidia-smi -r by ops"]) == 0
    report = gate.run(cfg, NODE, "prolog")
    assert report.verdict.healthy, blocking(report)
    assert any("ended: nvidia-smi -r by ops" in f.message for f in report.findings)
    assert main([*args, "--gpu", "17"]) == 2


def test_ib_errors_fail_against_the_previous_run(node: Path) -> None:
    """ib-errors raises symbol_error by 1000 since the previous run: a failure."""
    cfg = load(node)
    assert gate.run(cfg, NODE, "healthcheck").verdict.healthy
    faults.inject(node, NODE, "ib-errors:mlx5_4:1")
    assert blocking(gate.run(cfg, NODE, "healthcheck")) == [
        "mlx5_4 port1 symbol_error +1000 (expected <=100)"]


def test_hung_collector_is_a_failure_and_the_gate_returns(node: Path) -> None:
    """An NVML call that never returns is killed at the timeout and fails the node. (5 s,
    not less: the other collectors must answer within it on a loaded machine.)"""
    scen = nvml.read_scenario(str(hardware.locate(node, NODE).scenario))
    assert scen is not None
    scen["hang"] = {"function": "nvmlDeviceGetCount", "seconds": 60}
    nvml.write_scenario(str(hardware.locate(node, NODE).scenario), scen)
    report = gate.run(load(node, collector_timeout_s=5, mounts={"paths": []}), NODE, "prolog")
    assert blocking(report) == ["gpu collector hung: no answer within 5s"]


def test_kill_switch_skips_a_check(node: Path) -> None:
    """A disabled check is not run, so its fault does not block."""
    faults.inject(node, NODE, "ib-down:mlx5_0:1")
    report = gate.run(load(node, infiniband={"enabled": False}), NODE, "prolog")
    assert report.verdict.healthy
    assert "infiniband" not in {f.check for f in report.findings}


def test_prolog_is_passive(node: Path) -> None:
    """The prolog runs no write probe; the healthcheck does."""
    cfg = load(node)
    report = gate.run(cfg, NODE, "prolog")
    assert not any("probe" in f.message for f in report.findings)
    report = gate.run(cfg, NODE, "healthcheck")
    assert any("probe" in f.message for f in report.findings if f.check == "nvme")


def test_verdict_policy_for_could_not_check() -> None:
    """Unknown blocks under fail-closed and is only reported under fail-open."""
    findings = [unknown("xid", "kernel-log", "couldn't read")]
    assert not decide(findings, {"xid": "fail-closed"}).healthy
    assert decide(findings, {"xid": "fail-open"}).healthy
    assert not decide([fail("nvme", "nvme", "full")], {"nvme": "fail-open"}).healthy


def test_reason_is_short_with_a_count_of_the_rest() -> None:
    """A reason names the first blocking finding and counts the rest as ``(+N more)``."""
    v = decide([fail("gpu", f"gpu{i}", f"gpu{i} lost") for i in range(5)], {})
    assert v.reason() == "gpu0 lost (+4 more)"
    assert decide([fail("gpu", "gpu0", "gpu0 lost")], {}).reason() == "gpu0 lost"


def test_children_run_in_parallel_and_errors_come_back(tmp_path: Path) -> None:
    """Collectors run concurrently; an exception in one is reported, not raised."""

    def meet(me: str, other: str) -> Callable[[], dict[str, Any]]:
        # A rendezvous: each child waits for the other, which only concurrent children pass.
        def fn() -> dict[str, Any]:
            (tmp_path / me).touch()
            for _ in range(2000):
                if (tmp_path / other).exists():
                    return {"ok": True}
                time.sleep(0.005)
            return {"ok": False}
        return fn

    def broken() -> dict[str, Any]:
        raise OSError("disk on fire")

    out = childproc.run_all({"a": meet("a", "b"), "b": meet("b", "a"), "c": broken}, 30)
    assert out["a"].value == {"ok": True} and out["b"].value == {"ok": True}
    assert out["c"].error == "OSError: disk on fire" and not out["c"].timed_out


def test_check_cli_prints_a_table_and_json(node: Path) -> None:
    """``slurm-resilience check`` lists every finding; --json is machine-readable; rc 1 if sick."""
    load(node)
    argv = [sys.executable, "-m", "slurm_resilience", "--config", str(node / "config.yaml"),
            "check", "--node", NODE]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split() == ["SEVERITY", "CHECK", "SUBJECT", "MESSAGE"]
    assert "mlx5_7 port1 ACTIVE LinkUp" in out.stdout and f"{NODE}: healthy" in out.stdout
    faults.inject(node, NODE, "gpu-xid:3:79")
    out = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    assert data["healthy"] is False
    assert any(f["severity"] == "fail" and f["subject"] == "gpu3" for f in data["findings"])
    assert Severity.FAIL.label == "fail"


def test_unusable_state_dir_runs_without_history(node: Path) -> None:
    """A state directory that cannot be opened is a warning; the checks still run."""
    blocker = node / "not-a-dir"
    blocker.write_text("")
    report = gate.run(load(node, state_dir=str(blocker / "health")), NODE, "prolog")
    assert report.verdict.healthy
    assert [f.message for f in report.findings if f.check == "gate"] == [
        f"couldn't open state in {blocker}/health: Not a directory; checks run without history"]


def test_an_unreadable_repair_ledger_keeps_the_gpu_failed_and_says_so(node: Path) -> None:
    """A ledger that can't be read (here: a directory in its place) is a warning; the
    fatal Xid stands."""
    from slurm_resilience.health import xid_repairs

    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")
    faults.inject(node, NODE, "gpu-xid:2:48")
    (Path(gate.state_dir(cfg, NODE)) / xid_repairs.LEDGER).mkdir(parents=True)
    report = gate.run(cfg, NODE, "prolog")
    assert not report.verdict.healthy
    assert any(f.subject == "repairs" and "couldn't read" in f.message
               for f in report.findings)


def test_active_diagnostics_run_only_when_named(node: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the prolog nor a full manual run starts active diagnostics; naming them
    runs them (here: no dcgmi, no CUDA, so "could not check", policy fail-open)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    cfg = load(node)
    for kind in ("prolog", "epilog", "healthcheck", "manual"):
        assert not [f for f in gate.run(cfg, NODE, kind).findings if f.check == "diag"], kind
    report = gate.run(cfg, NODE, "manual", only=("diag",))
    assert [f.check for f in report.findings] == ["diag"]
    assert report.findings[0].severity is Severity.UNKNOWN and report.verdict.healthy


def test_gpu_service_units_must_be_active(node: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """nvidia-fabricmanager failed and nvidia-imex active, as systemctl reports them: the
    healthcheck fails naming the unit and its state; the prolog does not ask."""
    bindir = node / "bin"
    bindir.mkdir()
    tool = bindir / "systemctl"
    tool.write_text('#!/bin/sh\ncase "$3" in nvidia-imex) echo active; exit 0;;\n'
                    '*) echo failed; exit 3;; esac\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    cfg = load(node, services={"units": ["nvidia-fabricmanager", "nvidia-imex"]})
    report = gate.run(cfg, NODE, "healthcheck")
    assert blocking(report) == ["nvidia-fabricmanager failed (expected active)"]
    assert not [f for f in gate.run(cfg, NODE, "prolog").findings if f.check == "services"]


def test_gpu_findings_carry_the_gpus_pci_address_and_serial(node: Path) -> None:
    """A finding about gpuN carries that GPU's PCI address and board serial in its data (the
    event) and at the end of the drain reason: what an RMA desk needs to pull the board."""
    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")  # baselines
    faults.inject(node, NODE, "gpu-ecc:3")
    report = gate.run(cfg, NODE, "prolog")
    found = [f for f in report.verdict.blocking if f.subject == "gpu3"]
    assert found
    for f in found:
        assert (f.data["pci_bus_id"], f.data["serial"]) == ("00000000:5D:00.0", "1650124031595")
    first = report.verdict.blocking[0]
    assert report.verdict.reason().startswith(
        f"{first.message} [0000:5D:00.0 sn 1650124031595]")


def test_health_readme_sandbox_snippet_holds(node: Path) -> None:
    """The health README's sandbox walk-through, run on a stand-in node: Xid 79 drains
    with 'reboot required', `gpu-reset` leaves the drain (its comment says so), `heal`
    (a reboot) ends it."""
    readme = (Path(__file__).resolve().parents[2] / "slurm_resilience" / "health"
              / "README.md").read_text()
    block = readme.split("## Trying it in the sandbox", 1)[1].split("```", 2)[1]
    steps = [ln.split("#", 1)[0].split() for ln in block.splitlines()
             if ln.startswith("slurm-resilience sandbox ") and " up" not in ln]
    reset_comment = " ".join(ln.split("#", 1)[1].strip() for ln in
                             block.split("gpu-reset:3", 1)[1].split("heal")[0].splitlines()
                             if "#" in ln)
    assert [s[2:] for s in steps] == [["inject", "node1", "gpu-xid:3:79"],
                                      ["inject", "node1", "gpu-reset:3"], ["heal", "node1"]]
    assert "the drain stays" in reset_comment, reset_comment
    cfg = load(node)
    gate.run(cfg, NODE, "healthcheck")
    seen = []
    for step in steps:
        if step[2] == "inject":
            faults.inject(node, NODE, step[4])
        else:
            faults.heal(node, NODE)
        seen.append(gate.run(cfg, NODE, "prolog").verdict)
    assert [v.healthy for v in seen] == [False, False, True]
    assert all("gpu3 XID 79" in v.reason() and "reboot required" in v.reason()
               for v in seen[:2])


def test_a_crashed_check_never_passes_the_node(node: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """A bug in one check (here: a TypeError raised by the mounts check) is no pass: the
    gate names the crash in a failed finding, the node is not healthy, and the other checks
    are judged as usual."""
    import dataclasses

    from slurm_resilience.health import registry
    from slurm_resilience.health.checks import mounts

    def broken(snap: object, state: object, facts: object) -> Any:
        raise TypeError("unsupported operand")

    specs = tuple(dataclasses.replace(s, judge=broken) if s is mounts.SPEC else s
                  for s in registry.SPECS)
    monkeypatch.setattr(registry, "SPECS", specs)
    report = gate.run(load(node), NODE, "healthcheck")
    assert not report.verdict.healthy
    assert blocking(report) == ["mounts check crashed: TypeError: unsupported operand"]
    assert {"gpu", "xid", "infiniband", "nvme"} <= {f.check for f in report.findings}


def test_registry_declares_every_check_once() -> None:
    """The gate knows checks only through the registry: one spec per name, each with its
    config section, and the reason order the drain reasons have always had."""
    from slurm_resilience.health import registry

    assert gate.CHECKS == ("gpu", "xid", "kernel", "infiniband", "nvme", "mounts", "services",
                           "diag", "gdr")
    assert len(set(registry.NAMES)) == len(registry.NAMES)
    assert gate.ACTIVE == ("diag", "gdr")
    by_rank = sorted(registry.SPECS, key=lambda s: s.rank)
    assert [s.name for s in by_rank] == ["xid", "gpu", "diag", "kernel", "services",
                                         "infiniband", "gdr", "nvme", "mounts"]
    cfg = Config()
    for spec in registry.SPECS:
        assert spec.section(cfg.health).enabled
        assert spec.source in registry.NAMES
        assert registry.BY_NAME[spec.source].collect is not None


def test_a_state_field_of_the_wrong_type_resets_that_check_only(tmp_path: Path,
                                                                 events: Path) -> None:
    """Saved state is read into each check's record at the store: a field of the wrong type
    sets that check's file aside (said, naming it) and gives it an empty record; another
    check's history is read as it was."""
    from slurm_resilience.health.checks import gpu, infiniband

    store = gate.StateStore(str(tmp_path / "health"))
    store.save("gpu", {"gpus": {"GPU-1": {"streak": "many", "throttle": [], "counters": {}}}})
    store.save("infiniband", {"counters": {"mlx5_0/1": {"symbol_error": 3}}})
    assert store.load_state("gpu", gpu.GpuState) == gpu.GpuState()
    assert store.load_state("infiniband", infiniband.IbState).counters == {
        "mlx5_0/1": {"symbol_error": 3}}
    assert store.quarantined == {"gpu"}
    assert (tmp_path / "health" / "gpu.json.corrupt").exists()
    said = [e for e in logged(events) if str(e.get("path", "")).endswith("gpu.json")]
    assert said and "gpus['GPU-1'].streak is 'many', not an integer" in said[0]["reason"]
