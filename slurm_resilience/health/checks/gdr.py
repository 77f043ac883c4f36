"""GPUDirect RDMA loopback bandwidth per HCA, measured against the figure for the
port's link rate (aznhc ships 380/360 Gb/s per NDR HCA for the same loopback test)."""

from __future__ import annotations

from typing import Any

from slurm_resilience.config.health import GdrCheckSection
from slurm_resilience.health.collectors.perftest import PerftestSnapshot
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown

NAME = "gdr"


def _expected(cfg: GdrCheckSection, link: float | None) -> float | None:
    if link is None:
        return None
    return next((v for rate, v in cfg.min_gbps_by_link_rate.items() if float(rate) == link),
                None)


def check(snap: PerftestSnapshot, cfg: GdrCheckSection, state: dict[str, Any]) -> CheckResult:
    if not snap.installed:
        return CheckResult([unknown(NAME, "perftest", "GPUDirect RDMA loopback not measured: "
                                                      "ib_write_bw (perftest) not installed")],
                           state)
    if not snap.results:
        return CheckResult([unknown(NAME, "perftest", "GPUDirect RDMA loopback not measured: "
                                                      "no HCA found")], state)
    out: list[Finding] = []
    for r in snap.results:
        memory = f"gpu{r.gpu}" if r.gpu is not None else "host memory"
        if r.gbps is None:
            out.append(unknown(NAME, r.hca, f"{r.hca} loopback ({memory}) not measured: "
                                            f"{r.error}"))
            continue
        want = _expected(cfg, r.link_gbps)
        if want is None:
            out.append(unknown(NAME, r.hca, f"{r.hca} loopback {r.gbps:g}Gb/s ({memory}): no "
                                            f"threshold for a {r.link_gbps}Gb/s link",
                               gbps=r.gbps))
        elif r.gbps < want:
            out.append(fail(NAME, r.hca, f"{r.hca} GPUDirect RDMA loopback {r.gbps:g}Gb/s "
                                         f"({memory}; expected >={want:g})", gbps=r.gbps))
        else:
            out.append(ok(NAME, r.hca, f"{r.hca} loopback {r.gbps:g}Gb/s ({memory})",
                          gbps=r.gbps))
    return CheckResult(out, state)
