"""``slurm-resilience launch``: run a training step on the allocation less hot spares, and
relaunch it inside the same allocation when the node agent decides an incident."""
