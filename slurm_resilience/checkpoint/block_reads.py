"""Reading byte runs of one checkpoint file into memory in parallel, every block checked.

A restore reads pieces of a file straight into destination tensors. The runs are cut
into tasks (at most ``TASK_BYTES``, cut at block boundaries) that threads read with
``pread``; ``pread`` and the CRC32C both release the GIL, so on a node with several
cores the read runs at the speed of the page cache or the disk. Each block of the file
a task reads from its first to its last byte is checked against the manifest's CRC32C
as it lands (the bytes are still in cache). A block that the runs cover only in
pieces (a tensor that starts or ends inside it, or resharding) is checked at the end:
it is read again whole into a scratch buffer and checked, and the CRC32C of each piece
that went into a destination must match the same bytes of that verified block. So
every byte the restore hands out comes from a block whose CRC32C matched.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from slurm_resilience.checkpoint.commit import CheckpointError, CorruptStep, FileEntry
from slurm_resilience.checkpoint.crc import address_of, crc32c_at, crc32c_extend, crc_hex

TASK_BYTES = 8 * 1024 * 1024  # one thread's share at a time: big enough to amortise Python
READ_BYTES = 256 * 1024  # one pread, then its block is checked while still in cache


def read_threads() -> int:
    """Threads a restore reads with: one per core, at least 4 (reads from a disk overlap
    even on few cores), at most 8."""
    return max(4, min(8, os.cpu_count() or 4))


@dataclass(frozen=True)
class Run:
    """``len(view)`` bytes of the file at ``offset`` go into ``view``."""

    offset: int
    view: memoryview


class BlockCheck:
    """Checks the blocks of one file that a restore reads; thread-safe."""

    def __init__(self, step: int, relpath: str, entry: FileEntry) -> None:
        self.step, self.relpath, self.entry = step, relpath, entry
        self.checked: set[int] = set()
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}  # block -> (at, n, crc)
        self._lock = threading.Lock()
        self._want = [int(b, 16) for b in entry.blocks]

    def span(self, index: int) -> tuple[int, int]:
        """(offset, length) of block ``index``."""
        bs = self.entry.block_size
        return index * bs, min(bs, self.entry.size - index * bs)

    def piece(self, offset: int, view: memoryview) -> None:
        """Bytes ``view`` read at ``offset``."""
        self.landed(offset, address_of(view), len(view))

    def landed(self, offset: int, address: int, length: int) -> None:
        """``length`` bytes of the file from ``offset`` are now at ``address``: check each
        block they hold whole, keep the CRC32C of each piece of a block for ``finish``."""
        bs, size, want = self.entry.block_size, self.entry.size, self._want
        pos, end = offset, offset + length
        while pos < end:
            index = pos // bs
            start = index * bs
            stop = min(start + bs, size)
            cut = min(end, stop)
            crc = crc32c_at(0, address + pos - offset, cut - pos)
            if pos == start and cut == stop:
                if index >= len(want) or crc != want[index]:
                    self._compare(index, crc)
                self.checked.add(index)  # one set.add: atomic under the GIL
            else:
                with self._lock:
                    self._pieces.setdefault(index, []).append((pos - start, cut - pos, crc))
            pos = cut

    def finish(self, fd: int) -> None:
        """Check each block read only in pieces: read it whole, check it, then each piece."""
        for index, pieces in sorted(self._pieces.items()):
            start, length = self.span(index)
            block = bytearray(length)
            pread_full(fd, memoryview(block), start, self.step, self.relpath)
            view = memoryview(block)
            self._compare(index, crc32c_extend(0, view))
            for at, n, crc in pieces:
                if crc32c_extend(0, view[at:at + n]) != crc:
                    raise CorruptStep(
                        f"checkpoint: load: step {self.step}: {self.relpath} bytes "
                        f"{start + at}-{start + at + n} (in block {index}) changed between "
                        f"two reads of the file: the step {CorruptStep.MARK}")
            self.checked.add(index)
        self._pieces = {}

    def _compare(self, index: int, crc: int) -> None:
        blocks = self.entry.blocks
        want = blocks[index] if index < len(blocks) else None
        if crc_hex(crc) != want:
            start, length = self.span(index)
            raise CorruptStep(
                f"checkpoint: load: step {self.step}: {self.relpath} bytes {start}-"
                f"{start + length} (block {index}) have CRC32C {crc_hex(crc)}, the manifest "
                f"says {want}: the step {CorruptStep.MARK}")


def pread_full(fd: int, view: memoryview, offset: int, step: int, relpath: str) -> None:
    """Fill ``view`` from ``offset``; a file that ends early raises naming the bytes."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"checkpoint: load: step {step}: {relpath} ends at byte "
                                  f"{offset + got}, the restore needs {offset + len(view)}")
        got += n


def tasks(runs: Iterable[Run], block_size: int) -> list[Run]:
    """The runs cut into tasks of at most ``TASK_BYTES``, cut at block boundaries."""
    step = max(block_size, TASK_BYTES // block_size * block_size)
    out = []
    for run in runs:
        pos, end = run.offset, run.offset + len(run.view)
        while pos < end:
            cut = min(end, (pos // step + 1) * step)
            out.append(Run(pos, run.view[pos - run.offset:cut - run.offset]))
            pos = cut
    return out


class FileReads:
    """Reads runs of one open file with a thread pool, feeding ``check`` (if any)."""

    def __init__(self, fd: int, step: int, relpath: str, check: BlockCheck | None,
                 pool: ThreadPoolExecutor) -> None:
        self.fd, self.step, self.relpath, self.check, self.pool = fd, step, relpath, check, pool
        self.block_size = check.entry.block_size if check is not None else READ_BYTES

    def read(self, runs: list[Run]) -> int:
        """Read every run (in parallel); the bytes read. The first failure is raised."""
        work = tasks(runs, self.block_size)
        futures: list[Future[None]] = [self.pool.submit(self._task, t) for t in work]
        try:
            for fut in futures:
                fut.result()
        finally:
            for fut in futures:
                fut.cancel()
            for fut in futures:  # none may still write into a destination after we return
                if not fut.cancelled():
                    fut.exception()
        return sum(len(t.view) for t in work)

    def _task(self, task: Run) -> None:
        view, offset, bs = task.view, task.offset, self.block_size
        address = address_of(view) if self.check is not None else 0
        pos = 0
        while pos < len(view):
            at = offset + pos
            # One pread of up to READ_BYTES, ending on a block boundary where it can; its
            # blocks are checked right away, while the bytes are still in cache.
            end = min(len(view), pos + max(READ_BYTES // bs, 1) * bs - at % bs)
            pread_full(self.fd, view[pos:end], at, self.step, self.relpath)
            if self.check is not None:
                self.check.landed(at, address + pos, end - pos)
            pos = end
