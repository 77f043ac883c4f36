"""What the node agent said about a job's stage-in (``ckpt.status``), as the training
side sees it, and the warnings a resume from an older step prints."""

from __future__ import annotations

import sys
from dataclasses import dataclass


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
