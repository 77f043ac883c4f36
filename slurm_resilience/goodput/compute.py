"""Pure goodput arithmetic over a job's runs on one node.

Each run (one allocation: the first start, then one per requeue) spans ``[start, end]``.
Its losses, in the order they happen:

* ``stagein``: the agent's stage-in of the checkpoint (restart cost, any run that restores);
* ``before_first_step``: the rest of the time until the run's first step completed
  (process start, imports, NCCL init, restore, first step);
* ``checkpoint_stall``: time ranks spent inside ``section("checkpoint")``;
* ``lost_since_checkpoint``: at a failure, the work done since the last checkpoint, redone by
  the next run (from the last checkpoint to the last progress);
* ``hung_before_detection``: from the last progress to the detection of the hang;
* ``restart``: from the detection (or the last progress, for a run that ended without an
  incident while not done) to the end of the allocation: evidence, decision, requeue;
* ``after_last_step``: a run that ended well, from its last progress to the end of the
  allocation (the last save's commit, shutdown, epilog);
* ``planned_restart``: a run that saved and stopped on purpose, warned ahead of its time
  limit or preempted, from its last progress to the end of the allocation (the save at
  the stop, its commit, the requeue). Such a run loses no work: it is no failure.

Productive time is measured on its own, from step times: the steps a run kept (all of them,
or for a failed run those up to its last checkpoint, not counting the first step, whose
time is start-up) times the run's mean step time (beat to beat, less the checkpoint stalls:
the kept steps took their slow ones' time too). Every category above is an interval of
the run's timeline, so ``unexplained`` (allocated minus productive minus the losses) is what
the measurements do not cover: time lost in a way the suite does not measure (slow steps
outside checkpoints, a stall outside ``section("checkpoint")``), or, when negative, time two
measurements both claimed. A breakdown accounts for its allocation when ``unexplained`` is
within 5% of it (:data:`EXPLAINED_MIN`). A run without step times (a ledger written before
they were recorded) takes the remainder as productive, and its ``unexplained`` is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from slurm_resilience.heartbeat.attempt import relaunch_of, restarts_of

CATEGORIES = ("before_first_step", "stagein", "checkpoint_stall", "lost_since_checkpoint",
              "hung_before_detection", "restart", "after_last_step", "planned_restart")
EXPLAINED_MIN = 0.95  # productive + losses cover at least this share of the allocation


@dataclass(frozen=True)
class Hang:
    """One hang incident of a run (from its report)."""

    started_at: float  # last progress of the earliest hung rank
    detected_at: float


@dataclass(frozen=True)
class Run:
    run: int
    start: float
    end: float
    first_step_at: float | None = None
    last_progress_at: float | None = None
    last_checkpoint_at: float | None = None  # last local checkpoint commit before the end
    stagein_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    done: bool = False  # the training loop said it finished
    hang: Hang | None = None
    steps: int | None = None  # steps completed after the first one (None: not recorded)
    steps_at_checkpoint: int | None = None  # of those, the ones the last checkpoint kept
    step_time_s: float | None = None  # the run's mean step time
    planned: bool = False  # stopped on purpose (time limit ahead, preemption) after a save


@dataclass(frozen=True)
class RunBreakdown:
    run: int
    allocated_s: float
    productive_s: float
    losses: dict[str, float]
    unexplained_s: float = 0.0
    measured: bool = False  # productive_s comes from step times (else it is the remainder)


@dataclass(frozen=True)
class Breakdown:
    job_id: int
    runs: tuple[RunBreakdown, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def allocated_s(self) -> float:
        return sum(r.allocated_s for r in self.runs)

    @property
    def productive_s(self) -> float:
        return sum(r.productive_s for r in self.runs)

    @property
    def losses(self) -> dict[str, float]:
        return {c: sum(r.losses[c] for r in self.runs) for c in CATEGORIES}

    @property
    def ratio(self) -> float:
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else 0.0

    @property
    def unexplained_s(self) -> float:
        return sum(r.unexplained_s for r in self.runs)

    @property
    def accounted_s(self) -> float:
        """Productive time and the losses: what the measurements explain."""
        return self.productive_s + sum(self.losses.values())

    @property
    def explained_share(self) -> float:
        """1 minus the unexplained share of the allocation (its magnitude: time claimed
        twice is as unexplained as time claimed by nothing)."""
        if self.allocated_s <= 0:
            return 1.0
        return max(0.0, 1.0 - abs(self.unexplained_s) / self.allocated_s)

    @property
    def explained(self) -> bool:
        return self.explained_share >= EXPLAINED_MIN


def _clip(t: float, lo: float, hi: float) -> float:
    return min(max(t, lo), hi)


def run_breakdown(r: Run, ended: bool, ok: bool = False) -> RunBreakdown:
    """``ended``: the run is over (a later run exists, or Slurm says the job ended); ``ok``:
    it ended well (Slurm says COMPLETED), even if the loop never said it was done."""
    allocated = max(0.0, r.end - r.start)
    losses = dict.fromkeys(CATEGORIES, 0.0)
    if r.first_step_at is None:
        # No step at all: the whole allocation went to starting up (and stage-in).
        losses["stagein"] = min(r.stagein_s, allocated)
        losses["before_first_step"] = allocated - losses["stagein"]
        return RunBreakdown(r.run, allocated, 0.0, losses, 0.0, r.steps is not None)
    first = _clip(r.first_step_at, r.start, r.end)
    losses["stagein"] = min(r.stagein_s, first - r.start)
    losses["before_first_step"] = first - r.start - losses["stagein"]
    # A planned stop flags itself before its save: the tick that sees the save's end (done)
    # may never come before the requeue ends the run.
    failed = r.hang is not None or (ended and not r.done and not ok and not r.planned)
    last = _clip(r.last_progress_at if r.last_progress_at is not None else first, first, r.end)
    stop = r.end
    kept = r.steps
    if failed:
        if r.hang is not None:
            last = _clip(min(last, r.hang.started_at), first, r.end)
            detected = _clip(r.hang.detected_at, last, r.end)
            losses["hung_before_detection"] = detected - last
            losses["restart"] = r.end - detected
        else:
            losses["restart"] = r.end - last
        ckpt = r.last_checkpoint_at
        if ckpt is None or ckpt < first:
            ckpt, kept = first, 0  # nothing this run did was kept
        else:
            ckpt, kept = min(ckpt, last), r.steps_at_checkpoint
        losses["lost_since_checkpoint"] = last - ckpt
        stop = ckpt
    elif ended:
        losses["planned_restart" if r.planned else "after_last_step"] = r.end - last
        stop = last
    losses["checkpoint_stall"] = min(r.checkpoint_stall_s, max(0.0, stop - first))
    rest = max(0.0, allocated - sum(losses.values()))
    if kept is None or r.step_time_s is None:
        return RunBreakdown(r.run, allocated, rest, losses)
    productive = max(0, kept) * max(0.0, r.step_time_s)
    return RunBreakdown(r.run, allocated, productive, losses, rest - productive, True)


def in_order(run: int) -> tuple[int, int]:
    """A run's place in time: Slurm's restarts, then the launcher's relaunch inside that
    allocation (run numbers are ``restarts + 1000 * relaunch``, heartbeat.attempt)."""
    return restarts_of(run), relaunch_of(run)


def run_label(run: int) -> str:
    restarts, relaunch = in_order(run)
    return f"run {restarts}" + (f" relaunch {relaunch}" if relaunch else "")


def breakdown(job_id: int, runs: Sequence[Run], last_over: bool, completed: bool = False
              ) -> Breakdown:
    """``last_over``: the newest run is over too; ``completed``: the job completed."""
    ordered = sorted(runs, key=lambda r: in_order(r.run))
    last = len(ordered) - 1
    out = tuple(run_breakdown(r, last_over or i < last, completed and i == last)
                for i, r in enumerate(ordered))
    guessed = [run_label(r.run) for r in out if not r.measured and r.allocated_s > 0]
    notes = (f"no step times recorded for {', '.join(guessed)}: their "
             "productive time is what the losses leave",) if guessed else ()
    return Breakdown(job_id, out, notes)


def render(b: Breakdown) -> str:
    def line(name: str, seconds: float) -> str:
        share = seconds / b.allocated_s if b.allocated_s else 0.0
        return f"  {name:<24} {seconds:>10.1f} s  {share:>6.1%}"

    lines = [f"job {b.job_id}: goodput {b.ratio:.1%} of {b.allocated_s:.1f} s allocated "
             f"over {len(b.runs)} run(s)",
             line("productive (step times)", b.productive_s)]
    lines += [line(c.replace("_", " "), s) for c, s in b.losses.items()]
    lines.append(line("unexplained", b.unexplained_s))
    lines.append(f"  the measurements explain {b.explained_share:.1%} of the allocated time"
                 + ("" if b.explained else
                    f" (under {EXPLAINED_MIN:.0%}: some loss is not measured)"))
    for r in b.runs:
        lost = ", ".join(f"{c.replace('_', ' ')} {s:.1f}s" for c, s in r.losses.items() if s)
        lines.append(f"  {run_label(r.run)}: {r.allocated_s:.1f} s allocated, "
                     f"{r.productive_s:.1f} s "
                     f"productive" + (f"; {lost}" if lost else ""))
    lines += [f"  note: {n}" for n in b.notes]
    return "\n".join(lines) + "\n"
