"""Root-side handling of job staging dirs: create, open, clean, never through a symlink.

A staging dir belongs to the job's user, who can plant anything in it (symlinks
to /etc, fifos, hard links to files they do not own). Root code therefore walks
it only with directory file descriptors: every component is opened with
O_NOFOLLOW relative to its parent's fd, and every file is checked with fstat
(regular file, owned by the job's user) on the fd that is then read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slurm_resilience import safefs
from slurm_resilience.checkpoint.errors import CheckpointError
from slurm_resilience.log import get_logger
from slurm_resilience.safefs import RemovalBudget, remove_tree_at

log = get_logger("checkpoint.staging")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def job_dir_name(job_id: int) -> str:
    if job_id <= 0:
        raise CheckpointError(f"checkpoint: staging: job id {job_id} is not valid")
    return f"job-{job_id}"


def job_dir(root: str | os.PathLike[str], job_id: int) -> Path:
    return Path(root) / job_dir_name(job_id)


def _open_root(root: str) -> int:
    """Open the staging root: it must be a real directory owned by root, not a link."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointError(f"checkpoint: staging: {root} is not a real directory "
                                  "(symlink?)") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise CheckpointError(f"checkpoint: staging: root {root} must be owned by uid "
                              f"{os.geteuid()} and not group/world-writable "
                              f"(owner {st.st_uid}, mode {oct(st.st_mode & 0o7777)})")
    return fd


def ensure_root(root: str) -> None:
    """Create the staging root (mode 0755) if missing, then check it."""
    os.makedirs(root, mode=0o755, exist_ok=True)
    os.close(_open_root(root))


STALE = ".stale"  # leftovers set aside by the prolog; root-only, emptied by the agent


def create_job_dir(root: str, job_id: int, uid: int, gid: int) -> Path:
    """Create (or adopt) ``<root>/job-<id>`` owned by uid:gid, mode 0700, via fds only.

    A requeued job adopts its own dir. A leftover of another user (a job ID reused after a
    controller reset) or anything that is not a plain dir is set aside under ``.stale/``
    for the agent to remove: it is no evidence about the node, so never a drain."""
    ensure_root(root)
    name = job_dir_name(job_id)
    rfd = _open_root(root)
    try:
        for attempt in range(2):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=rfd)
            try:
                dfd = os.open(name, _DIR_FLAGS, dir_fd=rfd)
            except OSError as exc:
                if attempt or exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise CheckpointError(f"checkpoint: prolog: couldn't open {root}/{name}: "
                                          f"{os.strerror(exc.errno or 0)}") from None
                set_aside(rfd, name, "not a directory")
                continue
            try:
                st = os.fstat(dfd)
                if st.st_uid not in (uid, os.geteuid()):
                    if attempt:
                        raise CheckpointError(f"checkpoint: prolog: {root}/{name} is owned by "
                                              f"uid {st.st_uid}, expected {uid}")
                    set_aside(rfd, name, f"owned by uid {st.st_uid}, not the job's {uid}")
                    continue
                os.fchown(dfd, uid, gid)
                os.fchmod(dfd, 0o700)
                break
            finally:
                os.close(dfd)
    finally:
        os.close(rfd)
    return Path(root) / name


def set_aside(root_fd: int, name: str, why: str, *, from_fd: int | None = None,
              prefix: str = "") -> str:
    """Move ``name`` (never followed) into the root-only ``.stale/`` dir, under a unique name.

    ``name`` lies in ``from_fd`` (default: the root itself); ``prefix`` says whose it was
    in the new name. Returns that name (relative to ``.stale/``)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(STALE, 0o700, dir_fd=root_fd)
    sfd = os.open(STALE, _DIR_FLAGS, dir_fd=root_fd)
    dest = f"{prefix}{name}.{time.time_ns()}"
    try:
        st = os.fstat(sfd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise CheckpointError(f"checkpoint: staging: {STALE} must be a root-only dir")
        os.rename(name, dest, src_dir_fd=root_fd if from_fd is None else from_fd,
                  dst_dir_fd=sfd)
    finally:
        os.close(sfd)
    log.warning("checkpoint: set a staging entry aside under .stale/ for the agent to remove",
                name=f"{prefix}{name}", moved_to=f"{STALE}/{dest}", reason=why)
    return dest


def set_aside_step(root: str, job_id: int, job_fd: int, sname: str, why: str) -> str:
    """Move a job's step dir ``sname`` out of its staging dir into ``.stale/`` (a rename):
    a step stage-in passed over keeps no COMMIT.json where the job could take it for
    committed."""
    rfd = _open_root(root)
    try:
        return set_aside(rfd, sname, why, from_fd=job_fd,
                         prefix=f"{job_dir_name(job_id)}.")
    finally:
        os.close(rfd)


def set_aside_job_dir(root: str, job_id: int, why: str) -> None:
    """Move the job's staging dir into ``.stale/`` (a rename: instant whatever its size)."""
    rfd = _open_root(root)
    try:
        set_aside(rfd, job_dir_name(job_id), why)
    finally:
        os.close(rfd)


