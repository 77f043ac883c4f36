"""Active diagnostics judged: DCGM's per-test verdicts, or the torch memory test measured
against the expected bandwidth of the GPU model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slurm_resilience import gpu_models
from slurm_resilience.config.health import DiagCheckSection
from slurm_resilience.health.checks.spec import CheckSpec, Collect, Judged, RunFacts, num
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown, warn

if TYPE_CHECKING:
    from slurm_resilience.config import Config
    from slurm_resilience.health.collectors.cuda_memtest import MemtestReport
    from slurm_resilience.health.collectors.dcgm import DiagReport

NAME = "diag"


@dataclass(frozen=True)
class DiagState:
    """When the active diagnostics last passed (repair evidence for fatal Xids)."""

    last_clean: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DiagState:
        when = data.get("last_clean")
        return cls(None if when is None else num(when, "last_clean"))

    def to_json(self) -> dict[str, Any]:
        return {} if self.last_clean is None else {"last_clean": self.last_clean}


def _by_model(table: dict[str, float], name: str) -> float | None:
    return next((v for m, v in table.items() if gpu_models.matches(m, name)), None)


def check_dcgm(report: DiagReport, state: DiagState, now: float,
               cfg: DiagCheckSection | None = None) -> CheckResult[DiagState]:
    """DCGM's verdicts, each failure judged by its error ids (:mod:`dcgm_errors`):
    hardware drains, a reset-requiring error drains with that action, a setting is a
    finding naming the setting and fix (``dcgm_setting_severity``), a test DCGM could not
    run is "could not check". The reason names the error id and DCGM's advice."""
    from slurm_resilience.health import dcgm_errors

    if report.error:
        return CheckResult([unknown(NAME, "dcgmi", f"couldn't run DCGM diagnostics: "
                                                   f"{report.error}")], state)
    setting = (cfg or DiagCheckSection()).dcgm_setting_severity
    out: list[Finding] = []
    for r in report.results:
        subject = f"gpu{r.gpu}" if r.gpu is not None else "node"
        detail = f": {r.warnings[0][:120]}" if r.warnings else ""
        if r.status == "fail" and r.error_ids:
            codes = [dcgm_errors.code(i, r.error_severities.get(i)) for i in r.error_ids]
            worst = dcgm_errors.worst(codes)
            ids = ",".join(str(i) for i in r.error_ids)
            name = f" {worst.name}" if worst.name else ""
            need = ", reset required" if worst.kind is dcgm_errors.Kind.RESET else ""
            what = (f"{subject} DCGM {r.test} Fail, error {ids}{name}: {worst.action}{need}"
                    f"{detail}")[:230] + " (expected Pass)"
            data = {"error_ids": r.error_ids, "dcgm_kind": worst.kind.value,
                    "dcgm_action": worst.action}
            if worst.kind is dcgm_errors.Kind.SETTING:
                out.append((fail if setting == "fail" else warn)(NAME, subject, what, **data))
            elif worst.kind is dcgm_errors.Kind.TOOLING:
                out.append(unknown(NAME, subject, what, **data))
            elif worst.kind is dcgm_errors.Kind.MONITOR:
                out.append(warn(NAME, subject, what, **data))
            else:
                out.append(fail(NAME, subject, what, **data))
        elif r.status == "fail":
            out.append(fail(NAME, subject, f"{subject} DCGM {r.test} Fail{detail} "
                                           "(expected Pass)", error_ids=r.error_ids))
        elif r.status == "warn":
            out.append(warn(NAME, subject, f"{subject} DCGM {r.test} Warn{detail}"))
    if not any(r.status in ("pass", "fail", "warn") for r in report.results):
        # Every test skipped (or none reported): nothing was tested, which is no pass.
        out.append(unknown(NAME, "dcgmi", f"DCGM diagnostics tested nothing "
                                          f"({len(report.results)} results, all skipped)"))
    version = f"DCGM {report.version}" if report.version else "DCGM"
    return _done(out, f"{version} diagnostics passed ({len(report.results)} results)",
                 state, now)


