"""What a restoring rank needs from a step, as byte ranges of the step's files.

The training side plans a restore (with resharding, DCP's load plan names the
pieces of other ranks' files each rank reads) and asks a ``RangeSource`` to make
exactly those bytes present and verified in the node's staging dir before it
reads them. ``LocalRanges`` serves a step whose files are all on this node; the
agent-backed source fetches the missing ranges from S3 (ranged GETs, checked by
the manifests' block CRC32Cs).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slurm_resilience.checkpoint.commit import CheckpointError, check_relpath, step_name


@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes at ``offset`` of a file named relative to the step dir
    (``rank-00003/data.distcp``)."""

    relpath: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        check_relpath(self.relpath)
        if self.offset < 0 or self.length < 0:
            raise CheckpointError(f"checkpoint: range {self.relpath}@{self.offset}+{self.length}"
                                  " is negative")


def merge_ranges(ranges: Iterable[ByteRange]) -> list[ByteRange]:
    """Sorted, with overlapping or touching ranges of one file merged."""
    out: list[ByteRange] = []
    for r in sorted(ranges, key=lambda r: (r.relpath, r.offset)):
        if r.length == 0:
            continue
        last = out[-1] if out else None
        if last is not None and last.relpath == r.relpath and r.offset <= last.offset + last.length:
            end = max(last.offset + last.length, r.offset + r.length)
            out[-1] = ByteRange(last.relpath, last.offset, end - last.offset)
        else:
            out.append(r)
    return out


class RangeSource(Protocol):
    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        """Make ``ranges`` of ``step`` present and verified locally, or raise a
        CheckpointError that names the step and the cause."""


class LocalRanges:
    """Every file of the step is already in ``job_dir``: only check they hold the bytes."""

    def __init__(self, job_dir: str | os.PathLike[str]) -> None:
        self.job_dir = Path(job_dir)

    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        step_dir = self.job_dir / step_name(step)
        for r in ranges:
            try:
                size = os.stat(step_dir / r.relpath, follow_symlinks=False).st_size
            except OSError as exc:
                raise CheckpointError(f"checkpoint: load: step {step}: {r.relpath} is not on "
                                      f"this node ({exc.strerror})") from None
            if r.offset + r.length > size:
                raise CheckpointError(f"checkpoint: load: step {step}: {r.relpath} holds "
                                      f"{size} bytes, the restore needs "
                                      f"{r.offset + r.length}")