def remove_stale(root: str, budget: RemovalBudget | None = None) -> int:
    """Remove what the prolog set aside (agent side); returns how many entries went."""
    rfd = _open_root(root)
    try:
        try:
            sfd = os.open(STALE, _DIR_FLAGS, dir_fd=rfd)
        except FileNotFoundError:
            return 0
        try:
            names = os.listdir(sfd)
            for n in names:
                remove_tree_at(sfd, n, budget=budget)
            return len(names)
        finally:
            os.close(sfd)
    finally:
        os.close(rfd)


@contextmanager
def open_job_dir(root: str, job_id: int) -> Iterator[int]:
    """An fd of the job's staging dir, opened without following any link."""
    rfd = _open_root(root)
    try:
        dfd = os.open(job_dir_name(job_id), _DIR_FLAGS, dir_fd=rfd)
    finally:
        os.close(rfd)
    try:
        yield dfd
    finally:
        os.close(dfd)


def open_dir_at(dir_fd: int, relpath: str) -> int:
    """Walk ``a/b/c`` from ``dir_fd`` one component at a time with O_NOFOLLOW."""
    try:
        return safefs.open_dir_at(dir_fd, relpath)
    except safefs.UnsafePath:
        raise CheckpointError(f"checkpoint: path {relpath!r} is not plain") from None


def open_owned_file(dir_fd: int, relpath: str, uid: int) -> int:
    """Open a regular file under ``dir_fd`` that belongs to ``uid``; never a link or device."""
    head, _, name = relpath.rpartition("/")
    pfd = open_dir_at(dir_fd, head) if head else os.dup(dir_fd)
    try:
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=pfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointError(f"checkpoint: {relpath} is a symlink; refusing it"
                                      ) from None
            raise
    finally:
        os.close(pfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
        os.close(fd)
        raise CheckpointError(
            f"checkpoint: {relpath}: refusing a file that is not a regular file with one link "
            f"owned by uid {uid} (mode {oct(st.st_mode)}, owner {st.st_uid}, "
            f"links {st.st_nlink})")
    os.set_blocking(fd, True)
    return fd


def remove_tree_nofollow(path: str | os.PathLike[str]) -> None:
    """Delete a tree; symlinks inside are unlinked, their targets never touched."""
    path = os.fspath(path)
    parent, name = os.path.split(path.rstrip("/"))
    pfd = os.open(parent or ".", _DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        remove_tree_at(pfd, name, missing_ok=True)
    finally:
        os.close(pfd)


def remove_at(dir_fd: int, name: str, budget: RemovalBudget | None = None) -> None:
    """Remove one entry (tree or file) of an fd-opened dir without following links.

    With a ``budget``, nofollow.RemovalIncomplete says it stopped part way."""
    remove_tree_at(dir_fd, name, budget=budget)


def remove_job_dir(root: str, job_id: int, budget: RemovalBudget | None = None) -> bool:
    """Delete a job's staging dir (root side); False when it did not exist."""
    rfd = _open_root(root)
    try:
        try:
            remove_at(rfd, job_dir_name(job_id), budget)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(rfd)


def clean_tmp(root: str, job_id: int) -> list[str]:
    """Remove crashed saves (``*.tmp`` parts) and anything that is not a dir or file."""
    removed: list[str] = []
    with open_job_dir(root, job_id) as jfd:
        for entry in os.scandir(jfd):
            st = os.stat(entry.name, dir_fd=jfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                if not stat.S_ISREG(st.st_mode):
                    os.unlink(entry.name, dir_fd=jfd)
                    removed.append(entry.name)
                continue
            sfd = os.open(entry.name, _DIR_FLAGS, dir_fd=jfd)
            try:
                for sub in os.scandir(sfd):
                    sst = os.stat(sub.name, dir_fd=sfd, follow_symlinks=False)
                    if sub.name.endswith(".tmp") or stat.S_ISLNK(sst.st_mode):
                        remove_at(sfd, sub.name)
                        removed.append(f"{entry.name}/{sub.name}")
            finally:
                os.close(sfd)
    return removed
