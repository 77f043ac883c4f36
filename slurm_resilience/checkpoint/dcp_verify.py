"""Checking the bytes a restore will read against the step's manifests, before it reads them.

A restore of a step in the node's staging dir verifies everything it is about to use
before DCP writes a single byte into the caller's tensors: the commit marker, each
manifest it needs (well-formed, of this step and rank, of the marker's save, and with
block CRC32Cs that add up to the file's), ``.metadata`` (its bytes, read once, are
checked and then unpickled), and every manifest block that a read touches, whole or
in part, the last short block included. A file listed without block CRC32Cs (format 1)
is one block, checked whole. Anything that does not match raises ``CorruptStep``.

The blocks are checked in parallel threads through a read-only mapping of the file (the
CRC32C reads the page cache, no copy); the restore then reads the same bytes, from the
page cache, straight into the destination tensors. So a failed verification leaves the
caller's state untouched, at the cost of one CRC32C pass over the bytes and no extra
memory (the same work the old in-read check did over the destination).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.checkpoint.blocks import block_span, covering
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CommitMarker,
    CorruptStep,
    FileEntry,
    Manifest,
    parse_rank,
    step_name,
)
from slurm_resilience.checkpoint.crc import crc32c_extend, crc_hex
from slurm_resilience.checkpoint.crc_combine import combine_parts

RUN_BYTES = 16 * 1024 * 1024  # bytes one verify task maps (whole blocks, at least one)
SMALL_LIMIT = 1024**3  # the most a marker, manifest or .metadata may be


def io_threads() -> int:
    """Threads for a restore's verify and read passes: twice the CPUs, at most 8. Both are
    memory-bound copies or CRC32C passes over the page cache, and more in flight than
    cores keeps memory busy (on 2 cores: 4 threads check 1 GiB in 0.7x the time of 2)."""
    return min(8, 2 * (os.cpu_count() or 1))


def corrupt(step: int, what: str, phase: str = "load") -> CorruptStep:
    return CorruptStep(f"checkpoint: {phase}: step {step}: {what}: the step {CorruptStep.MARK}")


def read_whole(path: Path, step: int, relpath: str) -> bytes:
    """A small file of the step (never through a link); a missing one is not corruption."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CheckpointError(f"checkpoint: load: step {step}: couldn't open {relpath}: "
                              f"{exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size > SMALL_LIMIT:
            raise corrupt(step, f"{relpath} is {size} bytes, more than {SMALL_LIMIT}")
        data = bytearray()
        while len(data) < size:
            chunk = os.pread(fd, size - len(data), len(data))
            if not chunk:
                break
            data += chunk
        return bytes(data)
    finally:
        os.close(fd)


def read_marker_checked(step_dir: Path, step: int) -> CommitMarker:
    data = read_whole(step_dir / COMMIT, step, COMMIT)
    try:
        marker = CommitMarker.from_json(data, f"{step_name(step)}/{COMMIT}")
    except CheckpointError as exc:
        raise corrupt(step, str(exc)) from None
    if marker.step != step:
        raise corrupt(step, f"{COMMIT} says step {marker.step}")
    return marker


def checked_entry(entry: FileEntry, step: int, relpath: str, phase: str = "load"
                  ) -> FileEntry:
    """``entry`` when its block CRC32Cs add up to its whole-file CRC32C (so a flipped bit
    in either shows, whichever of them a reader checks the bytes against)."""
    if not entry.blocks:
        return entry
    try:
        parts = [(int(b, 16), block_span(i, entry.size, entry.block_size)[1])
                 for i, b in enumerate(entry.blocks)]
    except ValueError as exc:
        raise corrupt(step, f"{relpath}: its manifest entry is not valid ({exc})",
                      phase) from None
    if crc_hex(combine_parts(parts)) != entry.crc32c:
        raise corrupt(step, f"{relpath}: its manifest's block CRC32Cs do not add up to its "
                            f"CRC32C {entry.crc32c}", phase)
    return entry


def check_manifest(m: Manifest, where: str) -> Manifest:
    """``m`` when every entry's block CRC32Cs add up to the file's CRC32C."""
    for f in m.files:
        checked_entry(f, m.step, f"{where}/{f.path}", "manifest")
    return m


@dataclass
class StepManifests:
    """A step's marker and the manifests of the rank parts read so far, each checked once."""

    step: int
    step_dir: Path
    marker: CommitMarker
    parts: dict[int, Manifest]

    @classmethod
    def open(cls, step_dir: Path, step: int) -> StepManifests:
        return cls(step, step_dir, read_marker_checked(step_dir, step), {})

    def entry(self, relpath: str) -> FileEntry:
        """The checked manifest entry of ``rank-R/name``."""
        part, _, name = relpath.partition("/")
        rank = parse_rank(part)
        if rank is None or rank >= self.marker.world_size:
            raise corrupt(self.step, f"{relpath} is not in a rank part of the step "
                                     f"(world size {self.marker.world_size})")
        if rank not in self.parts:
            self.parts[rank] = self._manifest(part, rank)
        found = next((f for f in self.parts[rank].files if f.path == name), None)
        if found is None:
            raise corrupt(self.step, f"{relpath} is not in {part}/{MANIFEST}")
        return checked_entry(found, self.step, relpath)

    def _manifest(self, part: str, rank: int) -> Manifest:
        rel = f"{part}/{MANIFEST}"
        data = read_whole(self.step_dir / rel, self.step, rel)
        try:
            m = Manifest.from_json(data, f"{step_name(self.step)}/{rel}")
        except CheckpointError as exc:
            raise corrupt(self.step, str(exc)) from None
        if (m.step, m.rank) != (self.step, rank):
            raise corrupt(self.step, f"{rel} says step {m.step} rank {m.rank}")
        if m.save_id != self.marker.save_id:
            raise corrupt(self.step, f"{rel} is of save {m.save_id or '(none)'}, {COMMIT} of "
                                     f"save {self.marker.save_id or '(none)'}")
        return m


