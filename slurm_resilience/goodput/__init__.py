"""Per-job goodput: how much of a job's allocated time became training progress.

:mod:`.ledger` (in the agent) keeps each job's run timeline on the node from the heartbeat
slots and the uploader's stage-in record; :mod:`.compute` (pure) splits the allocated time
into productive time and each kind of loss, with the hang incidents; :mod:`.cli` prints it.
"""
