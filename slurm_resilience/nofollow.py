"""Removing trees that users control, as root, without ever following a link.

Every step goes through directory file descriptors opened with ``O_NOFOLLOW``:
a symlink planted anywhere in the tree is unlinked itself, and what it points
to is never touched. Shared by the checkpoint staging and heartbeat cleanups.

The walk is iterative and holds at most ``MAX_OPEN_DIRS`` directory fds, however
deep the tree: a directory found below that depth is renamed up into the top of
the tree being removed (it stays inside it, and ``..`` is never trusted) and taken
apart from there. A ``RemovalBudget`` bounds the entries and the time one call
may spend; past it, ``RemovalIncomplete`` says how far it got, and the next call
carries on where this one stopped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_OPEN_DIRS = 32
_MOVED = ".sr-rm-"


@dataclass(frozen=True)
class RemovalBudget:
    """How much one removal may do before it stops (None: no bound)."""

    max_entries: int | None = None
    max_seconds: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic)


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
    started = budget.clock()
    top = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    stack = [_Level(top, os.scandir(top), name)]
    removed = 0
    moved = 0
    try:
        while stack:
            if budget.max_entries is not None and removed >= budget.max_entries:
                raise RemovalIncomplete(name, removed, f"entry budget {budget.max_entries} spent")
            if budget.max_seconds is not None and budget.clock() - started > budget.max_seconds:
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
