"""File operations for root code working in directories users control.

Paths are walked one component at a time from ``/`` with ``O_NOFOLLOW``, so a
symlink planted anywhere on the way makes the operation fail instead of sending
root somewhere else; files are created with ``O_EXCL`` and handed to their
owner with ``fchown`` on the open descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path that is not what root code may use: a symlink, wrong owner, wrong type."""


def open_dir(path: str) -> int:
    """Open directory ``path`` without following any symlink on the way; returns an fd."""
    if not os.path.isabs(path):
        raise UnsafePath(errno.EINVAL, f"{path!r} is not an absolute path")
    fd = os.open("/", _DIR_FLAGS)
    try:
        for part in [p for p in path.split("/") if p]:
            if part in (".", ".."):
                raise UnsafePath(errno.EINVAL, f"{path!r} contains {part!r}")
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(exc.errno, f"{path}: {part} is a symlink or not a "
                                                "directory") from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_owned_dir(fd: int, uid: int, *, private: bool, what: str) -> os.stat_result:
    """The open directory is owned by ``uid`` (and, when ``private``, mode 0700)."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(errno.ENOTDIR, f"{what} is not a directory")
    if st.st_uid != uid:
        raise UnsafePath(errno.EPERM, f"{what} is owned by uid {st.st_uid}, expected {uid}")
    if private and st.st_mode & 0o077:
        raise UnsafePath(errno.EPERM, f"{what} has mode {stat.S_IMODE(st.st_mode):o}, "
                                      "expected 700")
    return st


def read_owned_file(dir_fd: int, name: str, uid: int, *, max_bytes: int,
                    exact: int | None = None) -> bytes:
    """Read a regular file owned by ``uid`` under ``dir_fd``, never through a link or a FIFO."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(errno.EINVAL, f"{name} is not a regular file")
        if st.st_uid != uid:
            raise UnsafePath(errno.EPERM, f"{name} is owned by uid {st.st_uid}, expected {uid}")
        if exact is not None and st.st_size != exact:
            raise UnsafePath(errno.EINVAL, f"{name} is {st.st_size} bytes, expected {exact}")
        if st.st_size > max_bytes:
            raise UnsafePath(errno.EFBIG, f"{name} is {st.st_size} bytes, over {max_bytes}")
        return os.pread(fd, max_bytes if exact is None else exact, 0)
    finally:
        os.close(fd)


def write_new(dir_fd: int, name: str, data: bytes, *, uid: int = -1, gid: int = -1,
              mode: int = 0o600) -> None:
    """Create ``name`` (never an existing one, never through a link) and give it to uid:gid."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=dir_fd)
    try:
        if uid >= 0 or gid >= 0:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def replace_file(dir_fd: int, name: str, data: bytes, *, mode: int = 0o600) -> None:
    """Atomically replace ``name`` in a root-owned directory (temporary file, then rename)."""
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    write_new(dir_fd, tmp, data, mode=mode)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def makedirs_root(path: str, mode: int = 0o700) -> int:
    """Create a root-owned directory chain (each level checked: no links, owned by root)."""
    if not os.path.isabs(path):
        raise UnsafePath(errno.EINVAL, f"{path!r} is not an absolute path")
    fd = os.open("/", _DIR_FLAGS)
    try:
        for part in [p for p in path.split("/") if p]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode, dir_fd=fd)
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        check_owned_dir(fd, os.geteuid(), private=False, what=path)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- paths a job names -------------------------------------------------------------------------
# Root reaches a path from a job's environment only as the job's user could: every directory on
# the way must be searchable by that user, the last one owned by them, nothing is a link, and
# the object itself is looked at through an O_PATH descriptor (which never runs a driver's
# open(), so a device node is never opened) before a real open of that same inode.

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


class JobPathRefused(OSError):
    """A job-named path root won't use; the message is the same whatever the reason was."""


def _searchable_by(st: os.stat_result, uid: int) -> bool:
    """Whether ``uid`` may search this directory (owner bits for the owner, else others'
    bits: group membership is not trusted, so a group-only directory counts as closed)."""
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    return bool(st.st_mode & stat.S_IXOTH)


def open_job_path(path: str, uid: int, *, kind: int, flags: int) -> int:
    """Open ``path`` as named by a job of ``uid``; ``kind`` is the wanted file type
    (``stat.S_IFREG`` or ``stat.S_IFIFO``), ``flags`` the real open's access mode.

    The file must be of that type, owned by ``uid``, in a directory owned by ``uid``, reached
    through directories ``uid`` can search, without symlinks. Every refusal raises
    :class:`JobPathRefused` with one message, so a job learns nothing about paths it can't see.
    """
    refused = JobPathRefused(errno.EACCES, "not a file of the job's user in a directory the "
                                           "user owns (symlinks, devices, FIFOs, sockets and "
                                           "other users' paths are never opened)")
    parts = path.split("/")
    if not path.startswith("/") or any(p in ("", ".", "..") for p in parts[1:]):
        raise refused
    fd = os.open("/", _PATH_FLAGS | os.O_DIRECTORY)
    try:
        for part in parts[1:-1]:
            if not _searchable_by(os.fstat(fd), uid):
                raise refused
            nxt = os.open(part, _PATH_FLAGS | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        parent = os.fstat(fd)
        if parent.st_uid != uid or not _searchable_by(parent, uid):
            raise refused
        pfd = os.open(parts[-1], _PATH_FLAGS, dir_fd=fd)
    except JobPathRefused:
        raise
    except OSError:
        raise refused from None
    finally:
        os.close(fd)
    try:
        st = os.fstat(pfd)
        if stat.S_IFMT(st.st_mode) != kind or st.st_uid != uid:
            raise refused
        # Reopening through the O_PATH descriptor reaches the inode just checked, not
        # whatever the name points at now.
        try:
            real = os.open(f"/proc/self/fd/{pfd}",
                           flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            raise refused from None
    finally:
        os.close(pfd)
    again = os.fstat(real)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        os.close(real)
        raise refused
    return real


def read_job_file(path: str, uid: int, *, max_bytes: int) -> tuple[bytes, float]:
    """``(content, mtime)`` of a regular file a job names (see :func:`open_job_path`)."""
    fd = open_job_path(path, uid, kind=stat.S_IFREG, flags=os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise JobPathRefused(errno.EFBIG, f"larger than {max_bytes} bytes")
        return os.pread(fd, max_bytes, 0), st.st_mtime
    finally:
        os.close(fd)
