"""Restores: ``CheckpointManager.load_latest`` and the DCP load beneath it.

The step comes from ``latest_step`` (choose_step.py: agreed across ranks, or a save at
the fault newer than every committed step, rescue_restore.py); a committed step that
fails verification is passed over loudly (catch_up.pass_over), a rescue that fails to
load is dropped on every rank, and nothing else falls back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_resilience.checkpoint.app_state import train_state
from slurm_resilience.checkpoint.catch_up import pass_over
from slurm_resilience.checkpoint.commit import CheckpointError, step_name
from slurm_resilience.checkpoint.dcp_failures import corrupt_message, failure_cause
from slurm_resilience.checkpoint.dcp_state import resolve_stateful
from slurm_resilience.checkpoint.rescue import SHARDED, keys_hash, rescue_root
from slurm_resilience.checkpoint.template import TemplateMismatch, check_template

if TYPE_CHECKING:
    from slurm_resilience.checkpoint.manager import CheckpointManager

MAX_FALLBACKS = 8  # corrupt steps one restore may pass over before it gives up


@dataclass(frozen=True)
class Loaded:
    """The step ``load_latest`` loaded: its number, its step dir, and the state.

    ``state`` is the caller's state dict (loaded in place), the objects' entries without
    one, or for ``load_latest()`` a new dict of full CPU tensors and plain values.
    """

    step: int
    path: Path
    state: Any = None


class PartlyLoaded(CheckpointError):
    """A load that failed after the step verified and its bytes began to fill the state."""


def load_latest(mgr: CheckpointManager, state: dict[str, Any] | None = None, *,
                model: Any = None, optimizer: Any = None, scheduler: Any = None
                ) -> Loaded | None:
    """``CheckpointManager.load_latest`` (its docstring says what it promises): one step
    chosen, loaded, and on a corrupt committed step or a failed rescue the next choice."""
    from torch.distributed.checkpoint.api import CheckpointException

    template = None
    if state is not None or model is not None or optimizer is not None or \
            scheduler is not None:
        template = train_state(state, model=model, optimizer=optimizer, scheduler=scheduler)
    bad: dict[int, str] = {}
    while True:
        step = mgr.latest_step(exclude=bad)
        if step is None:
            return None
        if step == mgr._rescued_step:
            rescued = _load_rescue(mgr, step, template)
            if rescued is None:
                continue  # dropped on every rank, loudly: the committed steps as before
            loaded = rescued
            break
        try:
            loaded = dcp_load(mgr, step, template)
        except TemplateMismatch:
            raise  # the caller's code to fix: no fallback, no fresh start
        except PartlyLoaded as exc:  # every rank had begun reading (DCP's read phase)
            raise CheckpointError(
                f"checkpoint: load: couldn't load committed step {step}: "
                f"{failure_cause(exc.__cause__ or exc)}; it failed after its verified bytes "
                "began to fill the state, which now holds part of the step: neither "
                "a fallback nor a fresh start can use it, restart the job") from exc
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP gathers every rank's failure
            # DCP hands every rank the same gathered failures, so all ranks take the same
            # branch here without another collective.
            corrupt = corrupt_message(exc)
            if corrupt is not None and len(bad) < MAX_FALLBACKS:
                bad[step] = corrupt
                pass_over(mgr, step, corrupt)
                continue
            mgr._fresh_or_raise(f"checkpoint: load: couldn't load committed step {step}: "
                                 f"{failure_cause(exc)}")
            return None
        break
    mgr.last_saved = step
    if state is not None:  # DCP replaced the template's plain top-level values
        state.update({k: loaded[k] for k in state})
        loaded = state
    path = mgr.job_dir / step_name(step)
    if step == mgr._rescued_step:
        path = rescue_root(mgr.job_dir) / step_name(step)
    if mgr._rescue_wanted and template is not None:
        keys = SHARDED
        if mgr._rescue is not None:
            mgr._rescue.remember(template)
            keys = keys_hash(resolve_stateful(template))
        agreed = mgr._all_max([keys, -keys])  # a rank without a rescue turns it off for all
        if mgr._rescue is not None:
            mgr._rescue.agree(*agreed)
    return Loaded(step=step, path=path, state=loaded)

def _load_rescue(mgr: CheckpointManager, step: int, template: dict[str, Any] | None
                 ) -> dict[str, Any] | None:
    """Load the rescue of ``step`` (each rank its own node's copy); None when it failed
    on any rank: dropped everywhere, loudly, and the restore goes on with the committed
    steps (whose load replaces whatever this one filled in). A collective."""
    from torch.distributed.checkpoint.api import CheckpointException

    loaded: dict[str, Any] | None = None
    error = ""
    try:
        loaded = dcp_load(mgr, step, template)
    except TemplateMismatch:
        raise  # the same on every rank (check_template agrees): the caller's code to fix
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - told to every rank
        error = failure_cause(exc)
    (failed,) = mgr._all_max([int(bool(error))])
    if not failed:
        return loaded
    mgr._rescue_rejected.add(step)
    mgr._rescued_step = None
    if error:
        print(f"checkpoint: load: WARNING: rank {mgr.rank} couldn't load the rescue of "
              f"step {step} (saved at the fault): {error}; every rank resumes from the "
              "newest committed step instead", file=sys.stderr, flush=True)
    return None

def dcp_load(mgr: CheckpointManager, step: int, state: dict[str, Any] | None
             ) -> dict[str, Any]:
    from torch.distributed.checkpoint import state_dict_loader

    reader = mgr.storage_reader(step)
    # Each node reads its own rescue (separate saves of one replicated state): no plan
    # is shared between ranks.
    alone = mgr._group is None or step == mgr._rescued_step
    if state is None:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        loaded: dict[str, Any] = {}
        _load_state_dict(loaded, storage_reader=reader, process_group=mgr._group,
                         no_dist=alone, planner=_EmptyStateDictLoadPlanner())  # type: ignore[no-untyped-call]
        from slurm_resilience.checkpoint.structure import rebuild

        return rebuild(loaded, reader.metadata, step)
    check_template(step, state, reader.read_metadata, mgr._all_max)
    try:
        state_dict_loader.load(state, storage_reader=reader, process_group=mgr._group,
                               no_dist=alone)
    except BaseException as exc:
        if reader.reading:  # the step verified; the state may hold part of it
            raise PartlyLoaded(str(exc)) from exc
        raise
    return state