def check_bytes(data: bytes, entry: FileEntry, step: int, relpath: str) -> bytes:
    """``data`` when it is the whole file ``entry`` describes (size, every block)."""
    if len(data) != entry.size:
        raise corrupt(step, f"{relpath} is {len(data)} bytes, the manifest says {entry.size}")
    view = memoryview(data)
    for i, crc, start, end in block_spans(entry):
        got = crc_hex(crc32c_extend(0, view[start:end]))
        if got != crc:
            raise _mismatch(step, relpath, i, start, end, got, crc)
    return data


def _count(entry: FileEntry) -> int:
    return len(entry.blocks) if entry.blocks else int(entry.size > 0)


def block_spans(entry: FileEntry) -> list[tuple[int, str, int, int]]:
    """What an entry vouches for: (index, CRC32C, start, end) of each of its blocks."""
    return _blocks(entry, range(_count(entry)))


def _blocks(entry: FileEntry, indices: Sequence[int]) -> list[tuple[int, str, int, int]]:
    """(index, expected CRC32C, start, end) of blocks; a file without block CRC32Cs is one."""
    if not entry.blocks:
        return [(0, entry.crc32c, 0, entry.size)] if entry.size and list(indices) else []
    out = []
    for i in indices:
        start, length = block_span(i, entry.size, entry.block_size)
        out.append((i, entry.blocks[i], start, start + length))
    return out


def _mismatch(step: int, relpath: str, i: int, start: int, end: int, got: str, want: str
              ) -> CorruptStep:
    return corrupt(step, f"{relpath} bytes {start}-{end} (block {i}) have CRC32C {got}, the "
                         f"manifest says {want}")


@dataclass(frozen=True)
class _Task:
    fd: int
    relpath: str
    blocks: list[tuple[int, str, int, int]]


class BlockVerifier:
    """Verifies whole manifest blocks of a step's files in parallel threads."""

    def __init__(self, step: int, threads: int | None = None) -> None:
        self.step = step
        self.threads = threads or io_threads()
        self.blocks_checked = 0
        self.bytes_checked = 0

    def verify(self, files: Sequence[tuple[int, str, FileEntry, Sequence[int]]]) -> None:
        """Check blocks ``indices`` of each ``(fd, relpath, entry, indices)``; raises the
        first mismatch (in file order) as CorruptStep, a file that can't be mapped as a
        CheckpointError."""
        tasks: list[_Task] = []
        for fd, relpath, entry, indices in files:
            blocks = _blocks(entry, sorted(set(indices)))
            run: list[tuple[int, str, int, int]] = []
            for b in blocks:
                # A run: consecutive blocks up to RUN_BYTES, checked through one mapping.
                if run and (b[2] != run[-1][3] or b[3] - run[0][2] > RUN_BYTES):
                    tasks.append(_Task(fd, relpath, run))
                    run = []
                run.append(b)
            if run:
                tasks.append(_Task(fd, relpath, run))
        if not tasks:
            return
        total = sum(t.blocks[-1][3] - t.blocks[0][2] for t in tasks)
        if len(tasks) == 1 or self.threads == 1 or total <= RUN_BYTES:  # not worth threads
            errors = [self._check(t) for t in tasks]
        else:
            with ThreadPoolExecutor(min(self.threads, len(tasks)),
                                    thread_name_prefix="ckpt-verify") as pool:
                errors = list(pool.map(self._check, tasks))
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        self.blocks_checked += sum(len(t.blocks) for t in tasks)
        self.bytes_checked += total

    def _check(self, task: _Task) -> CheckpointError | None:
        first, last = task.blocks[0][2], task.blocks[-1][3]
        first -= first % mmap.ALLOCATIONGRANULARITY  # where a mapping may start
        # A read-only mapping: the CRC32C reads the page cache itself, with no copy.
        try:
            mm = mmap.mmap(task.fd, last - first, prot=mmap.PROT_READ, offset=first)
        except (OSError, ValueError) as exc:  # not the bytes' fault: no fallback
            return CheckpointError(f"checkpoint: load: step {self.step}: couldn't map "
                                   f"{task.relpath} bytes {first}-{last} to check them: {exc}")
        try:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)
            try:
                for i, want, start, end in task.blocks:
                    crc = crc_hex(crc32c_extend(0, view[start - first:end - first]))
                    if crc != want:
                        return _mismatch(self.step, task.relpath, i, start, end, crc, want)
            finally:
                view.release()
        finally:
            mm.close()
        return None


def covered_blocks(entry: FileEntry, ranges: Sequence[tuple[int, int]], step: int,
                   relpath: str) -> list[int]:
    """Every block of ``entry`` that one of the (offset, length) ranges touches."""
    out: set[int] = set()
    bs = entry.block_size if entry.blocks else max(entry.size, 1)
    for offset, length in ranges:
        try:
            out.update(covering(offset, length, entry.size, bs))
        except ValueError:
            raise corrupt(step, f"{relpath}: the restore needs bytes {offset}-"
                                f"{offset + length}, its manifest says it holds "
                                f"{entry.size}") from None
    return sorted(out)
