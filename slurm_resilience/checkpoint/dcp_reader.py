"""A torch.distributed.checkpoint StorageReader over a job's node-local staging dir.

Load (``dcp.load``): ``.metadata`` from ``rank-00000/``, checked against rank 0's
manifest before it is unpickled; then each rank turns its load plan into byte ranges
and, while DCP is still planning (``prepare_local_plan``, whose failures DCP gathers
from every rank before any rank reads), asks its ``RangeSource`` to make them present
and verified: every manifest block the ranges touch is checked. Only then does any
rank read, with ``pread`` straight into the destination tensors (a piece whose
destination is not a contiguous CPU tensor of the stored dtype goes through a buffer
of that piece's size). A step that does not verify leaves the caller's state as it was.

The reads run on a bounded pool of threads (``io_threads``), in tasks of about
``READ_CHUNK`` bytes; pieces are handed to DCP's planner in plan order on the calling
thread as their reads finish, and buffered pieces in flight hold at most about
``STAGING_LIMIT`` bytes. No read is left running when ``read_data`` returns or raises.
"""

from __future__ import annotations

import io
import os
import pickle
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from slurm_resilience.checkpoint.commit import CheckpointError, step_name
from slurm_resilience.checkpoint.dcp_layout import (
    METADATA_RELPATH,
    StoredPiece,
    element_runs,
)
from slurm_resilience.checkpoint.dcp_state import tensor_view
from slurm_resilience.checkpoint.dcp_verify import (
    StepManifests,
    check_bytes,
    io_threads,
    read_whole,
)
from slurm_resilience.checkpoint.dcp_writer import check_checkpoint_id, done_future
from slurm_resilience.checkpoint.ranges import ByteRange, LocalRanges, RangeSource, merge_ranges

READ_CHUNK = 8 * 1024 * 1024  # bytes one read task takes (big runs split, small ones packed)
STAGING_LIMIT = 256 * 1024 * 1024  # bytes of buffers (pieces not read in place) held at once


