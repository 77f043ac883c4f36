"""A torch.distributed.checkpoint StorageReader over a job's node-local staging dir.

Load (``dcp.load``): ``.metadata`` from ``rank-00000/``, then each rank turns its read
items into byte ranges, asks its ``RangeSource`` to make them present, and reads
them with ``pread`` from several threads straight into the destination tensors (a
piece whose destination is not a contiguous CPU tensor of the stored dtype goes
through a buffer of that piece's size, at most ``SCRATCH_BYTES`` of them at a time),
checking every manifest block they cover (``block_reads``).
"""

from __future__ import annotations

import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from slurm_resilience.checkpoint.block_reads import BlockCheck, FileReads, Run, read_threads
from slurm_resilience.checkpoint.commit import (
    MANIFEST,
    CheckpointError,
    read_manifest,
    step_name,
)
from slurm_resilience.checkpoint.dcp_layout import (
    METADATA_RELPATH,
    StoredPiece,
    element_runs,
)
from slurm_resilience.checkpoint.dcp_state import tensor_view
from slurm_resilience.checkpoint.dcp_writer import check_checkpoint_id, done_future
from slurm_resilience.checkpoint.ranges import ByteRange, LocalRanges, RangeSource, merge_ranges

SCRATCH_BYTES = 256 * 1024 * 1024  # buffers for destinations not filled in place, per batch


class StagingReader(StorageReader):
    """Reads one committed step (any world size) from the job's staging dir."""

    def __init__(self, job_dir: str | os.PathLike[str], step: int,
                 ranges: RangeSource | None = None, threads: int | None = None) -> None:
        super().__init__()
        self.job_dir = Path(job_dir)
        self.step = step
        self.step_dir = self.job_dir / step_name(step)
        self.ranges: RangeSource = ranges if ranges is not None else LocalRanges(job_dir)
        self.metadata: Metadata | None = None
        self.bytes_read = 0
        self.blocks_verified = 0
        self.threads = threads or read_threads()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        check_checkpoint_id(self.step_dir, checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return str(self.step_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        path = self.step_dir / METADATA_RELPATH
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise CheckpointError(f"checkpoint: load: step {self.step}: couldn't open "
                                  f"{METADATA_RELPATH}: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as fh:
            # Written by this run's own training processes (the agent never reads it).
            md = pickle.load(fh)  # noqa: S301
        if not isinstance(md, Metadata):
            raise CheckpointError(f"checkpoint: load: step {self.step}: {METADATA_RELPATH} "
                                  "is not DCP metadata")
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
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

    def _check(self, relpath: str) -> BlockCheck | None:
        """Checks the blocks this read covers against the file's manifest (format 2)."""
        part, _, name = relpath.rpartition("/")
        manifest = read_manifest(self.step_dir / part)
        entry = next((f for f in manifest.files if f.path == name), None)
        if entry is None:
            raise CheckpointError(f"checkpoint: load: step {self.step}: {relpath} is not in "
                                  f"{part}/{MANIFEST}")
        return BlockCheck(self.step, relpath, entry) if entry.blocks else None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.ranges.ensure(self.step, self.needed_ranges(plan))
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._piece(item).relpath, []).append(item)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read") as pool:
            for relpath, items in sorted(by_file.items()):
                check = self._check(relpath)
                path = self.step_dir / relpath
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError as exc:
                    raise CheckpointError(f"checkpoint: load: step {self.step}: couldn't open "
                                          f"{relpath}: {exc.strerror}") from None
                try:
                    reads = FileReads(fd, self.step, relpath, check, pool)
                    batch: list[_Dest] = []
                    scratch = 0
                    for item in sorted(items, key=lambda i: (self._piece(i).offset,
                                                             list(i.storage_offsets))):
                        dest = self._dest(item, planner)
                        batch.append(dest)
                        scratch += 0 if dest.direct else len(dest.view)
                        if scratch >= SCRATCH_BYTES:
                            self._read_batch(reads, batch, planner)
                            batch, scratch = [], 0
                    self._read_batch(reads, batch, planner)
                    if check is not None:
                        check.finish(fd)
                        self.blocks_verified += len(check.checked)
                finally:
                    os.close(fd)
        return done_future(None)

    def _read_batch(self, reads: FileReads, batch: list[_Dest], planner: LoadPlanner) -> None:
        """Read a batch's runs in parallel, then hand each item to the planner in order."""
        self.bytes_read += reads.read([run for dest in batch for run in dest.runs])
        for dest in batch:
            if dest.item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(dest.item, io.BytesIO(dest.buffer))
                continue
            if not dest.direct:
                dest.target.copy_(dest.buffer)
            planner.commit_tensor(dest.item, dest.target)

    def _dest(self, item: ReadItem, planner: LoadPlanner) -> _Dest:
        """Where ``item``'s bytes go, as runs of (file offset, destination bytes)."""
        import torch

        piece = self._piece(item)
        if item.type == LoadItemType.BYTE_IO:
            buf = bytearray(piece.length)
            view = memoryview(buf)
            return _Dest(item, False, None, buf, view, [Run(piece.offset, view)])
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
        buffer = target if direct else torch.empty(tuple(item.lengths), dtype=dtype)
        view = tensor_view(buffer, f"load {item.storage_index.fqn}")
        runs, pos = [], 0
        for off, n in self._runs(item, piece):
            runs.append(Run(off, view[pos:pos + n]))
            pos += n
        if pos != len(view):
            raise CheckpointError(f"checkpoint: load: step {self.step}: "
                                  f"{item.storage_index.fqn}: stored piece gives {pos} bytes, "
                                  f"the destination holds {len(view)}")
        return _Dest(item, direct, target, buffer, view, runs)


@dataclass
class _Dest:
    """One read item's destination: the planner's tensor, and the memory the bytes land in
    (the tensor itself when ``direct``, else a buffer copied into it after the read)."""

    item: ReadItem
    direct: bool
    target: Any
    buffer: Any  # keeps the memory behind ``view`` alive until the item is committed
    view: memoryview
    runs: list[Run]
