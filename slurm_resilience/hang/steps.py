"""Prolog and epilog steps: each job's run directory for its heartbeat slots.

Prolog: ``<run_dir>/job-<id>`` for the job's user, mode 0700, created under the
root-owned run directory without following links: a tmpfs of its own, limited in
size and inodes (``node.job_tmpfs``, see :mod:`~slurm_resilience.hang.jobfs`), or a
plain directory; plus the root-owned job record the agent trusts. A leftover of the
same name (a requeue, or another user's job under a reused id) is set aside under
``.stale/`` for the agent: a rename, never a drain. Epilog: the tmpfs is detached, what
is left removed within a share of the epilog's spare time, the rest set aside for the
agent. Never following a link out of the job's directory; no Slurm call.
"""

from __future__ import annotations

import errno
import os
import time
from typing import TYPE_CHECKING

from slurm_resilience import safefs
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config.budgets import run_dir_remove_s
from slurm_resilience.hang import jobfs, jobrecord
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.hooks.context import HookContext, Problem
from slurm_resilience.log import get_logger
from slurm_resilience.safefs import RemovalBudget, RemovalIncomplete, remove_tree_at

if TYPE_CHECKING:
    from slurm_resilience.proc import Runner

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


def remove_tree(parent_fd: int, name: str, budget: RemovalBudget | None = None) -> int:
    """Remove ``name`` under ``parent_fd`` without following links; returns entries removed."""
    return remove_tree_at(parent_fd, name, missing_ok=True, budget=budget)


def _detach(fd: int, root: str, name: str, run: Runner | None, hook: str) -> Runner | None:
    """Lazily unmount ``name`` when it is a mount point (our tmpfs); returns the runner used.
    Raises OSError (EBUSY) when umount fails."""
    if not jobfs.is_mount_point(fd, name):
        return run  # proc stays unloaded: nothing to run
    from slurm_resilience.proc import CommandError

    run = run or jobfs.runner()
    try:
        jobfs.unmount(os.path.join(root, name), run=run)
    except CommandError as exc:
        raise OSError(errno.EBUSY, f"couldn't unmount the tmpfs on {name}: {exc}") from None
    log.debug(f"{hook}: job run directory's tmpfs detached", path=os.path.join(root, name))
    return run


def _clear_leftover(fd: int, root: str, name: str, ctx: HookContext, run: Runner | None,
                    clock: Clock) -> Runner | None:
    """Move a leftover ``job-<id>`` out of the way: detach its tmpfs, then set it aside
    under ``.stale/`` (a rename: instant whatever it holds, whoever owns it). Only when that
    fails is it removed here, within the prolog's share; raises OSError when neither works."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return run
    run = _detach(fd, root, name, run, "prolog")
    try:
        new = jobfs.set_aside(fd, name)
        log.warning("prolog: set a leftover job run directory aside under .stale/ for the "
                    "agent to remove", job_id=ctx.job_id, name=name, set_aside_as=new,
                    owner_uid=st.st_uid, job_uid=ctx.uid)
        return run
    except OSError as exc:
        why = str(exc)
    budget_s = run_dir_remove_s(ctx.cfg, "hooks.prolog_timeout_s")
    log.warning("prolog: couldn't set a leftover job run directory aside; removing it within "
                "the prolog's budget", name=name, error=why, budget_s=budget_s)
    remove_tree(fd, name, RemovalBudget(max_seconds=budget_s, clock=clock))
    return run


def _mount_or_plain(fd: int, root: str, name: str, ctx: HookContext, uid: int, gid: int,
                    run: Runner | None) -> bool:
    """Give the job its dir: a bounded tmpfs when configured and possible (True), else the
    plain dir, logged with the cause (False). A failed mount says nothing about the node's
    health and the job still works, so it is no drain and no failed job; the plain dir is
    still bounded in time by the epilog's budgeted removal."""
    tmpfs = ctx.cfg.node.job_tmpfs
    path = os.path.join(root, name)
    if tmpfs.enabled:
        from slurm_resilience.proc import CommandError

        try:
            jobfs.mount(path, uid=uid, gid=gid if gid >= 0 else uid, size=tmpfs.size,
                        inodes=tmpfs.inodes, run=run or jobfs.runner())
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if st.st_dev != os.fstat(fd).st_dev and st.st_uid == uid:
                return True
            why = "the mount did not take effect"
            if st.st_dev != os.fstat(fd).st_dev:  # mounted, but not the job's: take it off
                _detach(fd, root, name, run, "prolog")
        except (CommandError, OSError) as exc:
            why = str(exc)
        log.error("prolog: couldn't mount a size-limited tmpfs on the job's run directory; "
                  "the job gets a plain directory, bounded only by the filesystem under "
                  "node.run_dir", job_id=ctx.job_id, path=path, error=why,
                  size=tmpfs.size, inodes=tmpfs.inodes)
    jfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    try:
        os.fchown(jfd, uid, gid)
        os.fchmod(jfd, 0o700)
    finally:
        os.close(jfd)
    return False