def check_memtest(report: MemtestReport, cfg: DiagCheckSection, state: DiagState,
                  now: float) -> CheckResult[DiagState]:
    if report.unavailable:
        return CheckResult([unknown(NAME, "memtest", f"couldn't run the GPU memory test: "
                                                     f"{report.unavailable}")], state)
    out: list[Finding] = []
    for g in report.gpus:
        subject = f"gpu{g.index}"
        if g.mismatches:
            out.append(fail(NAME, subject, f"{subject} {g.mismatches} memory mismatches in "
                                           f"{g.bytes_tested >> 20}MiB (expected 0)"))
        hbm = _by_model(cfg.min_hbm_gbps_by_model, g.name)
        if hbm is not None and g.hbm_gbps < hbm:
            out.append(fail(NAME, subject, f"{subject} HBM copy {g.hbm_gbps:.0f}GB/s "
                                           f"(expected >={hbm:g} for {g.name})"))
        host = _by_model(cfg.min_host_gbps_by_model, g.name)
        for what, value in (("host-to-device", g.h2d_gbps), ("device-to-host", g.d2h_gbps)):
            if host is not None and value < host:
                out.append(fail(NAME, subject, f"{subject} {what} {value:.1f}GB/s "
                                               f"(expected >={host:g} for {g.name})"))
    return _done(out, f"GPU memory test passed on {len(report.gpus)} GPUs", state, now)


def _done(out: list[Finding], passed: str, state: DiagState, now: float) -> CheckResult[DiagState]:
    if out:
        return CheckResult(out, state)
    # A clean active diagnostic ends what a diagnostic can clear (an Xid repeat request).
    return CheckResult([ok(NAME, "diag", passed)], dataclasses.replace(state, last_clean=now))


def _collect(cfg: Config, node: str, active: bool) -> Collect:
    import functools

    from slurm_resilience.health.collectors import diag

    d = cfg.health.diag
    return functools.partial(diag.collect_json, d.tool, d.level, d.timeout_s, d.memtest_bytes,
                             d.memtest_iters)


def _snapshot(data: dict[str, Any]) -> DiagReport | MemtestReport:
    # Imported only when the diagnostics run, so they stay off the hooks' path.
    from slurm_resilience.health.collectors import cuda_memtest, dcgm

    return dcgm.from_json(data["dcgm"]) if "dcgm" in data else cuda_memtest.from_json(
        data["memtest"])


def _judge(snap: DiagReport | MemtestReport, state: DiagState, facts: RunFacts
           ) -> Judged[DiagState]:
    from slurm_resilience.health.collectors.dcgm import DiagReport

    if isinstance(snap, DiagReport):
        result = check_dcgm(snap, state, facts.now, facts.cfg.health.diag)
        covered = {r.gpu for r in snap.results if r.gpu is not None}
    else:
        result = check_memtest(snap, facts.cfg.health.diag, state, facts.now)
        covered = {g.index for g in snap.gpus}
    extra = (_record_repairs(facts.state_dir, facts.gpu_by_pci, covered, facts.now)
             if result.state.last_clean == facts.now else [])
    return result, extra


def _record_repairs(state_dir: str, gpu_by_pci: dict[str, int], covered: set[int],
                    now: float) -> list[Finding]:
    """A clean active diagnostic is recorded for the GPUs it tested (kind ``diag``) in the
    repair ledger, read by the Xid check of this run and every later one: it ends what a
    diagnostic can clear (repeat requests), never a reset- or reboot-requiring Xid."""
    from slurm_resilience.health import xid_repairs

    if not state_dir:
        return [warn("xid", "repairs", "clean diagnostic not recorded as a repair: no state "
                                       "directory")]
    try:
        for pci, index in sorted(gpu_by_pci.items()):
            if index in covered:
                xid_repairs.record(state_dir, xid_repairs.Repair(
                    pci, now, xid_repairs.DIAG_EVIDENCE, xid_repairs.DIAG))
    except OSError as exc:
        return [warn("xid", "repairs", f"clean diagnostic not recorded as a repair: {exc}")]
    return []


# Judged first: a clean diagnostic is repair evidence the Xid check of the same run reads.
SPEC = CheckSpec(NAME, lambda h: h.diag, _snapshot, _judge, DiagState, rank=2,
                 collect=_collect, active_limit=lambda h: h.diag.timeout_s, first=True)
