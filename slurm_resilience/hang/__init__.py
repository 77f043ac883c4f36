"""Root side of hang handling, run by the node agent and the hooks: the watcher that reads
the heartbeat slots, incidents (capture, exchange, blame, decide, act, report), suspect
verification, and the prolog/epilog steps of the job run directory.

Nothing here is imported by the training side (:mod:`slurm_resilience.heartbeat`).
"""
