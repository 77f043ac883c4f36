"""NCCL loopback gate: an active all_reduce on the node's GPUs, scheduled so the prolog stays fast.

Layout: :mod:`worker` (one rank; the only torch import), :mod:`launcher` (ranks,
timeout, cleanup), :mod:`bandwidth` (busbw formula, thresholds), :mod:`gate`
(variants, retries, verdict), :mod:`cache` (node-local result), :mod:`schedule`
(prolog decision, node lock), :mod:`steps` (hook steps), :mod:`verify` (idle
verification), :mod:`faults` (fault injection), :mod:`cli` (``nccl-test``).
"""
