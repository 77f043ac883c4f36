"""Checkpoint staging: atomic saves to node-local NVMe, background sync to S3, verified
stage-in on restart. Training code uses :class:`CheckpointManager`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_resilience.checkpoint.app_state import train_state
    from slurm_resilience.checkpoint.errors import CheckpointError
    from slurm_resilience.checkpoint.manager import CheckpointManager, Loaded
    from slurm_resilience.checkpoint.template import TemplateMismatch

__all__ = ["CheckpointError", "CheckpointManager", "Loaded", "TemplateMismatch", "train_state"]


def __getattr__(name: str) -> Any:
    # Lazy, so root code importing a submodule never pays for torch or the manager.
    if name in ("CheckpointManager", "Loaded"):
        from slurm_resilience.checkpoint import manager

        return getattr(manager, name)
    if name == "train_state":
        from slurm_resilience.checkpoint.app_state import train_state

        return train_state
    if name == "TemplateMismatch":
        from slurm_resilience.checkpoint.template import TemplateMismatch

        return TemplateMismatch
    if name == "CheckpointError":
        from slurm_resilience.checkpoint.errors import CheckpointError

        return CheckpointError
    raise AttributeError(name)
