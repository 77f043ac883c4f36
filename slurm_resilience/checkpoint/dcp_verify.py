"""Checking the bytes a restore reads against the manifest's block CRC32Cs, in the same pass.

A restore reads pieces of a file into destination tensors. Each 1 MiB block of the file
that the reads cover from its first to its last byte, in order, is checked against its
CRC32C as the bytes arrive (the CRC runs over the destination memory, still in cache),
so verification costs no second read. Blocks a restore reads only part of (resharding
across a block) are not checked here: the agent checks whole blocks when it fetches them.
"""

from __future__ import annotations

from slurm_resilience.checkpoint.commit import CorruptStep, FileEntry
from slurm_resilience.checkpoint.crc import crc32c_extend, crc_hex


class BlockVerifier:
    """Feed ``(file offset, bytes)`` segments in read order; raises on a block mismatch."""

    def __init__(self, step: int, relpath: str, entry: FileEntry) -> None:
        self.step, self.relpath, self.entry = step, relpath, entry
        self.block = -1  # the block being checked, -1: none
        self.crc = 0
        self.next = -1  # the file offset the block's check expects next
        self.checked = 0

    def feed(self, offset: int, data: memoryview) -> None:
        bs, size = self.entry.block_size, self.entry.size
        view = data.cast("B")
        while len(view):
            if offset != self.next:
                self.block = -1
                if offset % bs == 0:  # a block starts here: check it if read through
                    self.block, self.crc, self.next = offset // bs, 0, offset
            end = min(size, (offset // bs + 1) * bs)
            take = min(len(view), end - offset)
            if self.block >= 0:
                self.crc = crc32c_extend(self.crc, view[:take])
                self.next = offset + take
                if self.next == end:
                    self._compare(end)
            offset += take
            view = view[take:]

    def _compare(self, end: int) -> None:
        i = self.block
        want = self.entry.blocks[i] if i < len(self.entry.blocks) else None
        if crc_hex(self.crc) != want:
            bs = self.entry.block_size
            raise CorruptStep(
                f"checkpoint: load: step {self.step}: {self.relpath} bytes {i * bs}-{end} "
                f"(block {i}) have CRC32C {crc_hex(self.crc)}, the manifest says {want}: "
                f"the step {CorruptStep.MARK}")
        self.checked += 1
        self.block, self.next = -1, end
