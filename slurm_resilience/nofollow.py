"""Removing trees that users control, as root, without ever following a link.

Every step goes through directory file descriptors opened with ``O_NOFOLLOW``:
a symlink planted anywhere in the tree is unlinked itself, and what it points
to is never touched. Shared by the checkpoint staging and heartbeat cleanups.
"""

from __future__ import annotations

import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree_at(parent_fd: int, name: str, *, missing_ok: bool = False) -> int:
    """Remove ``name`` (file, link or tree) under ``parent_fd``; returns entries removed.

    A missing ``name`` raises FileNotFoundError unless ``missing_ok``.
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
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    removed = 0
    try:
        for entry in os.listdir(fd):
            removed += remove_tree_at(fd, entry, missing_ok=True)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)
    return removed + 1
