"""slurm-resilience: keep long GPU training runs alive on Slurm clusters."""

__version__ = "0.1.0"
