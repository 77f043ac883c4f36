"""Per-block CRC32C of checkpoint files, so a byte range can be verified on its own.

Stage-in fetches only the ranges a node's ranks will read (with resharding, the
pieces DCP's load plan names). A whole-file CRC32C cannot check a range, so every
manifest entry also lists the CRC32C of each consecutive ``BLOCK_SIZE`` block of
the file (the last one short). A range is verified by the blocks that cover it.
"""

from __future__ import annotations

import os

from slurm_resilience.checkpoint.crc import crc32c_extend, crc_hex

BLOCK_SIZE = 256 * 1024


class BlockCrcs:
    """Streaming per-block CRC32C: feed the file's bytes in order, any chunk sizes."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block size {block_size} must be positive")
        self.block_size = block_size
        self.blocks: list[str] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.block_size - self._fill)
            self._crc = crc32c_extend(self._crc, view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == self.block_size:
                self.blocks.append(crc_hex(self._crc))
                self._crc, self._fill = 0, 0

    def finish(self) -> tuple[str, ...]:
        """The block list (a short last block included); an empty file has none."""
        out = list(self.blocks)
        if self._fill:
            out.append(crc_hex(self._crc))
        return tuple(out)


def covering(offset: int, length: int, size: int, block_size: int = BLOCK_SIZE) -> range:
    """Indices of the blocks that hold bytes ``[offset, offset + length)`` of a file of ``size``."""
    if offset < 0 or length < 0 or offset + length > size:
        raise ValueError(f"range {offset}+{length} outside a file of {size} bytes")
    if length == 0:
        return range(0)
    return range(offset // block_size, (offset + length - 1) // block_size + 1)


def block_span(index: int, size: int, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """(offset, length) of block ``index`` of a file of ``size`` bytes."""
    start = index * block_size
    if index < 0 or start >= size:
        raise ValueError(f"block {index} outside a file of {size} bytes")
    return start, min(block_size, size - start)


def bad_blocks(fd: int, size: int, expected: tuple[str, ...], indices: range | list[int],
               block_size: int = BLOCK_SIZE) -> list[int]:
    """The blocks among ``indices`` whose bytes in ``fd`` don't match ``expected``."""
    bad = []
    for i in indices:
        start, length = block_span(i, size, block_size)
        crc, pos, end = 0, start, start + length
        while pos < end:
            chunk = os.pread(fd, min(end - pos, 4 * 1024 * 1024), pos)
            if not chunk:
                break
            crc = crc32c_extend(crc, chunk)
            pos += len(chunk)
        if pos != end or i >= len(expected) or crc_hex(crc) != expected[i]:
            bad.append(i)
    return bad


def file_checksums(fd: int, block_size: int = BLOCK_SIZE) -> tuple[int, str, tuple[str, ...]]:
    """(size, whole-file CRC32C hex, per-block CRC32C) of an open file, in one read pass."""
    whole, blocks, offset = 0, BlockCrcs(block_size), 0
    while True:
        chunk = os.pread(fd, block_size, offset)
        if not chunk:
            break
        whole = crc32c_extend(whole, chunk)
        blocks.update(chunk)
        offset += len(chunk)
    return offset, crc_hex(whole), blocks.finish()
