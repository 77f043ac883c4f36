"""Idempotent file placement: write only what differs, atomically, and report it."""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass
from pathlib import Path


class Action(enum.Enum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    REMOVED = "removed"


@dataclass(frozen=True)
class Change:
    """What one step did to one path."""

    path: Path
    action: Action
    detail: str = ""

    @property
    def changed(self) -> bool:
        return self.action is not Action.UNCHANGED


def _current(dest: Path) -> tuple[bytes, int] | None:
    """Content and mode of a regular file at ``dest``; None when absent or not a regular file."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None  # a symlink or anything else is replaced, never followed
    return dest.read_bytes(), stat.S_IMODE(st.st_mode)


def place(dest: Path, data: bytes, mode: int, detail: str = "", *,
          dry_run: bool = False) -> Change:
    """Make ``dest`` a regular file holding ``data`` with ``mode``.

    Written beside and renamed over, so Slurm never runs a half-written hook; a
    symlink at ``dest`` is replaced, not followed. ``dry_run``: say what would change.
    """
    existed = os.path.lexists(dest)
    if _current(dest) == (data, mode):
        return Change(dest, Action.UNCHANGED, detail)
    if dry_run:
        return Change(dest, Action.UPDATED if existed else Action.CREATED, detail)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.new")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), mode)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return Change(dest, Action.UPDATED if existed else Action.CREATED, detail)


def ensure_line(path: Path, line: str, mode: int = 0o644, *, dry_run: bool = False) -> Change:
    """``path`` contains ``line`` (appended when missing; the rest of the file is kept)."""
    current = _current(path)
    text = current[0].decode() if current else ""
    if line in text.splitlines():
        return Change(path, Action.UNCHANGED, line)
    if text and not text.endswith("\n"):
        text += "\n"
    keep_mode = current[1] if current else mode
    return place(path, (text + line + "\n").encode(), keep_mode, line, dry_run=dry_run)


def drop_line(path: Path, line: str, *, dry_run: bool = False) -> Change:
    """``path`` no longer contains ``line`` (the rest of the file and its mode are kept)."""
    current = _current(path)
    if current is None or line not in current[0].decode().splitlines():
        return Change(path, Action.UNCHANGED, f"without {line}")
    kept = [ln for ln in current[0].decode().splitlines(keepends=True)
            if ln.rstrip("\n") != line]
    change = place(path, "".join(kept).encode(), current[1], f"without {line}", dry_run=dry_run)
    return Change(path, Action.REMOVED if change.changed else Action.UNCHANGED, change.detail)


def remove(path: Path, detail: str = "", *, dry_run: bool = False) -> Change:
    """``path`` gone (a file or a symlink, never followed; a directory only when empty)."""
    if not os.path.lexists(path):
        return Change(path, Action.UNCHANGED, detail or "absent")
    if not dry_run:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    return Change(path, Action.REMOVED, detail)


def mode_of(path: Path, default: int = 0o644) -> int:
    """The permission bits of an existing file, else ``default``."""
    current = _current(path)
    return current[1] if current else default
