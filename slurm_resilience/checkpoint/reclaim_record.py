"""The agent's record of what eviction can reclaim, which the health gate's nvme check reads.

After each pass the agent writes (root-owned, atomic rename) the committed steps that
eviction takes without any job's help: staging root, job dir and step dir names. The
gate measures those steps itself when it checks, so bytes a user added to a finished
job's step after the agent's pass count too, and adds them to the disk's free space: it
never drains a node for space our own retention holds. A record that is stale (the
agent stopped), not root's, or mangled counts as nothing, and the check says why.
"""

from __future__ import annotations

import json
import os
import stat
import time

from slurm_resilience.checkpoint.errors import CheckpointError
from slurm_resilience.checkpoint.staging import open_dir_at

NAME = "ckpt-reclaimable.json"
MAX_AGE_S = 300.0  # the agent rewrites it every pass; older means it stopped
MAX_STEPS = 10_000  # a record naming more is not taken
MAX_WALK_ENTRIES = 1_000_000  # per tree measured; a user can make a tree arbitrarily big
_LIMIT = 4 << 20


def path(state_dir: str) -> str:
    return os.path.join(state_dir, NAME)


def tree_bytes_at(parent_fd: int, name: str, *, apparent: bool,
                  max_entries: int = MAX_WALK_ENTRIES) -> int:
    """Bytes under ``name`` (a dir of ``parent_fd``), never following a symlink; an
    iterative walk (no recursion) of at most ``max_entries`` entries. ``apparent``:
    file sizes (the sandbox's stand-in disk counts those), else allocated blocks."""
    total, seen = 0, 0
    stack = [open_dir_at(parent_fd, name)]
    try:
        while stack:
            dfd = stack.pop()
            try:
                for entry in os.listdir(dfd):
                    seen += 1
                    if seen > max_entries:
                        raise CheckpointError(f"checkpoint: space: {name} has more than "
                                              f"{max_entries:,} entries; not measured")
                    try:
                        st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(open_dir_at(dfd, entry))
                    elif stat.S_ISREG(st.st_mode):
                        total += st.st_size if apparent else st.st_blocks * 512
            finally:
                os.close(dfd)
    finally:
        for dfd in stack:
            os.close(dfd)
    return total


def write(state_dir: str, staging_root: str, steps: list[tuple[str, str]], now: float) -> None:
    """``steps``: (job dir name, step dir name) under ``staging_root``."""
    os.makedirs(state_dir, mode=0o755, exist_ok=True)
    final = path(state_dir)
    tmp = f"{final}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        os.write(fd, json.dumps({"at": now, "staging_root": staging_root,
                                 "steps": [list(s) for s in steps]}).encode())
    finally:
        os.close(fd)
    os.replace(tmp, final)


def _load(state_dir: str, now: float) -> tuple[dict[str, object] | None, str | None]:
    try:
        fd = os.open(path(state_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"couldn't open the reclaimable record: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
            return None, "reclaimable record is not a regular file owned by root; ignored"
        data = json.loads(os.read(fd, _LIMIT))
        at = float(data["at"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"reclaimable record unreadable ({exc}); ignored"
    finally:
        os.close(fd)
    if now - at > MAX_AGE_S:
        return None, f"reclaimable record is {now - at:.0f}s old (agent not running?); ignored"
    return data, None


def read(state_dir: str, *, apparent: bool, now: float | None = None) -> tuple[int, str | None]:
    """Bytes of the recorded steps, measured now, and why the record was not taken."""
    data, why = _load(state_dir, time.time() if now is None else now)
    if data is None:
        return 0, why
    try:
        root, steps = str(data["staging_root"]), data["steps"]
        if not isinstance(steps, list) or len(steps) > MAX_STEPS:
            return 0, "reclaimable record names too many steps; ignored"
        rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, KeyError, TypeError) as exc:
        return 0, f"reclaimable record unusable ({exc}); ignored"
    total = 0
    try:
        for job, step in steps:
            try:
                jfd = open_dir_at(rfd, str(job))
            except (OSError, CheckpointError):
                continue  # evicted or removed since: nothing to count
            try:
                total += tree_bytes_at(jfd, str(step), apparent=apparent)
            except (OSError, CheckpointError):
                continue
            finally:
                os.close(jfd)
    except (TypeError, ValueError) as exc:
        return 0, f"reclaimable record unusable ({exc}); ignored"
    finally:
        os.close(rfd)
    return total, None
