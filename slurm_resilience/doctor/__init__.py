"""``slurm-resilience doctor``: is this node set up so that the suite actually gates?

:mod:`.facts` gathers (Slurm's running configuration, plugstack, munge, the agent and the
hook server, the configuration file, S3), :mod:`.checks` decides with pure functions, and
:mod:`.cli` prints each problem with its fix and exits non-zero when there is one.
"""
