"""Root-safe file operations: the one place for code working in directories users control.

* Open a directory: paths are walked one component at a time with ``O_NOFOLLOW``
  (``open_dir`` from ``/``, ``open_dir_at`` from a directory fd), so a symlink planted
  anywhere on the way makes the operation fail instead of sending root somewhere else.
* Make owned directories (``make_owned_dir``, ``makedirs_owned_at``,
  ``open_or_make_owned_dir``, ``makedirs_root``) and files (``create_owned``): created
  with ``O_EXCL``/``mkdir`` and handed to their owner with ``fchown`` on the open fd.
* Atomic writes (``replace_file``, ``write_atomic_path``): a temporary file never
  reached through a link, optionally fsynced, renamed over the target.
* Read an owned file with a size bound (``read_owned_file``), reach a path a job named
  only as its user could (``open_job_path``, ``read_job_file``).
* Remove a tree without following links (``remove_tree_at``, below).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from slurm_resilience.clock import Clock, SystemClock

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
              mode: int = 0o600, durable: bool = False) -> None:
    """Create ``name`` (never an existing one, never through a link) and give it to uid:gid;
    fsynced when ``durable``."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=dir_fd)
    try:
        if uid >= 0 or gid >= 0:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(dir_fd: int, name: str, data: bytes, *, mode: int = 0o600, uid: int = -1,
                 gid: int = -1, durable: bool = False, tmp: str | None = None) -> None:
    """Atomically replace ``name`` under ``dir_fd``: a new temporary file (never through a
    link, given to uid:gid), fsynced when ``durable``, renamed over ``name``. A temporary
    file left by a failure is removed."""
    tmp = tmp or f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    try:
        write_new(dir_fd, tmp, data, uid=uid, gid=gid, mode=mode, durable=durable)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def write_atomic_path(path: str | os.PathLike[str], data: bytes, *, durable: bool,
                      tmp: str | None = None, mode: int = 0o600) -> None:
    """``replace_file`` by path (the directory opened as it is: for the caller's own dirs);
    with ``durable`` the file and then the directory are fsynced."""
    path = os.fspath(path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        replace_file(dfd, os.path.basename(path), data, mode=mode, durable=durable, tmp=tmp)
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)


def _plain(name: str) -> str:
    if name in ("", ".", "..") or "/" in name:
        raise UnsafePath(errno.EINVAL, f"{name!r} is not a plain name")
    return name


