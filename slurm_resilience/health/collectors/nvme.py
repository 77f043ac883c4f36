"""Read the local NVMe / checkpoint staging disk: mount, free space, a write probe, SMART.

The write probe creates a fresh file with ``O_EXCL|O_NOFOLLOW`` under a random
name, because the staging directory may be writable by users: a name they
planted (or a symlink) is never opened.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import time
from typing import Any

from slurm_resilience.proc import CommandError, Runner

PROBE_BYTES = 4096


def _used_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (apparent size), without following symlinks."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return total


def _probe(path: str) -> tuple[float | None, str | None]:
    """Milliseconds to write and fsync a small new file, or the error."""
    name = os.path.join(path, f".slurm-resilience-probe-{secrets.token_hex(8)}")
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


def parse_smart(text: str) -> dict[str, int | None]:
    """critical_warning and percentage used from ``nvme smart-log -o json`` (percent_used)
    or ``smartctl -j`` (nvme_smart_health_information_log.percentage_used)."""
    data = json.loads(text)
    log = data.get("nvme_smart_health_information_log", data)
    used = log.get("percentage_used", log.get("percent_used"))
    warning = log.get("critical_warning")
    media = log.get("media_errors")
    spare = log.get("available_spare", log.get("avail_spare"))
    spare_min = log.get("available_spare_threshold", log.get("spare_thresh"))
    return {
        "critical_warning": int(warning) if warning is not None else None,
        "percentage_used": int(used) if used is not None else None,
        "media_errors": int(media) if media is not None else None,
        "available_spare": int(spare) if spare is not None else None,
        "available_spare_threshold": int(spare_min) if spare_min is not None else None,
    }


def _smart(device: str, timeout: float) -> dict[str, Any]:
    if shutil.which("nvme") is None:
        return {"skipped": "nvme-cli not installed"}
    try:
        result = Runner().run(["nvme", "smart-log", device, "-o", "json"], timeout=timeout)
    except CommandError as exc:
        return {"error": f"couldn't read the SMART log of {device}: {str(exc).splitlines()[0]}"}
    try:
        return parse_smart(result.stdout)
    except (ValueError, AttributeError) as exc:
        return {"error": f"couldn't parse nvme smart-log output: {exc}"}


def collect(path: str, *, size_limit: int = 0, active: bool = True, smart: bool = True,
            device: str = "/dev/nvme0", timeout: float = 5.0) -> dict[str, Any]:
    """Snapshot: ``{"path", "exists", "mountpoint", "total", "free", "probe_ms", ...}``."""
    snap: dict[str, Any] = {"path": path, "exists": False, "error": None}
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return snap
    except OSError as exc:
        snap["error"] = f"couldn't stat {path}: {exc.strerror}"
        return snap
    snap["exists"] = stat.S_ISDIR(st.st_mode)
    snap["mountpoint"] = os.path.ismount(path)
    vfs = os.statvfs(path)
    total = vfs.f_blocks * vfs.f_frsize
    free = vfs.f_bavail * vfs.f_frsize
    snap["read_only"] = bool(vfs.f_flag & os.ST_RDONLY)
    if size_limit:
        # The sandbox gives each node a directory on one shared filesystem: its
        # "disk" is size_limit bytes, of which the files under it use some.
        total = size_limit
        free = min(free, max(0, size_limit - _used_bytes(path)))
        snap["size_limited"] = True
    snap["total"] = total
    snap["free"] = free
    if active and snap["exists"]:
        snap["probe_ms"], snap["probe_error"] = _probe(path)
    if active and smart:
        snap["smart"] = _smart(device, timeout)
    return snap
