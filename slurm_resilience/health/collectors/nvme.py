"""Read the local NVMe / checkpoint staging disk: mount, free space, a write probe, SMART.

The write probe creates a fresh file with ``O_EXCL|O_NOFOLLOW`` under a random
name, because the staging directory may be writable by users: a name they
planted (or a symlink) is never opened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from typing import Any

PROBE_BYTES = 4096


@dataclass
class SmartLog:
    """What the check reads of an NVMe SMART / health log; None where the log lacks it.
    ``skipped``/``error``: the log was not read, and why."""

    critical_warning: int | None = None
    percentage_used: int | None = None
    media_errors: int | None = None
    available_spare: int | None = None
    available_spare_threshold: int | None = None
    skipped: str | None = None
    error: str | None = None


@dataclass
class NvmeSnapshot:
    path: str
    exists: bool = False
    error: str | None = None
    mountpoint: bool | None = None
    read_only: bool | None = None
    size_limited: bool = False
    total: int | None = None
    free: int | None = None
    probe_ms: float | None = None
    probe_error: str | None = None
    smart: SmartLog | None = None
    reclaimable: int = 0  # bytes the checkpoint agent's eviction gives back
    reclaim_note: str | None = None  # why its record was not taken

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NvmeSnapshot:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        smart = fields.pop("smart", None)
        return cls(**fields, smart=SmartLog(**smart) if smart is not None else None)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _used_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (apparent size), never following a symlink.

    Users write under ``path``, so the tree may be as deep as they like: the walk is a loop
    (no recursion limit) holding one descriptor, each directory opened by name from its
    parent's (no PATH_MAX) and left through its ``..``, which must be the parent it came
    from; a directory moved away meanwhile ends the walk with what was counted so far.
    """
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return 0
    try:
        total, subdirs = _list_dir(fd)
        pending, came_from = [subdirs], [_identity(fd)]
        while pending:
            if pending[-1]:
                try:
                    child = os.open(pending[-1].pop(), _DIR_FLAGS, dir_fd=fd)
                except OSError:  # removed meanwhile, or replaced by a symlink
                    continue
                os.close(fd)
                fd = child
                size, subdirs = _list_dir(fd)
                total += size
                pending.append(subdirs)
                came_from.append(_identity(fd))
                continue
            pending.pop()
            came_from.pop()
            if not pending:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _identity(fd) != came_from[-1]:
                break
    except OSError:
        pass  # ".." gone: what was counted stands
    finally:
        os.close(fd)
    return total


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _list_dir(fd: int) -> tuple[int, list[str]]:
    """Bytes of the regular files in the directory ``fd``, and its subdirectories' names."""
    size, subdirs = 0, []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    elif entry.is_file(follow_symlinks=False):
                        size += entry.stat(follow_symlinks=False).st_size
                except OSError:  # removed while listed
                    continue
    except OSError:
        return 0, []
    return size, subdirs


def _probe(path: str) -> tuple[float | None, str | None]:
    """Milliseconds to write and fsync a small new file, or the error."""
    name = os.path.join(path, f".slurm-resilience-probe-{os.urandom(8).hex()}")
    started = time.monotonic()
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        return None, f"couldn't create a file in {path}: {exc.strerror}"
    try:
        os.write(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    except OSError as exc:
        return None, f"couldn't write+fsync in {path}: {exc.strerror}"
    finally:
        os.close(fd)
        os.unlink(name)
    return (time.monotonic() - started) * 1000.0, None


def parse_smart(text: str) -> SmartLog:
    """critical_warning and percentage used from ``nvme smart-log -o json`` (percent_used)
    or ``smartctl -j`` (nvme_smart_health_information_log.percentage_used)."""
    data = json.loads(text)
    log = data.get("nvme_smart_health_information_log", data)
    used = log.get("percentage_used", log.get("percent_used"))
    warning = log.get("critical_warning")
    media = log.get("media_errors")
    spare = log.get("available_spare", log.get("avail_spare"))
    spare_min = log.get("available_spare_threshold", log.get("spare_thresh"))
    def num(v: Any) -> int | None:
        return int(v) if v is not None else None

    return SmartLog(num(warning), num(used), num(media), num(spare), num(spare_min))


def _smart(device: str, timeout: float) -> SmartLog:
    if shutil.which("nvme") is None:
        return SmartLog(skipped="nvme-cli not installed")
    from slurm_resilience.proc import CommandError, Runner  # healthcheck only, not the prolog

    try:
        result = Runner().run(["nvme", "smart-log", device, "-o", "json"], timeout=timeout)
    except CommandError as exc:
        return SmartLog(error=f"couldn't read the SMART log of {device}: "
                              f"{str(exc).splitlines()[0]}")
    try:
        return parse_smart(result.stdout)
    except (ValueError, AttributeError, TypeError) as exc:
        return SmartLog(error=f"couldn't parse nvme smart-log output: {exc}")


def collect(path: str, *, size_limit: int = 0, active: bool = True, smart: bool = True,
            device: str = "/dev/nvme0", timeout: float = 5.0,
            reclaim_dir: str = "", reclaim_below: int | None = None) -> NvmeSnapshot:
    """Mount, space, and (``active``) a write probe and the SMART log of ``path``'s disk."""
    snap = NvmeSnapshot(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return snap
    except OSError as exc:
        snap.error = f"couldn't stat {path}: {exc.strerror}"
        return snap
    snap.exists = stat.S_ISDIR(st.st_mode)
    snap.mountpoint = os.path.ismount(path)
    vfs = os.statvfs(path)
    total = vfs.f_blocks * vfs.f_frsize
    free = vfs.f_bavail * vfs.f_frsize
    snap.read_only = bool(vfs.f_flag & os.ST_RDONLY)
    if size_limit:
        # The sandbox gives each node a directory on one shared filesystem: its
        # "disk" is size_limit bytes, of which the files under it use some.
        total = size_limit
        free = min(free, max(0, size_limit - _used_bytes(path)))
        snap.size_limited = True
    snap.total = total
    snap.free = free
    # What checkpoint eviction can reclaim is measured only when the disk is short
    # (``reclaim_below``: the check's min_free), so the healthy prolog does no walk.
    if reclaim_dir and (reclaim_below is None or free < reclaim_below):
        from slurm_resilience.checkpoint import reclaim_record

        snap.reclaimable, snap.reclaim_note = reclaim_record.read(reclaim_dir,
                                                                   apparent=size_limit > 0)
    if active and snap.exists:
        snap.probe_ms, snap.probe_error = _probe(path)
    if active and smart:
        snap.smart = _smart(device, timeout)
    return snap


def collect_json(path: str, **kwargs: Any) -> dict[str, Any]:
    """:func:`collect` for the collector child, whose answer travels as JSON."""
    return collect(path, **kwargs).to_json()
