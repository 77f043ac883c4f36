"""A model, its optimizer and LR scheduler as DCP state that restores whole.

``train_state(model=..., optimizer=..., scheduler=...)`` is the state ``save()`` and
``load_latest()`` build from their keyword arguments (and what ``dcp.save``/``dcp.load``
users pass by hand): Stateful entries, so that a load ends in each object's own
``load_state_dict`` (learning rates, param groups, scheduler counters) and never only in
a copy of its state. The model and optimizer go through DCP's ``get_*_state_dict`` and
``set_*_state_dict``, which handle plain modules, DDP (no ``module.`` prefix) and FSDP2
(DTensor shards, any world size), and create an optimizer's state before its first step,
so a fresh optimizer's template holds every tensor a saved step has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slurm_resilience.checkpoint.errors import CheckpointError

MODEL_KEY = "model"
OPTIMIZER_KEY = "optim"
SCHEDULER_KEY = "scheduler"


class ModelState:
    """A module (plain, DDP or FSDP2) as a DCP Stateful, keyed by parameter FQN."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return dict(get_model_state_dict(self.model))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict)  # strict: a missing key raises


class OptimizerState:
    """An optimizer of ``model`` as a DCP Stateful, its state keyed by parameter FQN."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return dict(get_optimizer_state_dict(self.model, self.optimizer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def _stateful(obj: Any, what: str) -> Any:
    if not (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))):
        raise CheckpointError(f"checkpoint: {what}= must have state_dict() and "
                              f"load_state_dict(), not a {type(obj).__name__}")
    return obj


def train_state(state: Mapping[str, Any] | None = None, *, model: Any = None,
                optimizer: Any = None, scheduler: Any = None) -> dict[str, Any]:
    """``state``'s entries plus ``model``/``optim``/``scheduler`` entries for the objects
    given, as DCP Stateful objects; a key given both ways raises."""
    out: dict[str, Any] = dict(state or {})
    if optimizer is not None and model is None:
        raise CheckpointError("checkpoint: optimizer= needs model= too (DCP names the "
                              "optimizer's state by the model's parameter names)")
    named: dict[str, tuple[str, Any]] = {}  # key -> (argument, Stateful)
    if model is not None:
        named[MODEL_KEY] = ("model", ModelState(_stateful(model, "model")))
    if optimizer is not None:
        named[OPTIMIZER_KEY] = ("optimizer",
                                OptimizerState(model, _stateful(optimizer, "optimizer")))
    if scheduler is not None:
        named[SCHEDULER_KEY] = ("scheduler", _stateful(scheduler, "scheduler"))
    for key, (arg, obj) in named.items():
        if key in out:
            raise CheckpointError(f"checkpoint: the state has a key {key!r} and the {arg}= "
                                  "argument would be saved under it too; rename that key")
        out[key] = obj
    if not out:
        raise CheckpointError("checkpoint: the state is empty; pass a state dict or "
                              "model=/optimizer=/scheduler=")
    return out
