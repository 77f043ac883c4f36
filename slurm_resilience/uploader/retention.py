"""Which S3 steps of a run retention may delete: a pure decision over the run's listing.

The listing covers every job that shares the run URI, so jobs agree on the newest
``keep`` committed steps whatever each one uploaded itself. A step counts as
committed when its ``COMMIT.json`` is listed; every key under ``step-N/`` (rank
files, manifests, intent records) belongs to that step.

* Committed steps older than the newest ``keep`` go, but only ``grace_s`` after the
  next newer step was committed: a stage-in that picked the old step as the newest
  just before still finds it whole.
* A step without ``COMMIT.json`` may still be uploading (from another job's nodes,
  after a requeue): it is never deleted, unless it is older than the kept steps and
  none of its keys changed for ``abandoned_s``.
"""

from __future__ import annotations

from slurm_resilience.checkpoint.commit import COMMIT, parse_step


def plan_remote_retention(objects: dict[str, tuple[int, float]], keep: int, grace_s: float,
                          abandoned_s: float, now: float) -> list[int]:
    """Steps to delete, oldest first. ``objects``: key relative to the run → (size, mtime)."""
    if keep <= 0:
        return []
    steps: dict[int, dict[str, float]] = {}
    for key, (_, mtime) in objects.items():
        sname, _, rest = key.partition("/")
        step = parse_step(sname)
        if step is not None and rest:
            steps.setdefault(step, {})[rest] = mtime
    committed = sorted(s for s, keys in steps.items() if COMMIT in keys)
    if len(committed) <= keep:
        return []
    oldest_kept = committed[-keep]
    out = []
    for step in sorted(steps):
        if step >= oldest_kept:
            break
        keys = steps[step]
        if COMMIT in keys:
            newer = next(s for s in committed if s > step)
            if now - steps[newer][COMMIT] >= grace_s:
                out.append(step)
        elif keys and now - max(keys.values()) >= abandoned_s:
            out.append(step)
    return out
