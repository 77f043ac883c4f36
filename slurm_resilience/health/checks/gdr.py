"""GPUDirect RDMA loopback bandwidth per HCA, measured against the figure for the
port's link rate (aznhc ships 380/360 Gb/s per NDR HCA for the same loopback test)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_resilience.config.health import GdrCheckSection
from slurm_resilience.config.paths import node_path
from slurm_resilience.health.checks.spec import CheckSpec, Collect, Judged, NoState, RunFacts
from slurm_resilience.health.collectors.perftest import PerftestSnapshot
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown

if TYPE_CHECKING:
    from slurm_resilience.config import Config

NAME = "gdr"


def _expected(cfg: GdrCheckSection, link: float | None) -> float | None:
    if link is None:
        return None
    return next((v for rate, v in cfg.min_gbps_by_link_rate.items() if float(rate) == link),
                None)


def check(snap: PerftestSnapshot, cfg: GdrCheckSection, state: NoState
          ) -> CheckResult[NoState]:
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


def _collect(cfg: Config, node: str, active: bool) -> Collect:
    import functools

    from slurm_resilience.health.collectors import perftest

    h = cfg.health
    return functools.partial(
        perftest.collect_json, node_path(h.infiniband.sysfs_root, node), list(h.gdr.args),
        h.gdr.port, h.gdr.timeout_s, dict(h.gdr.gpu_by_hca), h.gdr.max_hcas)


def _judge(snap: PerftestSnapshot, state: NoState, facts: RunFacts) -> Judged[NoState]:
    return check(snap, facts.cfg.health.gdr, state), []


SPEC = CheckSpec(NAME, lambda h: h.gdr, PerftestSnapshot.from_json, _judge, NoState, rank=6,
                 collect=_collect,
                 active_limit=lambda h: (h.gdr.timeout_s + 2) * h.gdr.max_hcas + 5)
