"""A size- and inode-limited tmpfs on each job's run directory, and the ``.stale/`` set-aside.

Why a tmpfs: the kernel enforces ``size=`` and ``nr_inodes=`` at every write, so a job can't
fill the filesystem under ``node.run_dir`` nor leave millions of files for the epilog; the
epilog's lazy unmount (MNT_DETACH) then frees all of it at once, whatever the job left, and
the pages are charged to the job's own memory cgroup meanwhile. The same idea as Slurm's
job_container/tmpfs, which mounts per-job /tmp and /dev/shm and detaches them at the end.

The mount point is made by root in the root-owned run dir and stays root-owned, mode 0700,
under the mount: a job that does not see the mount (a private mount namespace made before
the prolog) gets EACCES there instead of writing to the unbounded directory beneath.

mount(8) and umount(8) run through :mod:`slurm_resilience.proc` (argv, a timeout), with
``--no-canonicalize``: every component of the path is root's, checked by the caller, and
nothing is resolved again.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from typing import TYPE_CHECKING

from slurm_resilience.config.budgets import MOUNT_TIMEOUT_S

if TYPE_CHECKING:  # proc (subprocess) loads only when a mount is made: prolog imports stay light
    from slurm_resilience.proc import Runner

SOURCE = "slurm-resilience"  # the "device" /proc/mounts shows for our mounts
STALE = ".stale"  # leftovers set aside for the agent; root-only
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def runner() -> Runner:
    from slurm_resilience.proc import Runner

    # slurmd gives hooks a minimal environment: name the system dirs, and C messages.
    return Runner(env={"PATH": SYSTEM_PATH, "LC_ALL": "C"})


def options(uid: int, gid: int, size: int, inodes: int) -> str:
    return (f"size={int(size)},nr_inodes={int(inodes)},mode=0700,uid={int(uid)},"
            f"gid={int(gid)},nosuid,nodev,noexec")


def mount(path: str, *, uid: int, gid: int, size: int, inodes: int, run: Runner) -> None:
    """Mount a fresh tmpfs on ``path`` for uid:gid; raises proc.CommandError on failure."""
    run.run(["mount", "--no-canonicalize", "-t", "tmpfs", "-o",
             options(uid, gid, size, inodes), SOURCE, path], timeout=MOUNT_TIMEOUT_S)


def unmount(path: str, *, run: Runner) -> None:
    """Detach the mount on ``path`` at once (MNT_DETACH): files a process still holds open
    stay usable until closed, then the kernel frees them; raises proc.CommandError."""
    run.run(["umount", "--lazy", "--no-canonicalize", path], timeout=MOUNT_TIMEOUT_S)


def is_mount_point(parent_fd: int, name: str) -> bool:
    """Whether directory ``name`` under ``parent_fd`` is on another device than its parent
    (a mount point; users can't mount, so a bind of the same device can't be theirs)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_dev != os.fstat(parent_fd).st_dev


def set_aside(root_fd: int, name: str) -> str:
    """Rename ``name`` (never followed) into the root-only ``.stale/``: instant whatever its
    size. Returns the new name; raises OSError (a ``.stale`` that isn't root's is refused)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(STALE, 0o700, dir_fd=root_fd)
    sfd = os.open(STALE, _DIR_FLAGS, dir_fd=root_fd)
    try:
        st = os.fstat(sfd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{STALE} is not a root-only directory "
                                  f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        new = f"{name}.{time.time_ns()}"
        os.rename(name, new, src_dir_fd=root_fd, dst_dir_fd=sfd)
        return new
    finally:
        os.close(sfd)
