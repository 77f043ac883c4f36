"""The node-local result of the last NCCL test, and whether it can still be trusted.

One JSON file in the node's root-owned state directory. It is written
atomically (temp file + rename) and never through a symlink. A result is fresh
when it passed (or could not be checked at all), is younger than ``validity_s``,
was measured in this boot and under the same settings, and nobody invalidated
it (a node returning to service does, see :func:`invalidate`). Reading it costs
one small file read, which is why the prolog can afford to ask on every job.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Literal, TypedDict, cast

from slurm_resilience.config.nccl import NcclSection
from slurm_resilience.config.paths import node_path
from slurm_resilience.log import get_logger

FILENAME = "nccl-result.json"
BOOT_ID = "/proc/sys/kernel/random/boot_id"

Verdict = Literal["pass", "fail", "unknown", "aborted"]


class AttemptDoc(TypedDict):
    """launcher.Attempt.to_json: one run of the ranks."""

    status: str  # a launcher.Status
    detail: str
    seconds: float
    leftovers: list[int]
    ranks: list[dict[str, object]]  # each rank's own report (worker.py), plus its exit code


class VariantDoc(TypedDict):
    """gate.VariantResult.to_json: one variant's verdict and measurements."""

    variant: str
    verdict: Verdict
    kind: str
    reason: str
    busbw_gbps: dict[str, float]  # message size in bytes -> GB/s
    expected_gbps: float | None
    attempts: list[AttemptDoc]


class ResultDoc(TypedDict, total=False):
    """The cached file: a gate.GateResult.to_json plus what the cache adds. The drains
    file (steps.py) holds only ``reasons``."""

    verdict: Verdict
    reasons: list[str]
    model: str
    ranks: int
    backend: str
    seconds: float
    fingerprint: str
    finished_at: float
    variants: list[VariantDoc]
    cached_at: float  # added by store()
    boot_id: str
    invalidated: str  # why, set by invalidate()
    reported: float  # when a hook drained for this failure
    corrupt: bool  # only in what read() returns: the file could not be used


# The fields the hooks act on, with the JSON types they must have; any other type makes
# the file unusable (read as corrupt, so the next chance re-tests).
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "verdict": str, "reasons": list, "fingerprint": str, "cached_at": (int, float),
    "boot_id": str, "invalidated": str, "reported": (int, float), "variants": list,
}


def path_for(state_dir_template: str, node: str) -> str:
    return os.path.join(node_path(state_dir_template, node), FILENAME)


def boot_id(path: str = BOOT_ID) -> str:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


MAX_BYTES = 1 << 20  # far above a real entry; a bigger file is garbage


def read(path: str) -> ResultDoc | None:
    """The cached entry; None when there is none. An unusable file (garbage, binary,
    truncated, huge, not an object, a field of the wrong type, not a file) reads as
    ``{"corrupt": True}``: stale, so the next chance re-tests and rewrites it; said here,
    once per read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _corrupt(path, f"couldn't open it: {exc.strerror}")
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            return _corrupt(path, f"larger than {MAX_BYTES} bytes")
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        return _corrupt(path, str(exc)[:200])
    if not isinstance(data, dict):
        return _corrupt(path, f"a JSON {type(data).__name__}, not an object")
    for key, kind in _FIELD_TYPES.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            return _corrupt(path, f"{key} is a {type(data[key]).__name__}")
    if "verdict" in data and data["verdict"] not in ("pass", "fail", "unknown", "aborted"):
        return _corrupt(path, f"unknown verdict {str(data['verdict'])[:40]!r}")
    return cast(ResultDoc, data)


def _corrupt(path: str, why: str) -> ResultDoc:
    get_logger("nccl").warning("nccl: couldn't use a state file; taken as no result",
                               path=path, reason=why)
    return {"corrupt": True}


def write(path: str, entry: ResultDoc) -> None:
    """Replace the cached entry atomically."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(entry, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: leave no half-written temp behind
            os.unlink(tmp)
        raise


def store(path: str, result: ResultDoc, *, boot: str | None = None,
          now: float | None = None) -> ResultDoc:
    """Cache a :meth:`GateResult.to_json` with when and in which boot it was measured."""
    entry: ResultDoc = {**result, "cached_at": time.time() if now is None else now,
                        "boot_id": boot_id() if boot is None else boot}
    write(path, entry)
    return entry


def invalidate(path: str, why: str) -> bool:
    """Make the next chance re-test (e.g. the node was returned to service).
    Returns False when there was nothing cached."""
    entry = read(path)
    if entry is None:
        return False
    entry["invalidated"] = why
    write(path, entry)
    return True


@dataclass(frozen=True)
class Freshness:
    fresh: bool
    why: str
    age_s: float | None = None


def freshness(entry: ResultDoc | None, *, now: float, validity_s: float, boot: str,
              fingerprint: str) -> Freshness:
    """Pure: can ``entry`` stand in for a test now? ``why`` says what makes it stale."""
    if entry is None:
        return Freshness(False, "no cached result")
    if entry.get("corrupt"):
        return Freshness(False, "cached result unreadable")
    cached_at = entry.get("cached_at", 0.0)
    if not isinstance(cached_at, (int, float)) or isinstance(cached_at, bool):
        return Freshness(False, "cached result unreadable")
    age = now - float(cached_at)
    if entry.get("invalidated"):
        return Freshness(False, f"invalidated: {entry['invalidated']}", age)
    verdict = entry.get("verdict")
    if verdict not in ("pass", "unknown"):
        return Freshness(False, f"last result was {verdict or '?'}", age)
    if boot and entry.get("boot_id") and entry.get("boot_id") != boot:
        return Freshness(False, "node rebooted since the last test", age)
    if entry.get("fingerprint") != fingerprint:
        return Freshness(False, "test settings changed since the last test", age)
    if age < 0:
        return Freshness(False, "cached result is from the future (clock changed)", age)
    if age > validity_s:
        return Freshness(False, f"last test {age:.0f}s ago > {validity_s:g}s", age)
    # "Could not check" (no CUDA torch, no GPU found) is not re-tried on every job either.
    done = "passed" if verdict == "pass" else "could not check"
    return Freshness(True, f"{done} {age:.0f}s ago", age)


def fingerprint(section: NcclSection) -> str:
    """What the result depends on: a result measured under other settings is not reused."""
    relevant = {
        "backend": section.backend, "processes": section.processes,
        "gpu_model": section.gpu_model, "sizes": list(section.sizes),
        "iters": section.iters, "variants": list(section.variants),
        "ib_env": dict(section.ib_loopback_env), "extra_env": dict(section.extra_env),
        "thresholds": [[t.model, t.gpus, t.min_busbw_gbps, int(t.size), t.variant]
                       for t in section.thresholds],
    }
    text = json.dumps(relevant, sort_keys=True)
    import hashlib  # here, not at import: OpenSSL's load costs every prolog ~8 ms

    return hashlib.sha256(text.encode()).hexdigest()[:16]
