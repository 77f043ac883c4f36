"""Prolog and epilog steps: each job's run directory for its heartbeat slots.

Prolog: ``<run_dir>/job-<id>`` owned by the job's user, mode 0700, created
under the root-owned run directory without following links, plus the
root-owned job record the agent trusts. Epilog: both removed, never following
a link out of the job's directory. Only file-system calls: no Slurm call.
"""

from __future__ import annotations

import errno
import os
import time

from slurm_resilience.heartbeat import jobrecord, safefs
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.hooks.context import HookContext, Problem
from slurm_resilience.log import get_logger
from slurm_resilience.nofollow import remove_tree_at

log = get_logger("heartbeat.steps")

STEP = "heartbeat"


def _nodes(ctx: HookContext) -> tuple[str, ...]:
    raw = ctx.env.get("SLURM_JOB_NODELIST") or ctx.env.get("SLURM_NODELIST") or ""
    if not raw:
        return (ctx.node,)
    import hostlist  # the library alone: slurm.parse's record parsers stay off the prolog path

    try:
        return tuple(hostlist.expand_hostlist(raw))
    except (ValueError, TypeError, IndexError):
        return (ctx.node,)


def remove_tree(parent_fd: int, name: str) -> int:
    """Remove ``name`` under ``parent_fd`` without following links; returns entries removed."""
    return remove_tree_at(parent_fd, name, missing_ok=True)


def prolog_run_dir(ctx: HookContext) -> list[Problem]:
    """Create the job's private run directory and the agent's record of the job."""
    if ctx.job_id is None or ctx.uid is None:
        return []
    gid = ctx.gid if ctx.gid is not None else -1
    root = P.run_root(ctx.cfg.node.run_dir, ctx.node)
    name = f"job-{ctx.job_id}"
    try:
        fd = safefs.makedirs_root(root, 0o755)
        try:
            os.fchmod(fd, 0o755)  # users must traverse it to reach their own directory
            remove_tree(fd, name)  # a leftover of an earlier run of this job: slots of dead ranks
            os.mkdir(name, 0o700, dir_fd=fd)
            jfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
            try:
                os.fchown(jfd, ctx.uid, gid)
                os.fchmod(jfd, 0o700)
            finally:
                os.close(jfd)
        finally:
            os.close(fd)
        jobrecord.write(P.records_dir(ctx.cfg.node.run_dir, ctx.node), jobrecord.JobRecord(
            ctx.job_id, ctx.uid, gid, ctx.user, time.time(), _nodes(ctx)))
    except OSError as exc:
        # Without the directory the job runs unwatched: say so, but don't fail the job.
        log.error("couldn't create job run directory", path=os.path.join(root, name),
                  error=str(exc))
        return [Problem(STEP, f"prolog: couldn't create heartbeat dir for job {ctx.job_id}: "
                              f"{exc.strerror or exc}", drain=exc.errno in (errno.EROFS,
                                                                            errno.EIO))]
    return []


def epilog_run_dir(ctx: HookContext) -> list[Problem]:
    """Remove the job's run directory and record, never following a link out of it."""
    if ctx.job_id is None:
        return []
    root = P.run_root(ctx.cfg.node.run_dir, ctx.node)
    try:
        fd = safefs.open_dir(root)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.error("couldn't open run directory", path=root, error=str(exc))
        return []
    try:
        removed = remove_tree(fd, f"job-{ctx.job_id}")
        jobrecord.remove(P.records_dir(ctx.cfg.node.run_dir, ctx.node), ctx.job_id)
        log.debug("job run directory removed", job_id=ctx.job_id, entries=removed)
    except OSError as exc:
        log.error("couldn't remove job run directory", job_id=ctx.job_id, error=str(exc))
    finally:
        os.close(fd)
    return []
