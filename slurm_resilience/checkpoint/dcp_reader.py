"""A torch.distributed.checkpoint StorageReader over a job's node-local staging dir.

Load (``dcp.load``): ``.metadata`` from ``rank-00000/``, checked against rank 0's
manifest before it is unpickled; then each rank turns its load plan into byte ranges
and, while DCP is still planning (``prepare_local_plan``, whose failures DCP gathers
from every rank before any rank reads), asks its ``RangeSource`` to make them present
and verified: every manifest block the ranges touch is checked. Only then does any
rank read, with ``pread`` straight into the destination tensors (a piece whose
destination is not a contiguous CPU tensor of the stored dtype goes through a buffer
of that piece's size). A step that does not verify leaves the caller's state as it was.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from slurm_resilience.checkpoint.commit import CheckpointError, step_name
from slurm_resilience.checkpoint.dcp_layout import (
    METADATA_RELPATH,
    StoredPiece,
    element_runs,
)
from slurm_resilience.checkpoint.dcp_state import tensor_view
from slurm_resilience.checkpoint.dcp_verify import StepManifests, check_bytes, read_whole
from slurm_resilience.checkpoint.dcp_writer import check_checkpoint_id, done_future
from slurm_resilience.checkpoint.ranges import ByteRange, LocalRanges, RangeSource, merge_ranges


class StagingReader(StorageReader):
    """Reads one committed step (any world size) from the job's staging dir."""

    def __init__(self, job_dir: str | os.PathLike[str], step: int,
                 ranges: RangeSource | None = None) -> None:
        super().__init__()
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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        needed = self.needed_ranges(plan)
        if needed != self.ensured:  # a plan DCP changed after planning (never seen)
            self.ranges.ensure(self.step, needed)
        self.reading = True
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._piece(item).relpath, []).append(item)
        for relpath, items in sorted(by_file.items()):
            path = self.step_dir / relpath
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise CheckpointError(f"checkpoint: load: step {self.step}: couldn't open "
                                      f"{relpath}: {exc.strerror}") from None
            try:
                for item in sorted(items, key=lambda i: (self._piece(i).offset,
                                                         list(i.storage_offsets))):
                    self._read_item(fd, relpath, item, planner)
            finally:
                os.close(fd)
        return done_future(None)

    def _pread_into(self, fd: int, relpath: str, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"checkpoint: load: step {self.step}: {relpath} ends "
                                      f"at byte {offset + got}, the restore needs "
                                      f"{offset + len(view)}")
            got += n
        self.bytes_read += got

    def _read_item(self, fd: int, relpath: str, item: ReadItem, planner: LoadPlanner) -> None:
        import torch

        piece = self._piece(item)
        runs = self._runs(item, piece)
        if item.type == LoadItemType.BYTE_IO:
            buf = bytearray(piece.length)
            self._pread_into(fd, relpath, memoryview(buf), piece.offset)
            planner.load_bytes(item, io.BytesIO(buf))
            return
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
        pos = 0
        for off, n in runs:
            self._pread_into(fd, relpath, view[pos:pos + n], off)
            pos += n
        if pos != len(view):
            raise CheckpointError(f"checkpoint: load: step {self.step}: "
                                  f"{item.storage_index.fqn}: stored piece gives {pos} bytes, "
                                  f"the destination holds {len(view)}")
        if not direct:
            target.copy_(dest)
        planner.commit_tensor(item, target)
