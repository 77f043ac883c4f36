"""The agent's per-job run timeline on this node, kept for goodput.

The agent's goodput service hands it the hang watcher's job views each tick; it notes per
run (the slots' restart count): when the allocation started (the prolog's record), when the first
step completed, the last progress, when the local checkpoint step last advanced, the time
ranks spent in ``section("checkpoint")``, the uploader's stage-in time, and whether the
training loop said it was done. One small root-owned JSON file per job, replaced
atomically: on each change that matters, at most every :data:`FLUSH_EVERY_S` otherwise,
and when the job leaves the node. Bounded: :data:`MAX_RUNS` runs per job; files older than
the retention are removed by :meth:`Ledger.cleanup`.

Productive time comes from step times (see :mod:`slurm_resilience.goodput.compute`): per run
the node's lowest rank's beat count, its beat count at the last checkpoint (less the steps it
had done past the checkpoint's step when the tick saw it), and the run's mean step time: from
the first beat a tick saw to the latest, less the checkpoint stalls between, over the beats
between. Until a second tick sees a beat, and in ledgers kept before that span was
recorded, the median of up to :data:`MAX_STEP_SAMPLES` step times sampled one per tick
stands in.

Resolution: a checkpoint's time is the exit of the ``checkpoint`` section that saved it
when there is one, else the tick that saw the step change; a checkpoint section shorter
than one tick is missed from the stall time (it is sampled).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from slurm_resilience.goodput.compute import Hang, Run, in_order
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.heartbeat import slot as S
from slurm_resilience.heartbeat.attempt import restarts_of
from slurm_resilience.log import get_logger

log = get_logger("goodput")

FLUSH_EVERY_S = 30.0
MAX_RUNS = 64
MAX_BYTES = 1 << 20
MAX_STEP_SAMPLES = 64
CKPT_SECTION = "checkpoint"
_NAME = re.compile(r"^job-(\d{1,12})\.json$")


@dataclass
class RunTimes:
    run: int
    start: float
    end: float
    first_step_at: float | None = None
    last_progress_at: float | None = None
    ckpt_step: int = -1
    last_checkpoint_at: float | None = None
    stagein_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    done: bool = False
    planned: bool = False  # the loop saved and stopped ahead of a time limit or preemption
    ranks_seen: bool = False  # this node had ranks of the run (a spare's record has none)
    in_section_since: float | None = None  # wall time the lowest rank entered "checkpoint"
    stall_reported: bool = False  # checkpoint_stall_s comes from save() itself
    hang_started_at: float | None = None  # from this node's hang report of the run
    hang_detected_at: float | None = None
    steps_recorded: bool = False  # the fields below were kept for this run
    beats: int = 0  # the lowest rank's beats
    beats_at_checkpoint: int | None = None
    # Step times sampled one a tick: the step time until a tick sees beats after the span's
    # first (a run first seen many beats in), and in ledgers written before the span was.
    step_times: list[float] = field(default_factory=list)
    # The mean step time's span: the lowest rank's first beat seen after its first step
    # (count, wall time, and the run's checkpoint stall by then) and its latest beat.
    anchor_beats: int = 0
    anchor_at: float | None = None
    anchor_stall_s: float = 0.0
    last_beat_at: float | None = None

    def mean_step_s(self) -> float | None:
        """The run's mean step time from beat to beat, less the checkpoint stalls between
        (None before two beats were seen). A median would leave out the tail of the steps'
        times, and the kept steps took that time too."""
        if self.anchor_at is None or self.last_beat_at is None or \
                self.beats <= self.anchor_beats:
            return None
        stalls = max(0.0, self.checkpoint_stall_s - self.anchor_stall_s)
        span = max(0.0, self.last_beat_at - self.anchor_at - stalls)
        return span / (self.beats - self.anchor_beats)

    def to_run(self) -> Run:
        hang = None
        if self.hang_detected_at is not None:
            hang = Hang(self.hang_started_at if self.hang_started_at is not None
                        else self.hang_detected_at, self.hang_detected_at)
        steps = kept = step_time = None
        if self.steps_recorded:
            # The first beat's interval is start-up (before_first_step), not a step.
            steps = max(0, self.beats - 1)
            if self.beats_at_checkpoint is not None:
                kept = max(0, self.beats_at_checkpoint - 1)
            step_time = self.mean_step_s()
            if step_time is None:  # one tick saw beats, or an older ledger: the samples
                step_time = statistics.median(self.step_times) if self.step_times else 0.0
        return Run(self.run, self.start, self.end, self.first_step_at, self.last_progress_at,
                   self.last_checkpoint_at, self.stagein_s, self.checkpoint_stall_s, self.done,
                   hang, steps, kept, step_time, self.planned)


@dataclass
class JobTimes:
    job_id: int
    runs: dict[int, RunTimes] = field(default_factory=dict)
    flushed_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "runs": [asdict(r) for r in self.runs.values()]}


def from_json(data: Any) -> JobTimes:
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError("not a goodput ledger")
    names = {f.name for f in fields(RunTimes)}
    job = JobTimes(int(data["job_id"]))
    for raw in data["runs"][-MAX_RUNS:]:
        if not isinstance(raw, dict):
            raise ValueError("a run is not an object")
        r = RunTimes(**{k: v for k, v in raw.items() if k in names})
        job.runs[int(r.run)] = r
    return job


def merge(parts: Iterable[JobTimes]) -> JobTimes | None:
    """One timeline from several nodes' ledgers of a job: a run spans from its earliest
    start to its latest end on any node; its first step is the earliest, its progress and
    checkpoint the latest, stage-in and checkpoint stalls the longest any node saw."""
    parts = list(parts)
    if not parts:
        return None
    out = JobTimes(parts[0].job_id)
    for part in parts:
        for n, r in part.runs.items():
            m = out.runs.get(n)
            if m is None:
                out.runs[n] = RunTimes(**asdict(r))
                continue
            m.start = min(m.start, r.start)
            # A run ends where the last node that ran its ranks saw it end: a spare's record
            # (no ranks of the run) lasts as long as the spare stays allocated.
            if r.ranks_seen and not m.ranks_seen:
                m.end, m.ranks_seen = r.end, True
            elif r.ranks_seen or not m.ranks_seen:
                m.end = max(m.end, r.end)
            m.first_step_at = _pick(min, m.first_step_at, r.first_step_at)
            m.last_progress_at = _pick(max, m.last_progress_at, r.last_progress_at)
            m.last_checkpoint_at = _pick(max, m.last_checkpoint_at, r.last_checkpoint_at)
            m.ckpt_step = max(m.ckpt_step, r.ckpt_step)
            m.stagein_s = max(m.stagein_s, r.stagein_s)
            m.checkpoint_stall_s = max(m.checkpoint_stall_s, r.checkpoint_stall_s)
            m.done = m.done or r.done
            m.planned = m.planned or r.planned
            m.hang_started_at = _pick(min, m.hang_started_at, r.hang_started_at)
            m.hang_detected_at = _pick(min, m.hang_detected_at, r.hang_detected_at)
            if r.steps_recorded and (not m.steps_recorded or r.beats > m.beats):
                # Ranks step together: the node that saw the most steps tells them.
                m.steps_recorded, m.beats, m.step_times = True, r.beats, list(r.step_times)
                m.anchor_beats, m.anchor_at = r.anchor_beats, r.anchor_at
                m.anchor_stall_s, m.last_beat_at = r.anchor_stall_s, r.last_beat_at
            if r.beats_at_checkpoint is not None:
                m.beats_at_checkpoint = max(m.beats_at_checkpoint or 0, r.beats_at_checkpoint)
    return out


def chain_relaunches(job: JobTimes) -> None:
    """Runs follow each other, none counted twice. Relaunches inside one allocation: each
    starts where the one before it ended (a node's record of a relaunch starts at the job's
    start on that node, a spare's with its prolog's time). Allocations: each run of one ends
    by the next allocation's start (a node whose record outlived its allocation, as one
    lost and brought back before the epilog ran, would stretch it over the next)."""
    by_restarts: dict[int, list[RunTimes]] = {}
    for n in sorted(job.runs, key=in_order):
        by_restarts.setdefault(restarts_of(n), []).append(job.runs[n])
    for runs in by_restarts.values():
        for before, after in itertools.pairwise(runs):
            if after.start < before.end:
                after.start = min(before.end, after.end)
            if after.first_step_at is not None and after.first_step_at < after.start:
                after.first_step_at = after.start
    groups = [by_restarts[k] for k in sorted(by_restarts)]
    for earlier, later in itertools.pairwise(groups):
        cut = later[0].start
        for r in earlier:
            r.end = max(r.start, min(r.end, cut))
            r.start = min(r.start, r.end)


def _pick(fn: Any, a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return a if b is None else b
    return float(fn(a, b))


def _first_step_at(slots: Iterable[S.SlotView]) -> float | None:
    """Wall time the run's first step completed: the earliest rank's first beat (a rank seen
    after several beats is wound back by its mean step time)."""
    times = [v.wall(v.last_beat) - max(0, v.beats - 1) * v.ewma_dt
             for v in slots if v.beats >= 1]
    return min(times) if times else None


def note_hangs(job: JobTimes, reports: Iterable[Mapping[str, Any]]) -> None:
    """Hang facts of each run from its hang reports (this node's)."""
    for rep in reports:
        try:
            r = job.runs.get(int(rep.get("restart", -1)))
            detected = float(rep["detected_at"])
        except (KeyError, TypeError, ValueError):
            continue
        if r is None:
            continue
        started = rep.get("timings", {}).get("hang_started_at")
        if started is None:
            hung = [float(x["last_progress_at"]) for x in rep.get("ranks", [])
                    if isinstance(x, dict) and x.get("state") == "hung"
                    and x.get("last_progress_at") is not None]
            started = min(hung) if hung else None
        r.hang_detected_at = detected
        r.hang_started_at = float(started) if started is not None else None


class Ledger:
    def __init__(self, directory: str, incident_dir: str = ""):
        self.directory = directory
        self.incident_dir = incident_dir
        self.jobs: dict[int, JobTimes] = {}

    def path(self, job_id: int) -> str:
        return os.path.join(self.directory, f"job-{int(job_id)}.json")

    def load(self, job_id: int) -> JobTimes | None:
        try:
            fd = os.open(self.path(job_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as fh:
            return from_json(json.loads(fh.read(MAX_BYTES)))

    def save(self, job: JobTimes, now: float) -> None:
        os.makedirs(self.directory, mode=0o755, exist_ok=True)
        path = self.path(job.job_id)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(job.to_json(), fh)
        os.replace(tmp, path)
        job.flushed_at = now

    def _job(self, job_id: int) -> JobTimes:
        job = self.jobs.get(job_id)
        if job is None:
            try:
                job = self.load(job_id)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("goodput: ledger unreadable; starting afresh",
                            path=self.path(job_id), error=str(exc))
                job = None
            job = job or JobTimes(job_id)
            self.jobs[job_id] = job
        return job

    def observe(self, views: Iterable[JobView], now: float,
                stagein_s: dict[int, float] | None = None,
                stalls: dict[int, tuple[int, float]] | None = None,
                stops: Mapping[int, int] | None = None) -> None:
        """One tick: update every present job, flush what changed, close jobs that left.
        ``stalls``: per job, the run and the total save() stall its training reported;
        ``stops``: per job, the run that saved and stopped on purpose (the limits service
        heard it: its ranks' flag may have gone with the job before a tick read it)."""
        present = set()
        for view in views:
            job_id = view.record.job_id
            present.add(job_id)
            job = self._job(job_id)
            changed = self._update(job, view, now, (stagein_s or {}).get(job_id))
            run, reported = (stalls or {}).get(job_id, (-1, 0.0))
            r = job.runs.get(run)
            if r is not None and reported > r.checkpoint_stall_s:
                # Measured by save() itself: better than the sampled section time.
                r.checkpoint_stall_s, r.in_section_since = reported, None
                r.stall_reported = True
                changed = True
            if changed or now - job.flushed_at >= FLUSH_EVERY_S:
                self._flush(job, now)
        for job_id, run in (stops or {}).items():
            stopped = self.jobs.get(job_id)
            r = stopped.runs.get(run) if stopped is not None else None
            if stopped is not None and r is not None and not r.planned:
                r.planned = True
                if job_id in present:
                    self._flush(stopped, now)
        for job_id in set(self.jobs) - present:
            job = self.jobs.pop(job_id)
            self._flush(job, now)  # its end is the last tick that saw it

    def _flush(self, job: JobTimes, now: float) -> None:
        try:
            self.save(job, now)
        except OSError as exc:
            log.warning("goodput: couldn't save the ledger", path=self.path(job.job_id),
                        error=str(exc))

    def _update(self, job: JobTimes, view: JobView, now: float, stagein: float | None) -> bool:
        slots = view.slots
        run_no = max((v.restart_count for v in slots), default=0)
        r = job.runs.get(run_no)
        changed = False
        if r is None:
            r = job.runs[run_no] = RunTimes(run_no, view.record.started, now)
            chain_relaunches(job)  # a relaunch starts where the run before it ended
            while len(job.runs) > MAX_RUNS:
                del job.runs[min(job.runs)]
            if len(job.runs) > 1 and self.incident_dir:
                # A requeued run: the earlier runs' hang reports are written by now.
                from slurm_resilience.hang.incident import reports_of_job

                note_hangs(job, reports_of_job(self.incident_dir, job.job_id))
            changed = True
        # The run goes on here while one of its ranks does: a node whose ranks died (an Xid,
        # or the step relaunched without it) can stay in the allocation, drained, until
        # the job ends, and must not stretch the run to then. A node that never had ranks
        # (start-up, a spare) keeps the run's end too; merge() prefers the nodes that had.
        if slots and not r.ranks_seen:
            r.ranks_seen, changed = True, True
        if any(k.state != "dead" for k in view.verdict.ranks) or not (
                view.verdict.ranks or r.ranks_seen):
            r.end = now
        if r.first_step_at is None:
            first = _first_step_at(slots)
            if first is not None:
                r.first_step_at = max(first, r.start)
                changed = True
        if slots:
            r.last_progress_at = max(v.wall(v.last_progress) for v in slots)
            lead = min(slots, key=lambda v: v.rank)
            if not r.steps_recorded:
                r.steps_recorded, changed = True, True
            if lead.beats != r.beats:
                if lead.beats > r.beats and lead.beats >= 2 and lead.last_dt > 0:
                    r.step_times.append(lead.last_dt)
                    del r.step_times[:-MAX_STEP_SAMPLES]
                r.beats = lead.beats
                if lead.beats >= 1:  # from a beat on: not the first one's start-up
                    if r.anchor_at is None or lead.beats < r.anchor_beats:
                        r.anchor_beats, r.anchor_at = lead.beats, lead.wall(lead.last_beat)
                        r.anchor_stall_s = r.checkpoint_stall_s
                    r.last_beat_at = lead.wall(lead.last_beat)
            if r.stall_reported:
                r.in_section_since = None  # save() reports its stalls: no sampling
            ckpt = max(v.ckpt_step for v in slots)
            if ckpt > r.ckpt_step:
                # Saved in section("checkpoint"): its exit (stamped in section_start) is when
                # the step was saved, closer than this tick.
                exited = lead.wall(lead.section_start) if lead.section_start > 0 else 0.0
                at = exited if not lead.section and r.start <= exited <= now else now
                beat_at = lead.wall(lead.last_beat)
                if ckpt == lead.step and exited < beat_at and r.start <= beat_at <= now:
                    # Saved at a fault (checkpoint/rescue.py): the state of the last beat,
                    # outside any section.
                    at = beat_at
                r.ckpt_step, r.last_checkpoint_at = ckpt, at
                # The beats the checkpoint kept: less those past its step by this tick.
                r.beats_at_checkpoint = max(0, lead.beats - max(0, lead.step - ckpt))
                changed = True
            done = all(v.flags & S.FLAG_DONE for v in slots)
            if done != r.done:
                r.done, changed = done, True
            planned = any(v.flags & S.FLAG_STOPPED for v in slots)
            if planned and not r.planned:
                r.planned, changed = True, True
            if r.stall_reported:
                pass
            elif lead.section == CKPT_SECTION:
                if r.in_section_since is None:
                    r.in_section_since = lead.wall(lead.section_start)
            elif r.in_section_since is not None:
                # Leaving a section stamps section_start with the exit time.
                r.checkpoint_stall_s += max(0.0, lead.wall(lead.section_start)
                                            - r.in_section_since)
                r.in_section_since = None
                changed = True
        if stagein is not None and stagein != r.stagein_s:
            r.stagein_s, changed = stagein, True
        return changed

    def cleanup(self, older_than: float) -> int:
        """Remove ledgers of jobs not seen since ``older_than`` (wall time)."""
        removed = 0
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return 0
        for name in names:
            if not _NAME.match(name):
                continue
            path = os.path.join(self.directory, name)
            try:
                if os.lstat(path).st_mtime < older_than:
                    os.unlink(path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