class StagingReader(StorageReader):
    """Reads one committed step (any world size) from the job's staging dir."""

    def __init__(self, job_dir: str | os.PathLike[str], step: int,
                 ranges: RangeSource | None = None, *, threads: int | None = None,
                 read_chunk: int | None = None, staging_limit: int | None = None) -> None:
        super().__init__()
        self.threads = threads or io_threads()
        self.read_chunk = read_chunk or READ_CHUNK
        self.staging_limit = STAGING_LIMIT if staging_limit is None else staging_limit
        self.job_dir = Path(job_dir)
        self.step = step
        self.step_dir = self.job_dir / step_name(step)
        self.ranges: RangeSource = ranges if ranges is not None else LocalRanges(job_dir)
        self.metadata: Metadata | None = None
        self.bytes_read = 0
        self.ensured: list[ByteRange] = []
        self.reading = False  # set once read_data starts filling the destination

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        check_checkpoint_id(self.step_dir, checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return str(self.step_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        data = read_whole(self.step_dir / METADATA_RELPATH, self.step, METADATA_RELPATH)
        entry = StepManifests.open(self.step_dir, self.step).entry(METADATA_RELPATH)
        check_bytes(data, entry, self.step, METADATA_RELPATH)
        # Written by this run's own training processes (the agent never unpickles it).
        md = pickle.loads(data)  # noqa: S301
        if not isinstance(md, Metadata):
            raise CheckpointError(f"checkpoint: load: step {self.step}: {METADATA_RELPATH} "
                                  "is not DCP metadata")
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Verified while DCP plans: a failure on any rank stops every rank before a read.
        self.ensured = self.needed_ranges(plan)
        self.ranges.ensure(self.step, self.ensured)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _piece(self, item: ReadItem) -> StoredPiece:
        assert self.metadata is not None
        piece = self.metadata.storage_data.get(item.storage_index)
        if not isinstance(piece, StoredPiece):
            raise CheckpointError(f"checkpoint: load: step {self.step}: no stored piece for "
                                  f"{item.storage_index.fqn} (not written by this writer?)")
        return piece

    def _runs(self, item: ReadItem, piece: StoredPiece) -> list[tuple[int, int]]:
        """Byte runs (file offset, length) of ``item``, in the order they fill its box."""
        if item.type == LoadItemType.BYTE_IO or piece.shape is None:
            return [(piece.offset, piece.length)]
        numel = 1
        for n in piece.shape:
            numel *= n
        elsize = piece.length // numel if numel else 0
        return [(piece.offset + start * elsize, count * elsize)
                for start, count in element_runs(piece.shape, item.storage_offsets,
                                                 item.lengths)]

    def needed_ranges(self, plan: LoadPlan) -> list[ByteRange]:
        """The bytes of the step's files this plan reads, merged."""
        out = []
        for item in plan.items:
            piece = self._piece(item)
            out += [ByteRange(piece.relpath, off, n) for off, n in self._runs(item, piece)]
        return merge_ranges(out)

    def _order(self, item: ReadItem) -> tuple[str, int, list[int]]:
        piece = self._piece(item)
        return piece.relpath, piece.offset, list(item.storage_offsets)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        needed = self.needed_ranges(plan)
        if needed != self.ensured:  # a plan DCP changed after planning (never seen)
            self.ranges.ensure(self.step, needed)
        self.reading = True
        reads = ParallelReads(self.step, self.step_dir, self.threads, self.read_chunk)
        try:
            pending: deque[_Pending] = deque()
            staged = 0
            for item in sorted(plan.items, key=self._order):
                pending.append(self._start(item, planner, reads))
                staged += pending[-1].staged
                while staged > self.staging_limit and len(pending) > 1:
                    staged -= pending[0].staged
                    self._finish(pending.popleft(), planner, reads)
            while pending:
                self._finish(pending.popleft(), planner, reads)
        finally:
            reads.close()  # waits for (or cancels) every read: none runs on after this
            self.bytes_read += reads.bytes_read
        return done_future(None)

    def _start(self, item: ReadItem, planner: LoadPlanner, reads: ParallelReads) -> _Pending:
        """Queue the reads of ``item`` into its destination (or a buffer of its size)."""
        import torch

        piece = self._piece(item)
        if item.type == LoadItemType.BYTE_IO:
            buf = bytearray(piece.length)
            seq = reads.add(piece.relpath, memoryview(buf), piece.offset)
            return _Pending(item, None, buf, seq, len(buf))
        runs = self._runs(item, piece)
        dtype = getattr(torch, str(piece.dtype), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"checkpoint: load: step {self.step}: unknown dtype "
                                  f"{piece.dtype!r} for {item.storage_index.fqn}")
        target = planner.resolve_tensor(item).detach()
        direct = (type(target) is torch.Tensor and target.device.type == "cpu"
                  and target.dtype == dtype and target.is_contiguous()
                  and target.layout == torch.strided)
        # A contiguous CPU destination of the stored dtype is filled in place; anything
        # else (a strided view, another dtype or device) through a buffer of this piece.
        dest = target if direct else torch.empty(tuple(item.lengths), dtype=dtype)
        view = tensor_view(dest, f"load {item.storage_index.fqn}")
        total = sum(n for _, n in runs)
        if total != len(view):
            raise CheckpointError(f"checkpoint: load: step {self.step}: "
                                  f"{item.storage_index.fqn}: stored piece gives {total} "
                                  f"bytes, the destination holds {len(view)}")
        seq, pos = -1, 0
        for off, n in runs:
            seq = max(seq, reads.add(piece.relpath, view[pos:pos + n], off))
            pos += n
        return _Pending(item, target, None if direct else dest, seq,
                        0 if direct else len(view))

    def _finish(self, p: _Pending, planner: LoadPlanner, reads: ParallelReads) -> None:
        """Once ``p``'s reads are done: hand it to the planner (in plan order, this thread)."""
        reads.wait(p.seq)
        if p.target is None:
            assert isinstance(p.buffer, bytearray)
            planner.load_bytes(p.item, io.BytesIO(p.buffer))
            return
        if p.buffer is not None:
            p.target.copy_(p.buffer)
        planner.commit_tensor(p.item, p.target)


@dataclass
class _Pending:
    """A read item whose reads are queued: done once batch ``seq`` and all before it are."""

    item: ReadItem
    target: Any  # the destination tensor; None for bytes
    buffer: Any  # the tensor or bytearray read into when not the target itself
    seq: int
    staged: int  # bytes of buffer held until the item is finished


_Run = tuple[int, str, memoryview, int]  # fd, relpath, destination, file offset


class ParallelReads:
    """``pread`` into destination views on a bounded pool of threads, in batches of about
    ``chunk`` bytes (a large run split, small ones packed), numbered in the order queued."""

    def __init__(self, step: int, step_dir: Path, threads: int, chunk: int) -> None:
        self.step, self.step_dir, self.chunk = step, step_dir, chunk
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-read")
        self.fds: dict[str, int] = {}
        self.futures: list[Future[int]] = []
        self.batch: list[_Run] = []
        self.batch_bytes = 0
        self.waited = 0  # batches before this one are done and counted
        self.bytes_read = 0

    def _fd(self, relpath: str) -> int:
        if relpath not in self.fds:
            try:
                self.fds[relpath] = os.open(self.step_dir / relpath, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise CheckpointError(f"checkpoint: load: step {self.step}: couldn't open "
                                      f"{relpath}: {exc.strerror}") from None
        return self.fds[relpath]

    def add(self, relpath: str, view: memoryview, offset: int) -> int:
        """Queue reading ``len(view)`` bytes at ``offset``; the number of the last batch
        that holds a part of it (-1 for nothing to read)."""
        fd, seq = self._fd(relpath), -1
        for at in range(0, len(view), self.chunk):
            part = view[at:at + self.chunk]
            self.batch.append((fd, relpath, part, offset + at))
            self.batch_bytes += len(part)
            seq = len(self.futures)
            if self.batch_bytes >= self.chunk:
                self._flush()
        return seq

    def _flush(self) -> None:
        if self.batch:
            self.futures.append(self.pool.submit(self._read, self.batch))
            self.batch, self.batch_bytes = [], 0

    def wait(self, seq: int) -> None:
        """Return once batches up to ``seq`` are read; raises the first read's failure."""
        if seq >= len(self.futures):
            self._flush()
        while self.waited <= seq:
            self.bytes_read += self.futures[self.waited].result()
            self.waited += 1

    def _read(self, runs: list[_Run]) -> int:
        total = 0
        for fd, relpath, view, offset in runs:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n <= 0:
                    raise CheckpointError(f"checkpoint: load: step {self.step}: {relpath} "
                                          f"ends at byte {offset + got}, the restore needs "
                                          f"{offset + len(view)}")
                got += n
            total += got
        return total

    def close(self) -> None:
        """Cancel what has not started, wait for what has, close the files."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
