"""A small JSON state file changed by several processes (hooks and the agent of a node):
read, change and replace it under an exclusive lock, so no change is lost."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def update(path: str, lock_name: str, read: Callable[[str], T], empty: Callable[[], T],
           change: Callable[[T], None], unreadable: Callable[[Exception], None]) -> None:
    """``change`` the document at ``path`` in place and write it back atomically, under the
    lock file ``lock_name`` beside it. A document ``read`` can't parse is reported to
    ``unreadable`` and started anew from ``empty()``. Raises OSError (the caller says so)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    lock_fd = os.open(os.path.join(directory, lock_name),
                      os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            doc = read(path)
        except (OSError, ValueError) as exc:
            unreadable(exc)
            doc = empty()
        change(doc)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)
    finally:
        os.close(lock_fd)
