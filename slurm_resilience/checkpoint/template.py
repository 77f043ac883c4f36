"""Load templates checked against the step they load into: no saved state is left behind.

DCP loads a step into the caller's state in place. A saved entry the template has no
place for is skipped without a word, and a non-tensor value lands only in the template
dict. Both made a resume look complete while an optimizer kept its fresh state: a
fresh Adam's ``state_dict()`` has no moment tensors to fill, and a copy of an
optimizer's or scheduler's ``state_dict()`` takes the saved learning rate that the
object itself never sees. These checks refuse such templates before anything loads,
naming the entries, and say what to pass instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from slurm_resilience.checkpoint.dcp_failures import corrupt_message
from slurm_resilience.checkpoint.errors import CheckpointError, CorruptStep

_REMEDY = ("pass the objects instead: load_latest(model=model, optimizer=opt, "
           "scheduler=sched) (or DCP's get_state_dict/set_state_dict)")
_SHOWN = 5  # entries a message names


class TemplateMismatch(CheckpointError):
    """The state given to a load can't take the saved step whole: a mistake in the
    caller's code, never a reason to fall back to an older step or start fresh."""


def _fmt(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def _optimizer_copy(value: Mapping[Any, Any]) -> bool:
    """``optimizer.state_dict()``: its param groups name parameters by index (DCP's
    ``get_optimizer_state_dict`` names them by FQN, for ``set_state_dict``)."""
    groups = value.get("param_groups")
    return "state" in value and isinstance(groups, list) and any(
        isinstance(g, Mapping) and any(isinstance(p, int) for p in g.get("params", ()))
        for g in groups)


def _scheduler_copy(value: Mapping[Any, Any]) -> bool:
    return "base_lrs" in value and "last_epoch" in value


def copied_state(state: Mapping[Any, Any], path: tuple[Any, ...] = ()) -> str | None:
    """Why ``state`` can't be a load template: an entry (outside Stateful objects, which
    DCP hands their loaded state) is a copy of an optimizer's or LR scheduler's state."""
    for key, value in state.items():
        if _is_stateful(value) or not isinstance(value, Mapping):
            continue
        where = (*path, key)
        kind = "an optimizer's" if _optimizer_copy(value) else \
            "an LR scheduler's" if _scheduler_copy(value) else None
        if kind is not None:
            return (f"checkpoint: load: key {_fmt(where)} is a copy of {kind} state (its "
                    "state_dict()): a load fills the copy, never the object, so its state "
                    f"and learning rates would not resume; {_REMEDY}")
        found = copied_state(value, where)
        if found is not None:
            return found
    return None


def left_behind(step: int, resolved: Mapping[str, Any], saved: Iterable[str]) -> str | None:
    """Why loading ``step`` into ``resolved`` (Stateful entries already replaced by their
    ``state_dict()``) would skip saved entries: under a key the template has, the saved
    names (DCP's flat names) that the template lacks."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(dict(resolved))
    under = tuple(f"{k}." for k, v in resolved.items() if isinstance(v, (Mapping, list)))
    missing = sorted(n for n in saved if n.startswith(under) and n not in flat)
    if not missing:
        return None
    shown = ", ".join(missing[:_SHOWN]) + (", ..." if len(missing) > _SHOWN else "")
    return (f"checkpoint: load: step {step}: the state given has no place for "
            f"{len(missing)} saved entries ({shown}), so they would not be restored (an "
            "optimizer that has not stepped yet holds no state tensors; names differ when "
            f"one side used get_state_dict); {_REMEDY}, or leave the key out of the state "
            "to skip it on purpose")


def check_template(step: int, state: Mapping[str, Any], read_metadata: Callable[[], Any],
                   all_max: Callable[[list[int]], list[int]]) -> None:
    """Raise on every rank, before anything loads, when any rank's ``state`` can't take
    ``step`` whole (TemplateMismatch) or can't read the step's metadata (its own error; a
    CorruptStep on every rank when any rank's copy does not verify)."""
    from slurm_resilience.checkpoint.dcp_state import check_state, resolve_stateful

    unread: BaseException | None = None
    problem: str | None = None
    try:
        saved = list(read_metadata().state_dict_metadata)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agree
        unread = exc
    else:
        try:
            resolved = resolve_stateful(state)
            check_state(resolved, what="load")
            problem = copied_state(state) or left_behind(step, resolved, saved)
        except Exception as exc:  # noqa: BLE001 - a state_dict() that fails: raised on every rank
            problem = str(exc) if isinstance(exc, CheckpointError) else (
                f"checkpoint: load: couldn't take the state to load into: "
                f"{type(exc).__name__}: {exc}")
    corrupt = corrupt_message(unread) if unread is not None else None
    no_metadata, any_corrupt, mismatch = all_max(
        [int(unread is not None), int(corrupt is not None), int(problem is not None)])
    if any_corrupt:  # every rank then falls back to an older step together
        raise CorruptStep(corrupt or f"checkpoint: load: step {step}: another rank's "
                          f"metadata {CorruptStep.MARK} (its error names the file)")
    if no_metadata:
        raise unread or CheckpointError(f"checkpoint: load: step {step}: another rank "
                                        "couldn't read its metadata (its error names why)")
    if mismatch:
        raise TemplateMismatch(problem or f"checkpoint: load: step {step}: another rank's "
                               "state can't take the step (its error names the entries)")
