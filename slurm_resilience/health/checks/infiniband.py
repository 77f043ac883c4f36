"""InfiniBand checks: every expected rail present, ACTIVE/LinkUp at rate, counters quiet.

Counters are compared with the previous run's values (kept in the state), so a
port that accumulated errors months ago is not failed forever; a counter that
went down was reset and becomes the new baseline.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from slurm_resilience import gpu_models
from slurm_resilience.config.health import InfinibandCheckSection
from slurm_resilience.health.collectors.infiniband import IbSnapshot
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown, warn

NAME = "infiniband"

# Widths of the IB PortCounters (they stop at their maximum instead of wrapping).
SATURATED = {"symbol_error": 0xFFFF, "link_error_recovery": 0xFF, "link_downed": 0xFF,
             "port_rcv_errors": 0xFFFF, "excessive_buffer_overrun_errors": 0xF,
             "local_link_integrity_errors": 0xF, "port_xmit_discards": 0xFFFF}
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")


def _word(value: str | None) -> str:
    """``4: ACTIVE`` → ``ACTIVE``; ``5: LinkUp`` → ``LinkUp``."""
    if value is None:
        return "?"
    return value.split(":", 1)[-1].strip()


def rate_gbps(value: str | None) -> float | None:
    m = _RATE.match(value or "")
    return float(m.group(1)) if m else None


def _gbps(x: float) -> str:
    return f"{x:g}Gb/s"


def _expected_hcas(snap: IbSnapshot, cfg: InfinibandCheckSection) -> list[str]:
    if cfg.expected_hcas:
        return list(cfg.expected_hcas)
    return [h for h, e in snap.hcas.items()
            if any(p.link_layer == "InfiniBand" for p in e.ports.values())]


def _counters(subject: str, cur: dict[str, int | None], prev: dict[str, int],
              limits: dict[str, int]) -> tuple[list[Finding], dict[str, int]]:
    out: list[Finding] = []
    keep: dict[str, int] = {}
    for name, limit in sorted(limits.items()):
        value = cur.get(name)
        if value is None:
            continue
        keep[name] = value
        before = prev.get(name)
        if before is not None and value >= before:
            delta = value - before
            if delta > limit:
                if name == "link_downed":
                    out.append(fail(NAME, subject, f"{subject} link flapped {delta}x "
                                                   f"(link_downed +{delta}, expected <={limit})"))
                else:
                    out.append(fail(NAME, subject, f"{subject} {name} +{delta} "
                                                   f"(expected <={limit})"))
        if SATURATED.get(name) == value:
            out.append(warn(NAME, subject, f"{subject} {name} saturated at {value}: further "
                                           "errors are invisible (clear it with perfquery -R)"))
    return out, keep


def model_defaults(cfg: InfinibandCheckSection, gpu_model: str | None
                   ) -> tuple[int, float]:
    """(HCA count, least rate) shipped for the node's GPU model; (0, 0) when none fits."""
    if not gpu_model:
        return 0, 0.0
    hcas = next((n for m, n in cfg.hcas_by_gpu_model.items()
                 if gpu_models.matches(m, gpu_model)), 0)
    rate = next((r for m, r in cfg.min_rate_gbps_by_gpu_model.items()
                 if gpu_models.matches(m, gpu_model)), 0.0)
    return hcas, rate


def check(snap: IbSnapshot, cfg: InfinibandCheckSection, state: dict[str, Any],
          gpu_model: str | None = None) -> CheckResult:
    """``gpu_model``: the NVML name of the node's GPUs, for the shipped per-model HCA
    count and rate (used where the site set neither)."""
    if snap.error:
        return CheckResult([unknown(NAME, "sysfs", f"infiniband: {snap.error}")], state)
    findings: list[Finding] = []
    prev_all: dict[str, dict[str, int]] = state.get("counters", {})
    baseline: dict[str, dict[str, int]] = {}
    expected = _expected_hcas(snap, cfg)
    want_hcas, model_rate = model_defaults(cfg, gpu_model)
    if not cfg.expected_hcas and expected and want_hcas and len(expected) < want_hcas:
        findings.append(fail(NAME, "hcas", f"{len(expected)} InfiniBand HCAs (expected "
                                           f"{want_hcas} for {gpu_model})"))
    if cfg.min_rate_gbps or not expected or not model_rate:
        model_rate = 0.0
    else:
        cfg = dataclasses.replace(cfg, min_rate_gbps=model_rate)
    want_rate = f" {_gbps(cfg.min_rate_gbps)}" if cfg.min_rate_gbps else ""
    if not expected:
        findings.append(ok(NAME, "sysfs", "no InfiniBand HCA expected or found"))
    for hca in expected:
        entry = snap.hcas.get(hca)
        if entry is None:
            findings.append(fail(NAME, hca, f"{hca} missing (expected present)"))
            continue
        if entry.error:
            findings.append(unknown(NAME, hca, f"{hca}: {entry.error}"))
            continue
        for port in cfg.ports:
            subject = f"{hca} port{port}"
            pinfo = entry.ports.get(str(port))
            if pinfo is None:
                findings.append(fail(NAME, subject, f"{subject} missing (expected present)"))
                continue
            before = len(findings)
            state_word, phys = _word(pinfo.state), _word(pinfo.phys_state)
            if state_word != "ACTIVE":
                findings.append(fail(NAME, subject, f"{subject} {state_word} "
                                                    f"(expected ACTIVE{want_rate})"))
            elif phys != "LinkUp":
                findings.append(fail(NAME, subject, f"{subject} phys {phys} (expected LinkUp)"))
            rate = rate_gbps(pinfo.rate)
            if state_word == "ACTIVE" and cfg.min_rate_gbps and (
                    rate is None or rate < cfg.min_rate_gbps):
                shown = _gbps(rate) if rate is not None else repr(pinfo.rate)
                findings.append(fail(NAME, subject, f"{subject} {shown} "
                                                    f"(expected >={_gbps(cfg.min_rate_gbps)})"))
            key = f"{hca}/{port}"
            found, baseline[key] = _counters(subject, pinfo.counters,
                                             prev_all.get(key, {}), dict(cfg.max_counter_delta))
            if state_word != "ACTIVE":
                # The link is down now: that is the finding, not the link_downed tick it caused.
                found = [f for f in found if "link flapped" not in f.message]
            findings.extend(found)
            if len(findings) == before:
                findings.append(ok(NAME, subject, f"{subject} ACTIVE LinkUp "
                                                  f"{pinfo.rate or '?'}"))
    return CheckResult(findings, {"counters": baseline})