def open_dir_at(dir_fd: int, relpath: str) -> int:
    """Open ``a/b/c`` under ``dir_fd``, one component at a time, with O_NOFOLLOW."""
    fd = os.dup(dir_fd)
    try:
        for part in relpath.split("/"):
            nfd = os.open(_plain(part), _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_owned_dir(dir_fd: int, name: str, uid: int, gid: int, mode: int = 0o700) -> int:
    """Create directory ``name`` (it must not exist) and give it to uid:gid; returns its fd."""
    os.mkdir(_plain(name), mode, dir_fd=dir_fd)
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    os.fchown(fd, uid, gid)
    return fd


def makedirs_owned_at(base_fd: int, relpath: str, uid: int, gid: int) -> int:
    """Open ``relpath`` under ``base_fd``, creating missing levels owned by uid:gid."""
    fd = os.dup(base_fd)
    for part in [p for p in relpath.split("/") if p]:
        try:
            try:
                nfd = make_owned_dir(fd, part, uid, gid)
            except FileExistsError:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        fd = nfd
    return fd


def open_or_make_owned_dir(dir_fd: int, name: str, uid: int, gid: int) -> int:
    """A subdirectory that is a real directory owned by ``uid`` (created for uid:gid when
    missing); raises UnsafePath for a link, a non-directory or another owner."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(_plain(name), 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise UnsafePath(exc.errno or errno.EINVAL, f"{name}: not a real directory "
                         f"({os.strerror(exc.errno or 0)}); refusing it") from None
    st = os.fstat(fd)
    if st.st_uid == 0 and uid != 0:
        os.fchown(fd, uid, gid)  # just created by us
    elif st.st_uid != uid:
        os.close(fd)
        raise UnsafePath(errno.EPERM, f"{name}: owned by uid {st.st_uid}, not {uid}")
    return fd


def create_owned(dir_fd: int, name: str, uid: int, gid: int, mode: int = 0o600) -> int:
    """Create a new file (never an existing one, never through a link) for uid:gid; its fd
    is open for reading and writing."""
    fd = os.open(_plain(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=dir_fd)
    os.fchown(fd, uid, gid)
    return fd


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


# -- removing trees users control ---------------------------------------------------------
# Every step goes through directory file descriptors opened with ``O_NOFOLLOW``:
# a symlink planted anywhere in the tree is unlinked itself, and what it points
# to is never touched. Shared by the checkpoint staging and heartbeat cleanups.
#
# The walk is iterative and holds at most ``MAX_OPEN_DIRS`` directory fds, however
# deep the tree: a directory found below that depth is renamed up into the top of
# the tree being removed (it stays inside it, and ``..`` is never trusted) and taken
# apart from there. A ``RemovalBudget`` bounds the entries and the time one call
# may spend; past it, ``RemovalIncomplete`` says how far it got, and the next call
# carries on where this one stopped.
MAX_OPEN_DIRS = 32
_MOVED = ".sr-rm-"


@dataclass(frozen=True)
class RemovalBudget:
    """How much one removal may do before it stops (None: no bound)."""

    max_entries: int | None = None
    max_seconds: float | None = None
    clock: Clock = field(default_factory=SystemClock)


class RemovalIncomplete(Exception):
    """The budget ran out; ``removed`` entries are gone, the rest is left for next time."""

    def __init__(self, name: str, removed: int, why: str):
        super().__init__(f"nofollow: remove: couldn't finish removing {name}: {why} "
                         f"({removed} entries removed, the rest left for the next pass)")
        self.removed = removed


@dataclass
class _Level:
    fd: int
    entries: Iterator[os.DirEntry[str]]
    name: str  # its name in the level above (or in the caller's parent dir)


def remove_tree_at(parent_fd: int, name: str, *, missing_ok: bool = False,
                   budget: RemovalBudget | None = None) -> int:
    """Remove ``name`` (file, link or tree) under ``parent_fd``; returns entries removed.

    A missing ``name`` raises FileNotFoundError unless ``missing_ok``; a spent
    ``budget`` raises RemovalIncomplete.
    """
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        if missing_ok:
            return 0
        raise
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)  # a link is removed, never its target
        return 1
    budget = budget or RemovalBudget()
    started = budget.clock.monotonic()
    top = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    stack = [_Level(top, os.scandir(top), name)]
    removed = 0
    moved = 0
    try:
        while stack:
            if budget.max_entries is not None and removed >= budget.max_entries:
                raise RemovalIncomplete(name, removed, f"entry budget {budget.max_entries} spent")
            if (budget.max_seconds is not None
                    and budget.clock.monotonic() - started > budget.max_seconds):
                raise RemovalIncomplete(name, removed, f"time budget {budget.max_seconds}s spent")
            level = stack[-1]
            entry = next(level.entries, None)
            if entry is None:
                if _rmdir_level(stack, parent_fd):
                    removed += 1
                continue
            try:
                is_dir = stat.S_ISDIR(os.stat(entry.name, dir_fd=level.fd,
                                              follow_symlinks=False).st_mode)
            except FileNotFoundError:
                continue
            if not is_dir:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=level.fd)
                    removed += 1
                continue
            if len(stack) >= MAX_OPEN_DIRS:
                moved = _move_to_top(level.fd, entry.name, top, moved)
                continue
            try:
                cfd = os.open(entry.name, _DIR_FLAGS, dir_fd=level.fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link or a file
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=level.fd)
                        removed += 1
                    continue
                if exc.errno == errno.ENOENT:
                    continue
                raise
            stack.append(_Level(cfd, os.scandir(cfd), entry.name))
    finally:
        for level in stack:
            level.entries.close()  # type: ignore[attr-defined]
            os.close(level.fd)
    return removed


def _rmdir_level(stack: list[_Level], parent_fd: int) -> bool:
    """The deepest level is listed out: remove it, or list it again if it filled up."""
    level = stack[-1]
    above = stack[-2].fd if len(stack) > 1 else parent_fd
    try:
        os.rmdir(level.name, dir_fd=above)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        # Entries appeared (or were moved here) after the listing started: list again.
        level.entries.close()  # type: ignore[attr-defined]
        level.entries = os.scandir(level.fd)
        return False
    level.entries.close()  # type: ignore[attr-defined]
    os.close(level.fd)
    stack.pop()
    return True


def _move_to_top(dir_fd: int, name: str, top_fd: int, moved: int) -> int:
    """Rename a too-deep directory into the top of the tree under a fresh name."""
    for _ in range(1000):
        moved += 1
        try:
            os.rename(name, f"{_MOVED}{moved}", src_dir_fd=dir_fd, dst_dir_fd=top_fd)
            return moved
        except FileNotFoundError:
            return moved
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
    raise OSError(errno.EEXIST, f"nofollow: remove: no free name to move {name} to")
