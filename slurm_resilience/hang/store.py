"""The incidents this agent acted on, on disk, so a restart neither acts twice nor forgets.

Claiming a run of a job creates ``<state>/acted/<job>-<run>`` with ``O_EXCL`` (two agents, or
an agent and its restarted twin, cannot both win). The file then holds the incident's plan and
how far it got; one still ``acting`` after a restart is resumed from its next step. A claim
also holds what the decision is made from (:class:`ClaimBasis`), so one whose plan was never
saved (a crash between claim and plan) is decided again after a restart, not forgotten. At most
``max_handled`` markers are kept (oldest removed), and none older than the retention.
"""

from __future__ import annotations

import enum
import json
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypedDict

from slurm_resilience import safefs
from slurm_resilience.hang.actions import Step, StepDoc, step_from_json
from slurm_resilience.hang.blame import Blame
from slurm_resilience.log import get_logger

log = get_logger("heartbeat.store")

Key = tuple[int, int]


class ProgressState(str, enum.Enum):
    """How far an incident got; stored as the value."""

    CLAIMED = "claimed"
    ACTING = "acting"
    DONE = "done"
    GAVE_UP = "gave-up"

    def __str__(self) -> str:
        return str(self.value)


UNFINISHED = frozenset({ProgressState.CLAIMED, ProgressState.ACTING})


class BlameRecordDoc(TypedDict):
    drains: list[list[str]]  # [node, reason] pairs
    ranks: list[int]
    rule: str
    explanation: str


class BasisDoc(TypedDict):
    mode: str
    self_reported: bool
    blame: BlameRecordDoc


@dataclass(frozen=True)
class ClaimBasis:
    """The incident's own inputs to the decision, saved with the claim. Slurm's facts (the
    job, node reasons for the budget) and the committed checkpoint are read again when a
    restarted agent decides from it."""

    mode: str
    self_reported: bool
    blame: Blame

    def to_json(self) -> BasisDoc:
        b = self.blame
        return {"mode": self.mode, "self_reported": self.self_reported,
                "blame": {"drains": [[n, r] for n, r in b.drains], "ranks": list(b.ranks),
                          "rule": b.rule, "explanation": b.explanation}}


def _basis_from_json(data: object) -> ClaimBasis | None:
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("blame"), dict):
        raise ValueError("basis is not an object")
    b = data["blame"]
    drains = tuple((str(n), str(r)) for n, r in b["drains"])
    return ClaimBasis(str(data["mode"]), bool(data["self_reported"]),
                      Blame(drains, tuple(int(r) for r in b["ranks"]), str(b["rule"]),
                            str(b["explanation"])))


class ProgressDoc(TypedDict):
    job_id: int
    run: int
    state: str  # a ProgressState's value
    plan: list[StepDoc]
    done: int
    deadline: float
    report: str
    basis: BasisDoc | None


@dataclass(frozen=True)
class Progress:
    """A claimed incident: its plan, steps done, deadline (wall time), report file and, while
    only claimed, what its decision is made from."""

    job_id: int
    run: int
    state: ProgressState
    plan: tuple[Step, ...] = ()
    done: int = 0
    deadline: float = 0.0
    report: str = ""
    basis: ClaimBasis | None = None

    def __post_init__(self) -> None:
        # Callers may still pass the value ("acting"): always hold the member.
        object.__setattr__(self, "state", ProgressState(self.state))

    def to_json(self) -> ProgressDoc:
        return {"job_id": self.job_id, "run": self.run, "state": self.state.value,
                "plan": [s.to_json() for s in self.plan], "done": self.done,
                "deadline": self.deadline, "report": self.report,
                "basis": self.basis.to_json() if self.basis else None}


def _from_json(data: object) -> Progress:
    """A progress file's content; ValueError (an unknown state too) when it is mis-shaped."""
    if not isinstance(data, dict):
        raise ValueError("not an object")
    return Progress(int(data["job_id"]), int(data["run"]), ProgressState(data["state"]),
                    tuple(step_from_json(s) for s in data.get("plan", [])),
                    int(data.get("done", 0)), float(data.get("deadline", 0.0)),
                    str(data.get("report", "")), _basis_from_json(data.get("basis")))


class IncidentStore:
    def __init__(self, directory: str, max_handled: int = 4096):
        self.directory = directory
        self.max_handled = max_handled
        # In-memory view of which runs were seen (claimed here or elsewhere), newest last.
        self.seen: OrderedDict[Key, None] = OrderedDict()

    @staticmethod
    def name(job_id: int, run: int) -> str:
        return f"{int(job_id)}-{int(run)}"

    def _dir(self) -> int:
        return safefs.makedirs_root(self.directory)

    def remember(self, key: Key) -> bool:
        """Note a run as handled in memory; False when it already was (bounded, LRU)."""
        if key in self.seen:
            self.seen.move_to_end(key)
            return False
        self.seen[key] = None
        while len(self.seen) > self.max_handled:
            self.seen.popitem(last=False)
        return True

    def claim(self, job_id: int, run: int, deadline: float,
              basis: ClaimBasis | None = None) -> bool:
        """Atomically claim acting on this run; False when it was claimed before."""
        fd = self._dir()
        try:
            claimed = Progress(job_id, run, ProgressState.CLAIMED, deadline=deadline,
                               basis=basis)
            data = json.dumps(claimed.to_json())
            safefs.write_new(fd, self.name(job_id, run), data.encode())
            return True
        except FileExistsError:
            return False
        finally:
            os.close(fd)

    def save(self, progress: Progress) -> None:
        fd = self._dir()
        try:
            safefs.replace_file(fd, self.name(progress.job_id, progress.run),
                                json.dumps(progress.to_json()).encode())
        finally:
            os.close(fd)

    def load(self, job_id: int, run: int) -> Progress | None:
        try:
            fd = safefs.open_dir(self.directory)
        except FileNotFoundError:
            return None
        try:
            raw = safefs.read_owned_file(fd, self.name(job_id, run), os.geteuid(),
                                         max_bytes=1 << 20)
            data = json.loads(raw)
            if isinstance(data, (int, float)):
                # A marker of an earlier release (the claim time only): that run was handled.
                return Progress(job_id, run, ProgressState.DONE)
            return _from_json(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("heartbeat: store: couldn't read incident progress", job_id=job_id,
                      run=run, error=str(exc))
            return None
        finally:
            os.close(fd)

    def _entries(self) -> list[tuple[float, str]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            try:
                st = os.lstat(os.path.join(self.directory, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and not name.startswith("."):
                out.append((st.st_mtime, name))
        return sorted(out)

    def unfinished(self) -> list[Progress]:
        """Incidents a previous life of the agent claimed but did not finish acting on."""
        out = []
        for _, name in self._entries():
            job, _, run = name.partition("-")
            if not (job.isdigit() and run.isdigit()):
                continue
            self.remember((int(job), int(run)))
            p = self.load(int(job), int(run))
            if p is not None and p.state in UNFINISHED:
                out.append(p)
        return out

    def cleanup(self, older_than: float) -> int:
        """Remove markers older than ``older_than`` and any beyond the newest max_handled."""
        entries = self._entries()
        excess = max(0, len(entries) - self.max_handled)
        removed = 0
        for i, (mtime, name) in enumerate(entries):
            if i < excess or mtime < older_than:
                try:
                    os.unlink(os.path.join(self.directory, name))
                    removed += 1
                except FileNotFoundError:
                    continue
        return removed
