"""What a restoring rank needs from a step, as byte ranges of the step's files.

The training side plans a restore (with resharding, DCP's load plan names the
pieces of other ranks' files each rank reads) and asks a ``RangeSource`` to make
exactly those bytes present and verified in the node's staging dir before it
reads them. ``LocalRanges`` serves a step whose files are all on this node (and
checks every block the ranges touch); the agent-backed source fetches the missing
ranges from S3 (ranged GETs, checked by the manifests' block CRC32Cs) and checks
the blocks already on the node. Either way every block a restore reads is verified
before the restore writes anything into the caller's tensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slurm_resilience.checkpoint.commit import CheckpointError, check_relpath, step_name
from slurm_resilience.checkpoint.dcp_verify import (
    BlockVerifier,
    StepManifests,
    corrupt,
    covered_blocks,
)


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
    """Every file of the step is already in ``job_dir``: check, before anything is read,
    the marker, the manifests and every manifest block the ranges touch, whole or in
    part (``dcp_verify.py``); a mismatch raises ``CorruptStep``."""

    def __init__(self, job_dir: str | os.PathLike[str]) -> None:
        self.job_dir = Path(job_dir)
        self.blocks_checked = 0

    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        step_dir = self.job_dir / step_name(step)
        manifests = StepManifests.open(step_dir, step)
        by_file: dict[str, list[tuple[int, int]]] = {}
        for r in ranges:
            by_file.setdefault(r.relpath, []).append((r.offset, r.length))
        fds: list[int] = []
        try:
            files = []
            for relpath, spans in sorted(by_file.items()):
                entry = manifests.entry(relpath)
                indices = covered_blocks(entry, spans, step, relpath)
                try:
                    fd = os.open(step_dir / relpath, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError as exc:
                    raise CheckpointError(f"checkpoint: load: step {step}: {relpath} is not "
                                          f"on this node ({exc.strerror})") from None
                fds.append(fd)
                size = os.fstat(fd).st_size
                if size != entry.size:
                    raise corrupt(step, f"{relpath} holds {size} bytes, its manifest says "
                                        f"{entry.size}")
                files.append((fd, relpath, entry, indices))
            verifier = BlockVerifier(step)
            verifier.verify(files)
            self.blocks_checked += verifier.blocks_checked
        finally:
            for fd in fds:
                os.close(fd)
