"""How a health check declares itself to the gate, and the typed state it keeps.

Each ``health/checks/<name>.py`` ends with one :class:`CheckSpec`: its name, its config
section, its collector (and how to start it), how its snapshot is read, its pure check, the
record it keeps between runs, and its rank in a drain reason. :mod:`..registry` lists them;
the gate loops over that list and knows no check by name.

Saved state is read at one boundary: :meth:`StateRecord.from_json` turns the JSON a previous
run left into the check's record, or raises ValueError naming what is wrong (the gate then
sets the file aside, says so, and judges this run without history). A check therefore never
sees a value of the wrong type, and a TypeError inside one is a bug that surfaces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from slurm_resilience.health.findings import CheckResult, Finding

if TYPE_CHECKING:
    from slurm_resilience.config import Config
    from slurm_resilience.config.health import HealthSection, Policy
    from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot


class StateRecord(Protocol):
    """What a check keeps between runs: built empty, read from and written as JSON."""

    def __init__(self) -> None: ...

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Any: ...  # an instance of ``cls``

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class NoState:
    """The record of a check that keeps nothing between runs."""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NoState:
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {}


class Section(Protocol):
    """What the gate reads of every check's config section."""

    @property
    def enabled(self) -> bool: ...

    @property
    def on_unknown(self) -> Policy: ...


@dataclass(frozen=True)
class RunFacts:
    """What a check of one gate run may read besides its own snapshot and state."""

    cfg: Config
    kind: str  # prolog, epilog, healthcheck, manual
    wanted: tuple[str, ...]  # the checks this run judges
    state_dir: str  # "" when this run keeps no state
    now: float
    expected_gpus: int | None
    job_gpus: frozenset[int] | None
    job_start: float | None
    gpu_snap: NvmlSnapshot | None
    gpu_by_pci: dict[str, int]


Snap = TypeVar("Snap")
St = TypeVar("St")
# A check's outcome: its result (None: its collector only served other checks here) and
# findings of the gate's bookkeeping done for it (a repair ledger that couldn't be read).
Judged = tuple["CheckResult[St] | None", list[Finding]]
Collect = Callable[[], dict[str, Any]]


def _always(h: HealthSection, kind: str) -> bool:
    return True


@dataclass(frozen=True)
class CheckSpec(Generic[Snap, St]):
    """One check, declared once."""

    name: str
    section: Callable[[HealthSection], Section]
    snapshot: Callable[[dict[str, Any]], Snap]  # the collector's JSON → its snapshot
    judge: Callable[[Snap, St, RunFacts], Judged[St]]
    state: type[St]  # a StateRecord
    rank: int  # lower comes first in a drain reason among findings of one severity
    # The collector, a function of (config, node, active) returning the child's job;
    # None: the check reads the collector of the check named in ``collector``.
    collect: Callable[[Config, str, bool], Collect] | None = None
    collector: str = ""  # "" → its own
    # Loads the GPUs or HCAs for minutes: runs only when a caller names it, alone, under
    # this limit (seconds).
    active_limit: Callable[[HealthSection], float] | None = None
    # Beyond ``enabled``: whether this run has anything to judge.
    applies: Callable[[HealthSection, str], bool] = _always
    # A hung collector means the hardware is stuck (FAIL); False: only that we couldn't look.
    hang_is_sick: bool = True
    # Judged before the others: its result is evidence they read (a clean diagnostic).
    first: bool = False

    @property
    def source(self) -> str:
        """The name of the collector whose snapshot this check judges."""
        return self.collector or self.name

    @property
    def active(self) -> bool:
        return self.active_limit is not None


# -- reading saved state: each helper raises ValueError naming the field --------------------


def obj(value: object, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} is a {type(value).__name__}, not an object")
    return value


def num(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} is {value!r}, not a number")
    return float(value)


def integer(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {value!r}, not an integer")
    return value


def opt_int(value: object, what: str) -> int | None:
    return None if value is None else integer(value, what)


def opt_str(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{what} is {value!r}, not a string")
    return value


def int_map(value: object, what: str) -> dict[str, int]:
    return {str(k): integer(v, f"{what}[{k!r}]") for k, v in obj(value, what).items()}


def num_list(value: object, what: str) -> tuple[float, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{what} is a {type(value).__name__}, not a list")
    return tuple(num(v, f"{what}[{i}]") for i, v in enumerate(value))
