"""Fault injection for the NCCL gate (sandbox and tests only).

A per-node JSON file (``nccl.fault_file``) that the ranks read at start:

* ``{"kind": "wrong", "rank": 5}``: rank 5's result is off by one in one element,
  as a GPU corrupting data would make it;
* ``{"kind": "slow", "delay_s": 0.05}``: every rank sleeps before each all_reduce
  (``"rank": N`` slows only that one, which slows the collective just the same);
* ``{"kind": "hang", "rank": 0}``: that rank never enters the collective, so every
  rank blocks, as with a wedged link.

No file, or no setting, means no fault. A file that cannot be read is an error
of the test itself (the ranks exit with it), never a silent no-fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

FaultKind = Literal["wrong", "slow", "hang"]
KINDS: tuple[str, ...] = ("wrong", "slow", "hang")


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int | None = None
    delay_s: float = 0.0

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "delay_s": self.delay_s}


def parse(data: Any, source: str = "fault file") -> Fault:
    """Validate a decoded fault file."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{source}: kind {kind!r} is not one of {', '.join(KINDS)}")
    rank = data.get("rank")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise ValueError(f"{source}: rank {rank!r} is not a rank number")
    delay = data.get("delay_s", 0.0)
    if not isinstance(delay, (int, float)) or isinstance(delay, bool) or delay < 0:
        raise ValueError(f"{source}: delay_s {delay!r} is not a non-negative number")
    if kind == "slow" and delay == 0:
        delay = 0.05
    return Fault(kind, rank, float(delay))


def read(path: str) -> Fault | None:
    """The fault in ``path``; None when the path is empty or the file is absent."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as fh:
        text = fh.read(65536)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    return parse(data, path)


def write(path: str, fault: Fault | None) -> None:
    """Set (or with None, clear) the fault of a node; atomically, for ranks reading it."""
    if fault is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(fault.to_json(), fh)
    os.replace(tmp, path)


# -- sandbox fault names (`slurm-resilience sandbox inject NODE FAULT`) --------------------

SANDBOX_FAULTS = ("nccl-slow", "nccl-wrong:GPU", "nccl-hang")


def from_sandbox_name(name: str) -> Fault:
    """``nccl-slow`` / ``nccl-wrong:5`` / ``nccl-hang`` → the fault to write."""
    head, _, arg = name.partition(":")
    if head == "nccl-slow" and not arg:
        return Fault("slow", None, 0.5)
    if head == "nccl-hang" and not arg:
        return Fault("hang", 0)
    if head == "nccl-wrong" and arg.isdigit():
        return Fault("wrong", int(arg))
    raise ValueError(f"nccl fault {name!r}: expected one of {', '.join(SANDBOX_FAULTS)}")
