"""Pure hang detection: which ranks made no progress past their current timeout.

A rank's timeout depends on what it is doing: inside a section it is the
section's timeout; before its first beats (warm-up) the warm-up timeout; else
the job's own timeout, the auto-tuned one or the cluster's step timeout.
Step and warm-up timeouts never exceed the cap below NCCL's watchdog.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.heartbeat import slot as S


@dataclass(frozen=True)
class RankState:
    """The verdict on one rank."""

    rank: int
    state: str  # ok | hung | done | dead
    timeout_s: float
    timeout_kind: str  # step | warmup | job | auto | section NAME
    idle_s: float
    step: int
    section: str = ""


@dataclass(frozen=True)
class JobVerdict:
    """The verdict on a job's ranks on this node."""

    job_id: int
    mode: str  # act | observe | off
    ranks: tuple[RankState, ...]
    stragglers: tuple[int, ...] = ()
    tuned_timeout_s: float | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def hung(self) -> tuple[RankState, ...]:
        return tuple(r for r in self.ranks if r.state == "hung")

    @property
    def ranks_died(self) -> bool:
        """Every rank here has ended, and at least one died (not a clean finish)."""
        return any(r.state == "dead" for r in self.ranks) and \
            all(r.state in ("dead", "done") for r in self.ranks)


def _clamp(value: float, lo: float, hi: float) -> float:
    return min(max(value, lo), hi)


def rank_timeout(v: S.SlotView, cfg: HeartbeatSection, tuned: float | None) -> tuple[float, str]:
    """The timeout that applies to this rank now, and where it came from."""
    if v.section:
        seconds = v.section_timeout_s or cfg.section_timeouts_s.get(
            v.section, cfg.section_default_timeout_s)
        return max(seconds, cfg.min_timeout_s), f"section {v.section}"
    cap = cfg.timeout_cap_s
    if v.beats <= cfg.warmup_steps or v.flags & S.FLAG_WARMUP:
        return _clamp(max(cfg.warmup_timeout_s, v.job_step_timeout_s), cfg.min_timeout_s,
                      cap), "warmup"
    if v.job_step_timeout_s > 0:
        return _clamp(v.job_step_timeout_s, cfg.min_timeout_s, cap), "job"
    if tuned is not None:
        return _clamp(tuned, cfg.min_timeout_s, cap), "auto"
    return cfg.step_timeout_s, "step"


def job_mode(slots: Sequence[S.SlotView], cluster_mode: str) -> str:
    """Cluster mode, narrowed by any rank's per-job opt-out."""
    if cluster_mode == "off" or any(v.flags & S.FLAG_OFF for v in slots):
        return "off"
    if cluster_mode == "observe" or any(v.flags & S.FLAG_OBSERVE for v in slots):
        return "observe"
    return "act"


def auto_tune(slots: Sequence[S.SlotView], cfg: HeartbeatSection,
              previous: float | None) -> float | None:
    """Max step time over ranks with enough steps, times the safety factor; never shrinks
    below what an earlier run of the job needed."""
    seen = [v.max_dt for v in slots if v.beats >= cfg.auto_tune_min_steps and v.max_dt > 0]
    if not seen:
        return previous
    value = _clamp(max(seen) * cfg.auto_tune_factor, cfg.min_timeout_s, cfg.timeout_cap_s)
    return value if previous is None else max(previous, value)


def stragglers(slots: Sequence[S.SlotView], factor: float = 1.5, min_beats: int = 5
               ) -> tuple[int, ...]:
    """Ranks whose mean step time is persistently above ``factor`` times the median."""
    means = {v.rank: v.ewma_dt for v in slots if v.beats >= min_beats and v.ewma_dt > 0}
    if len(means) < 2:
        return ()
    median = statistics.median(means.values())
    return tuple(sorted(r for r, m in means.items() if m > factor * median))


def judge(job_id: int, slots: Sequence[S.SlotView], now: float, cfg: HeartbeatSection, *,
          alive: Mapping[int, bool], tuned: float | None = None) -> JobVerdict:
    """Judge every rank of one job on this node at monotonic time ``now``.

    ``alive`` says whether each rank's process still exists; a dead or finished
    rank is not a hang (Slurm sees the exit).
    """
    mode = job_mode(slots, cfg.mode)
    tuned = auto_tune(slots, cfg, tuned) if cfg.auto_tune else None
    states = []
    for v in sorted(slots, key=lambda s: s.rank):
        timeout, kind = rank_timeout(v, cfg, tuned)
        idle = max(0.0, now - v.last_progress)
        if v.flags & S.FLAG_DONE:
            state = "done"
        elif not alive.get(v.rank, False):
            state = "dead"
        else:
            state = "hung" if idle > timeout else "ok"
        states.append(RankState(v.rank, state, timeout, kind, round(idle, 3), v.step, v.section))
    return JobVerdict(job_id, mode, tuple(states), stragglers(slots), tuned)
