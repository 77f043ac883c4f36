"""What the node agent said about a job's stage-in (``ckpt.status``), as the training
side sees it, and the warnings a resume from an older step prints."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from slurm_resilience.checkpoint.errors import CheckpointError


@dataclass(frozen=True)
class StageinStatus:
    """What the node agent said about this job's stage-in (``ckpt.status``)."""

    state: str  # none | running | done | failed | unavailable
    step: int | None = None
    error: str | None = None
    fallbacks: tuple[Fallen, ...] = ()
    source: str | None = None  # where the staged step came from: local | s3


@dataclass(frozen=True)
class Fallen:
    """A newer step this node's stage-in passed over, why, and the opt-in that let it."""

    step: int
    reason: str
    opt_in: str = ""


def warn_fallbacks(status: StageinStatus) -> None:
    """Say on the job's stderr which newer steps stage-in passed over for the one it
    staged: a resume from an older step is never quiet."""
    for f in status.fallbacks:
        if f.opt_in:
            print(f"checkpoint: load: WARNING: resuming from OLDER step {status.step}, not "
                  f"step {f.step}, because {f.opt_in} is set: {f.reason}",
                  file=sys.stderr, flush=True)
        else:
            print(f"checkpoint: load: WARNING: stage-in passed over step {f.step} for step "
                  f"{status.step}: {f.reason}", file=sys.stderr, flush=True)


def wait_stagein(socket: str, job_id: int, timeout_s: float) -> StageinStatus:
    """Wait until the node agent finished this job's stage-in (``ckpt.status``), at most
    ``timeout_s`` (checkpoint.stagein_timeout_s), then raise naming what it waits for."""
    from slurm_resilience.agent.client import AgentUnavailable, call

    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            status = call(socket, "ckpt.status", job_id=job_id)
        except AgentUnavailable as exc:
            return StageinStatus("unavailable", error=str(exc))
        state = str(status.get("stagein", "none"))
        if state in ("done", "failed", "none"):
            step = status.get("step")
            error = status.get("error")
            raw = status.get("fallbacks")
            fallen = tuple(Fallen(int(f["step"]), str(f.get("reason", "")),
                                  str(f.get("opt_in") or ""))
                           for f in (raw if isinstance(raw, list) else [])
                           if isinstance(f, dict) and isinstance(f.get("step"), int))
            return StageinStatus(state, int(step) if isinstance(step, int) else None,
                                 str(error) if error is not None else None, fallen,
                                 str(status.get("source") or "") or None)
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint: load: stage-in still {state} after "
                                  f"{timeout_s:.0f}s (checkpoint.stagein_timeout_s); what it "
                                  f"waits for: slurm-resilience ckpt status {job_id}")
        time.sleep(delay)
        # A local socket answered from memory: asking often is cheap, and a relaunch's
        # spare waits here for its share, on the job's critical path.
        delay = min(delay * 2, 0.25)
