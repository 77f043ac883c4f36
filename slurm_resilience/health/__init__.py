"""The node health gate: collectors gather snapshots, checks judge them, the verdict decides.

Layout: ``collectors/`` (I/O, each in a child process with a hard timeout),
``checks/`` (pure functions from snapshot and thresholds to findings),
``verdict.py`` (findings under the fail-open/fail-closed policy), ``gate.py``
(ties them together), ``steps.py`` (the prolog/epilog/healthcheck steps).
"""
