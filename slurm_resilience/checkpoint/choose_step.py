"""Which committed step a restore loads: the newest one, the same on every rank.

Waits for the agent's stage-in, then agrees across ranks (one all-reduce of the
candidates; a disagreement goes to catch_up.py); a failure anywhere raises on every rank
with its cause, unless the job allows a fresh start.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from slurm_resilience.checkpoint.catch_up import agree_ranks
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    committed_steps,
    read_marker,
    saved_in_this_run,
    step_name,
)
from slurm_resilience.checkpoint.dcp_layout import METADATA_RELPATH
from slurm_resilience.checkpoint.rescue_restore import local_step, take
from slurm_resilience.checkpoint.stagein_status import warn_fallbacks

if TYPE_CHECKING:
    from slurm_resilience.checkpoint.manager import CheckpointManager


def latest_step(mgr: CheckpointManager, exclude: Mapping[int, str] | None = None
                ) -> int | None:
    """The newest committed step, the same on every rank, ready to load; None only when
    the run has nothing committed (or allow_fresh_start turned a failure into a fresh
    start). Waits for the agent's stage-in; raises a CheckpointError naming the step
    and the cause when stage-in failed, ranks disagree, or ``.metadata`` is missing.
    ``exclude``: steps this restore found corrupt (passed over, never chosen again)."""
    mgr.wait()
    bad = dict(exclude or {})
    status = mgr.wait_stagein()
    local = [s for s in committed_steps(mgr.job_dir) if s not in bad]
    candidate = status.step if status.step is not None else (local[-1] if local else -1)
    # A relaunch inside the allocation: this run's own commits since its stage-in are newer
    # than what the stage-in found at the run's start (retention may have removed that one).
    ours = [s for s in local if s > candidate and _saved_in_this_run(mgr, s)]
    if ours:
        candidate = ours[-1]
    error = status.error if status.state == "failed" else None
    if error is None and candidate in bad:
        error = (f"stage-in chose step {candidate} again although this restore found it "
                 f"corrupt ({bad[candidate]})")
    if mgr.uri is not None and (mgr._agent_lost or status.state == "unavailable"):
        # The run's S3 steps are unknown: loading a local one could silently go back.
        error = f"the node agent is unreachable ({mgr._agent_lost or status.error})"
    failed = error is not None
    if not failed and mgr.rank == 0:
        warn_fallbacks(status)
    # The same all-reduce finds the newest save at a fault (rescue.py) on any node.
    rescue_on = mgr._rescue_wanted  # the same on every rank: the lists must match
    hi, neg_lo, any_failed, *rescued = mgr._all_max(
        [candidate, -candidate, int(failed)] + ([local_step(mgr)] if rescue_on else []))
    lo = -neg_lo
    mgr._rescued_step = None
    if rescued and rescued[0] > hi and not any_failed and take(mgr, rescued[0]):
        mgr._rescued_step = rescued[0]  # newer than every committed step: load it
        return rescued[0]
    if any_failed:
        cause = f"stage-in failed: {error}" if failed else \
            "stage-in failed on another node (its ranks' error names the cause)"
        mgr._fresh_or_raise(f"checkpoint: load: couldn't restore the run: {cause}")
        return None
    if hi != lo:  # every rank takes this branch: hi and lo are the same everywhere
        agreed = agree_ranks(mgr, candidate, status, local)
        if agreed is None:
            return None
        hi = agreed
    if hi < 0 and bad:
        mgr._fresh_or_raise(
            f"checkpoint: load: couldn't load committed step {max(bad)}: "
            + "; ".join(f"step {s}: {why}" for s, why in sorted(bad.items(), reverse=True))
            + " (and no older committed step verifies)")
        return None
    if hi < 0:
        if mgr.rank == 0:
            print("checkpoint: load: no committed step; starting from step 0",
                  file=sys.stderr)
        return None
    sdir = mgr.job_dir / step_name(hi)
    has_meta = (sdir / METADATA_RELPATH).is_file() and (sdir / COMMIT).is_file()
    (missing,) = mgr._all_max([int(not has_meta)])
    if missing:
        mgr._fresh_or_raise(f"checkpoint: load: couldn't load committed step {hi}: "
                             f"{'this node' if not has_meta else 'another node'} has no "
                             f"{METADATA_RELPATH} (written before the DCP format, or "
                             "staged in incompletely)")
        return None
    mgr._trusted.add(hi)  # the caller loads it (load_latest, or dcp.load by hand)
    return hi


def _saved_in_this_run(mgr: CheckpointManager, step: int) -> bool:
    """The step's commit marker names a save of this job's current run."""
    try:
        marker = read_marker(mgr.job_dir / step_name(step))
    except (CheckpointError, OSError, ValueError):
        return False
    return saved_in_this_run(marker.save_id)
