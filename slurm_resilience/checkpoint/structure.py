"""The shape of a saved state, so that ``load_latest()`` without a template returns it exactly.

DCP stores only leaves, under names it joins from the key path with every key made a
str: an empty dict leaves no trace and ``{0: ...}`` comes back as ``{"0": ...}``. Then
``SGD.load_state_dict`` of a step loaded without a template fails (``"state"`` is gone,
``KeyError``) or, for Adam, quietly keeps its fresh state (its param ids are ints). So
``save()`` plans with :class:`StructurePlanner`, which puts the state's skeleton (its
dicts and traversed lists with their real keys, each leaf a None) in the step's DCP
metadata, and a load without a template puts every loaded leaf back at its place in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import get_element, set_element
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from slurm_resilience.checkpoint.errors import CheckpointError

STRUCTURE_ATTR = "slurm_resilience_structure"  # on DCP's Metadata, pickled with it


def _traversed(value: Any) -> bool:
    """DCP walks into a list only when a tensor or mapping is somewhere inside it."""
    if isinstance(value, Mapping):
        return True
    if isinstance(value, list):
        return any(_traversed(v) for v in value)
    return isinstance(value, torch.Tensor)


def skeleton(value: Any) -> Any:
    """Dicts and traversed lists of ``value`` with their keys; every leaf a None."""
    if isinstance(value, Mapping):
        return {k: skeleton(v) for k, v in value.items()}
    if isinstance(value, list) and _traversed(value):
        return [skeleton(v) for v in value]
    return None


class StructurePlanner(DefaultSavePlanner):
    """DCP's default save planner that also records the state's skeleton in the metadata
    (the coordinator's: ranks with keys of their own fall back to DCP's nesting)."""

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.skeleton = skeleton(state_dict)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
        plans, metadata = super().create_global_plan(all_plans)
        setattr(metadata, STRUCTURE_ATTR, self.skeleton)
        return plans, metadata


def rebuild(loaded: dict[str, Any], metadata: Any, step: int) -> dict[Any, Any]:
    """What ``save()`` was given, from DCP's load of every saved key (``loaded``, nested
    by DCP with str keys), the skeleton in the step's ``metadata`` and its
    ``planner_data`` (each saved name's key path). A step saved without a skeleton
    (``dcp.save`` by hand) comes back as DCP built it."""
    record = getattr(metadata, STRUCTURE_ATTR, None)
    planner_data = getattr(metadata, "planner_data", None)
    if not (isinstance(record, dict) and isinstance(planner_data, dict)):
        return loaded
    paths = {name: tuple(p) for name, p in planner_data.items()}
    values = {name: get_element(loaded, p) for name, p in paths.items()}
    placed: set[str] = set()

    def fill(path: tuple[Any, ...], node: Any) -> Any:
        if isinstance(node, dict):
            return {k: fill((*path, k), v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill((*path, i), v) for i, v in enumerate(node)]
        name = ".".join(str(k) for k in path)
        if name not in values:
            raise CheckpointError(f"checkpoint: load: step {step}: the saved structure has "
                                  f"{name!r} but the step holds no value for it")
        placed.add(name)
        return values[name]

    out = fill((), record)
    if not isinstance(out, dict):
        return loaded
    # Keys only some ranks had (DCP keeps one rank's skeleton) go where DCP puts them.
    for name in sorted(values.keys() - placed):
        set_element(out, paths[name], values[name])
    return out