def prolog_run_dir(ctx: HookContext, *, run: Runner | None = None,
                   clock: Clock = SystemClock()) -> list[Problem]:
    """Create the job's private run directory and the agent's record of the job.

    ``run`` (mount/umount) and ``clock`` (the removal budget) are for tests."""
    if ctx.job_id is None or ctx.uid is None:
        return []
    gid = ctx.gid if ctx.gid is not None else -1
    root = P.run_root(ctx.cfg.node.run_dir, ctx.node)
    name = f"job-{ctx.job_id}"
    try:
        fd = safefs.makedirs_root(root, 0o755)
        try:
            os.fchmod(fd, 0o755)  # users must traverse it to reach their own directory
            # A leftover of an earlier run of this job (slots of dead ranks), or of another
            # user's job under a reused id: never handed to this job, never a drain.
            run = _clear_leftover(fd, root, name, ctx, run, clock)
            # Root's own until it is the job's: the tmpfs (mounted over it) or a chown.
            os.mkdir(name, 0o700, dir_fd=fd)
            _mount_or_plain(fd, root, name, ctx, ctx.uid, gid, run)
        finally:
            os.close(fd)
        jobrecord.write(P.records_dir(ctx.cfg.node.run_dir, ctx.node), jobrecord.JobRecord(
            ctx.job_id, ctx.uid, gid, ctx.user, time.time(), _nodes(ctx)))
    except (OSError, RemovalIncomplete) as exc:
        # Without the directory the job runs unwatched: say so, but don't fail the job.
        log.error("couldn't create job run directory", path=os.path.join(root, name),
                  error=str(exc))
        drain = isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EIO)
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return [Problem(STEP, f"prolog: couldn't create heartbeat dir for job {ctx.job_id}: "
                              f"{detail}", drain=drain)]
    return []


def epilog_run_dir(ctx: HookContext, *, run: Runner | None = None,
                   clock: Clock = SystemClock()) -> list[Problem]:
    """Remove the job's run directory and record, never following a link out of it.

    The tmpfs is detached first (instant); what is left (a plain dir: mounting was off or
    failed) is removed within a share of the epilog's spare time, and a tree too big for
    that is set aside under ``.stale/``, where the agent removes it in bounded passes."""
    if ctx.job_id is None:
        return []
    root = P.run_root(ctx.cfg.node.run_dir, ctx.node)
    name = f"job-{ctx.job_id}"
    try:
        fd = safefs.open_dir(root)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.error("couldn't open run directory", path=root, error=str(exc))
        return []
    budget_s = run_dir_remove_s(ctx.cfg, "hooks.epilog_timeout_s")
    try:
        try:
            _detach(fd, root, name, run, "epilog")
        except OSError as exc:
            # Its contents are bounded by the tmpfs; the next prolog of this id tries again.
            log.error("epilog: couldn't unmount the job run directory's tmpfs",
                      job_id=ctx.job_id, error=str(exc))
        try:
            removed = remove_tree(fd, name,
                                  RemovalBudget(max_seconds=budget_s, clock=clock))
            log.debug("job run directory removed", job_id=ctx.job_id, entries=removed)
        except RemovalIncomplete as exc:
            _hand_off(fd, name, ctx.job_id, budget_s, str(exc))
        except OSError as exc:
            log.error("couldn't remove job run directory", job_id=ctx.job_id, error=str(exc))
        try:
            jobrecord.remove(P.records_dir(ctx.cfg.node.run_dir, ctx.node), ctx.job_id)
        except OSError as exc:
            log.error("couldn't remove job record", job_id=ctx.job_id, error=str(exc))
    finally:
        os.close(fd)
    return []


def _hand_off(fd: int, name: str, job_id: int, budget_s: float, removal: str) -> None:
    """A run dir too big for the epilog's share: out of the job's name, to the agent."""
    try:
        new = jobfs.set_aside(fd, name)
    except OSError as exc:
        log.error("epilog: job run directory only partly removed and couldn't be set aside; "
                  "the next prolog of this job id sets it aside", job_id=job_id,
                  error=str(exc), removal=removal)
        return
    log.warning("epilog: job run directory too big to remove within the epilog's budget; "
                "set aside under .stale/ and handed to the agent", job_id=job_id,
                budget_s=budget_s, set_aside_as=new, removal=removal)
