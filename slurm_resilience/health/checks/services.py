"""The GPU's service units must be active (NVIDIA Fabric Manager on NVSwitch systems,
nvidia-imex and NVLSM on GB200 NVL72)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slurm_resilience.config.health import ServicesCheckSection
from slurm_resilience.health.checks.spec import CheckSpec, Collect, Judged, NoState, RunFacts
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown

if TYPE_CHECKING:
    from slurm_resilience.config import Config

NAME = "services"


@dataclass(frozen=True)
class ServicesSnapshot:
    """systemctl's word per unit (``error: ...`` where it couldn't be asked)."""

    units: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ServicesSnapshot:
        return cls({str(k): str(v) for k, v in (d.get("units") or {}).items()},
                   str(d["error"]) if d.get("error") else None)


def check(snap: ServicesSnapshot, cfg: ServicesCheckSection, state: NoState
          ) -> CheckResult[NoState]:
    if snap.error:
        return CheckResult([unknown(NAME, "systemd", f"services: {snap.error}")], state)
    out: list[Finding] = []
    units = snap.units
    for unit in cfg.units:
        got = units.get(unit, "not asked")
        if got.startswith("error:"):
            out.append(unknown(NAME, unit, f"{unit} state unknown: {got[6:].strip()}"))
        elif got != "active":
            out.append(fail(NAME, unit, f"{unit} {got} (expected active)"))
        else:
            out.append(ok(NAME, unit, f"{unit} active"))
    return CheckResult(out, state)


def _collect(cfg: Config, node: str, active: bool) -> Collect:
    import functools

    from slurm_resilience.health.collectors import services

    h = cfg.health
    return functools.partial(services.collect, list(h.services.units),
                             h.collector_timeout_s / 2)


def _judge(snap: ServicesSnapshot, state: NoState, facts: RunFacts) -> Judged[NoState]:
    return check(snap, facts.cfg.health.services, state), []


SPEC = CheckSpec(
    NAME, lambda h: h.services, ServicesSnapshot.from_json, _judge, NoState, rank=4,
    collect=_collect,
    # The hooks run no external command.
    applies=lambda h, kind: bool(h.services.units) and kind not in ("prolog", "epilog"))
