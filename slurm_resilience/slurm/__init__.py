"""Everything that talks to Slurm goes through :class:`SlurmAdapter`."""

from slurm_resilience.slurm.adapter import SlurmAdapter, clean_reason, from_config
from slurm_resilience.slurm.errors import (
    ForeignDrain,
    JobNotFound,
    NodeNotFound,
    SlurmError,
    SlurmTimeout,
)
from slurm_resilience.slurm.parse import JobInfo, NodeInfo

__all__ = [
    "ForeignDrain", "JobInfo", "JobNotFound", "NodeInfo", "NodeNotFound", "SlurmAdapter",
    "SlurmError", "SlurmTimeout", "clean_reason", "from_config",
]
