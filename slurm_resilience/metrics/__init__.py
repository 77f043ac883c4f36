"""Prometheus metrics of the node agent (``slurm_resilience_*``).

:mod:`.events` (counters kept on disk, written by whichever process acts: hooks, agent) is
light and safe to import from the prolog; :mod:`.collector` and :mod:`.service` import
``prometheus_client`` and run only inside the agent.
"""
