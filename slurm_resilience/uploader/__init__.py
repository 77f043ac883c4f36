"""Root side of checkpointing, run by the node agent and the hooks: the uploader service
(:mod:`.service`: background sync of committed steps to S3, retention, stage-in on
restart), the S3 layer, the agent's journal, node-local space and eviction, the hook
steps and the ``ckpt`` CLI.

The training side is :mod:`slurm_resilience.checkpoint` (``CheckpointManager``, the DCP
writer and reader, the commit format); it imports nothing from here.
"""
