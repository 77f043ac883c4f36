"""The agents' network transport, shared by hang handling and straggler detection:
munge-authenticated TCP (:mod:`.credentials`, :mod:`.wire`), a bounded accept loop
(:mod:`.listener`) and the fan-in tree rooted at a job's batch host (:mod:`.tree`).

It knows nothing of what is exchanged; the hang watcher's rendezvous over it is
:mod:`slurm_resilience.hang.netrendezvous`.
"""
