"""The node agent: one root daemon per node that hosts long-lived services.

Checkpoint sync and hang watching plug in as services (see :mod:`.services`).
Jobs and hooks talk to it over a unix socket; every request carries the
caller's kernel-verified credentials (SO_PEERCRED), so a service can refuse a
user acting on another user's job.
"""
