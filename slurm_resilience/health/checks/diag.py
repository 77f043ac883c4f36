"""Active diagnostics judged: DCGM's per-test verdicts, or the torch memory test measured
against the expected bandwidth of the GPU model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slurm_resilience import gpu_models
from slurm_resilience.config.health import DiagCheckSection
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown, warn

if TYPE_CHECKING:
    from slurm_resilience.health.collectors.cuda_memtest import MemtestReport
    from slurm_resilience.health.collectors.dcgm import DiagReport

NAME = "diag"


def _by_model(table: dict[str, float], name: str) -> float | None:
    return next((v for m, v in table.items() if gpu_models.matches(m, name)), None)


def check_dcgm(report: DiagReport, state: dict[str, Any], now: float) -> CheckResult:
    if report.error:
        return CheckResult([unknown(NAME, "dcgmi", f"couldn't run DCGM diagnostics: "
                                                   f"{report.error}")], state)
    out: list[Finding] = []
    for r in report.results:
        subject = f"gpu{r.gpu}" if r.gpu is not None else "node"
        detail = f": {r.warnings[0][:120]}" if r.warnings else ""
        if r.status == "fail":
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


def check_memtest(report: MemtestReport, cfg: DiagCheckSection, state: dict[str, Any],
                  now: float) -> CheckResult:
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


def _done(out: list[Finding], passed: str, state: dict[str, Any], now: float) -> CheckResult:
    if out:
        return CheckResult(out, state)
    # A clean active diagnostic is evidence of repair (e.g. for a fatal Xid's drain).
    return CheckResult([ok(NAME, "diag", passed)], {**state, "last_clean": now})
