"""The agent's "reclaimable bytes" record, which the health gate's nvme check reads.

The agent writes it (root-owned, atomic rename) after each eviction pass: the bytes of
committed steps that eviction gives back without any job's help. The gate adds them to
the staging disk's free space, so it never drains a node for space our own retention
holds. A record that is stale (the agent stopped), not root's, or mangled counts as
nothing: the gate then judges the disk by its real free space.
"""

from __future__ import annotations

import json
import os
import stat
import time

NAME = "ckpt-reclaimable.json"
MAX_AGE_S = 300.0  # the agent rewrites it every pass; older means it stopped
_LIMIT = 4096


def path(state_dir: str) -> str:
    return os.path.join(state_dir, NAME)


def write(state_dir: str, reclaimable: int, staging_root: str, now: float) -> None:
    os.makedirs(state_dir, mode=0o755, exist_ok=True)
    final = path(state_dir)
    tmp = f"{final}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        os.write(fd, json.dumps({"reclaimable": int(reclaimable), "at": now,
                                 "staging_root": staging_root}).encode())
    finally:
        os.close(fd)
    os.replace(tmp, final)


def read(state_dir: str, now: float | None = None) -> tuple[int, str | None]:
    """Bytes the record says are reclaimable, and why it was not taken (else None)."""
    now = time.time() if now is None else now
    try:
        fd = os.open(path(state_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0, None
    except OSError as exc:
        return 0, f"couldn't open the reclaimable record: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            return 0, "reclaimable record is not a regular file owned by root; ignored"
        data = json.loads(os.read(fd, _LIMIT))
        value, at = int(data["reclaimable"]), float(data["at"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return 0, f"reclaimable record unreadable ({exc}); ignored"
    finally:
        os.close(fd)
    if now - at > MAX_AGE_S:
        return 0, f"reclaimable record is {now - at:.0f}s old (agent not running?); ignored"
    return max(0, value), None
