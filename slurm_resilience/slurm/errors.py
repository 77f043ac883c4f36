"""Typed failures of Slurm operations; each carries Slurm's own message."""

from __future__ import annotations


class SlurmError(Exception):
    """A Slurm command failed; ``slurm_message`` is what Slurm said."""

    def __init__(self, operation: str, slurm_message: str):
        self.operation = operation
        self.slurm_message = slurm_message
        super().__init__(f"slurm: {operation}: {slurm_message}")


class SlurmTimeout(SlurmError):
    """A Slurm command did not answer in time (slurmctld down or overloaded)."""


class NodeNotFound(SlurmError):
    """Slurm does not know the node."""


class JobNotFound(SlurmError):
    """Slurm does not know the job (never existed, or purged after MinJobAge)."""


class ForeignDrain(SlurmError):
    """The node is drained or down by someone else; we leave it alone."""


class JobUpdateRefused(SlurmError):
    """Slurm refuses to update the job for now: "Job update not available right now, the DB
    index is being set". After a requeue that lasts until its new accounting record is set
    up; for a job Slurm resized (a lost node taken out of a --no-kill job) without
    accounting, for the job's life."""
