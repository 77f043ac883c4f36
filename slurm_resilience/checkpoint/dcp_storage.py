"""A torch.distributed.checkpoint StorageWriter/StorageReader over a job's staging dir.

Save (``dcp.save`` / ``dcp.async_save``, thread or process executor)::

    step-00000015/rank-00003.tmp/data.distcp   rank 3's pieces, raw bytes, CRC32C as written
    step-00000015/rank-00003/                  write_data: fsync, MANIFEST.json, rename
    step-00000015/rank-00000/.metadata         finish (coordinator): into rank 0's part,
                                               then rank 0 commits its part
    step-00000015/COMMIT.json                  finish: every rank's part is durable

Rank 0's part is committed only in ``finish``, after DCP gathered every rank's write
results, i.e. after every other part was renamed into place; so a step with
COMMIT.json always has ``.metadata`` and every manifest. On other nodes the local
leader writes its node's COMMIT.json after ``dcp.save`` returned there
(``CheckpointManager`` does it; see ``CheckpointManager.commit``).

Load (``dcp.load``): ``.metadata`` from ``rank-00000/``, then each rank turns its read
items into byte ranges, asks its ``RangeSource`` to make them present, and reads
them with ``pread`` straight into the destination tensors (a piece whose destination
is not a contiguous CPU tensor of the stored dtype goes through a buffer of that
piece's size), checking every manifest block it reads whole as the bytes arrive.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    ChecksummingWriter,
    FileEntry,
    StepExists,
    begin_part,
    commit_part,
    part_dirs,
    read_manifest,
    remove_tree,
    step_name,
    write_commit_marker,
)
from slurm_resilience.checkpoint.dcp_layout import (
    DATA_FILE,
    METADATA_FILE,
    METADATA_RELPATH,
    StoredPiece,
    data_relpath,
    element_runs,
    merge_ranges,
)
from slurm_resilience.checkpoint.dcp_state import Snapshot, tensor_view
from slurm_resilience.checkpoint.dcp_verify import BlockVerifier
from slurm_resilience.checkpoint.ranges import ByteRange, LocalRanges, RangeSource


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _check_id(step_dir: Path, checkpoint_id: str | os.PathLike[str] | None) -> None:
    if checkpoint_id is not None and Path(checkpoint_id) != step_dir:
        raise CheckpointError(f"checkpoint: dcp: checkpoint_id {checkpoint_id} is not this "
                              f"writer's step dir {step_dir}; pass only storage_writer=/"
                              "storage_reader=")


class StagingWriter(StorageWriter, AsyncStager):
    """Writes one step of a DCP checkpoint into the job's node-local staging dir.

    Used as ``dcp.save(state, storage_writer=w)`` or ``dcp.async_save(...)``. As
    ``dcp.async_save``'s stager it copies the state into the ``snapshot`` buffers it
    was given (reused between saves); without one it keeps DCP's default stager.
    """

    def __init__(self, job_dir: str | os.PathLike[str], step: int,
                 snapshot: Snapshot | None = None) -> None:
        super().__init__()
        self.job_dir = Path(job_dir)
        self.step = step
        self.step_dir = self.job_dir / step_name(step)
        self.rank = 0
        self.is_coordinator = False
        self._snapshot = snapshot
        self._tmp: Path | None = None
        self._entries: list[FileEntry] = []

    def __getstate__(self) -> dict[str, Any]:
        # The process executor pickles the writer: the staging buffers stay here.
        state = dict(self.__dict__)
        state["_snapshot"] = None
        return state

    # -- AsyncStager: dcp.async_save copies the state here before writing in the background
    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._snapshot is None:
            self._snapshot = Snapshot()
        return self._snapshot.take(state_dict)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """The buffers belong to the snapshot's owner (the CheckpointManager)."""

    # -- StorageWriter ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        _check_id(self.step_dir, checkpoint_id)
        self._tmp, self._entries = None, []

    @property
    def checkpoint_id(self) -> str:
        return str(self.step_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by path; always passed as storage_writer=

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step_dir))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError("checkpoint: dcp: save: use_collectives=False is not "
                                  "supported: the commit needs the coordinator's finish step")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))
        if (self.step_dir / COMMIT).exists():
            raise StepExists(f"checkpoint: dcp: save: step {self.step} is already committed "
                             f"in {self.step_dir}; committed steps are never overwritten")
        _tmp, final = part_dirs(self.job_dir, self.step, self.rank)
        if final.exists():
            remove_tree(final)  # an earlier attempt committed this part; the step never completed
        self._tmp = begin_part(self.job_dir, self.step, self.rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._tmp is None:
            raise CheckpointError("checkpoint: dcp: write_data before set_up_storage_writer")
        relpath = data_relpath(self.rank)
        out = ChecksummingWriter(self._tmp / DATA_FILE)
        results: list[WriteResult] = []
        try:
            # Objects first: small, and resolving them never allocates tensor copies.
            items = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
            for item in items:
                results.append(self._write_item(out, relpath, item, planner))
        finally:
            entry = out.close(fsync=True)
        self._entries = [entry]
        if not self.is_coordinator:
            commit_part(self._tmp, self.step, self.rank, known=self._entries)
        return _done(results)

    def _write_item(self, out: ChecksummingWriter, relpath: str, item: WriteItem,
                    planner: SavePlanner) -> WriteResult:
        data = planner.resolve_data(item)
        offset = out.size
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw = data.getbuffer()
            out.write(raw)
            piece = StoredPiece(relpath, offset, len(raw))
        else:
            import torch

            if not isinstance(data, torch.Tensor):
                raise CheckpointError(f"checkpoint: dcp: save: {item.index.fqn}: the planner "
                                      f"gave a {type(data).__name__}, not a tensor")
            t = data.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()  # a copy of this piece only (a transposed view, say)
            out.write(tensor_view(t, f"save {item.index.fqn}"))
            piece = StoredPiece(relpath, offset, out.size - offset, tuple(t.shape),
                                str(t.dtype).removeprefix("torch."))
        return WriteResult(index=item.index, size_in_bytes=piece.length, storage_data=piece)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: ``.metadata`` into rank 0's part, commit it, then COMMIT.json."""
        if self._tmp is None:
            raise CheckpointError("checkpoint: dcp: finish before set_up_storage_writer")
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        meta = ChecksummingWriter(self._tmp / METADATA_FILE)
        try:
            pickle.dump(metadata, meta)
        finally:
            entry = meta.close(fsync=True)
        commit_part(self._tmp, self.step, self.rank, known=[*self._entries, entry])
        write_commit_marker(self.job_dir, self.step, len(results))


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
        self.blocks_verified = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        _check_id(self.step_dir, checkpoint_id)

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

    def _verifier(self, relpath: str) -> BlockVerifier | None:
        """Checks the blocks this read covers against the file's manifest (format 2)."""
        part, _, name = relpath.rpartition("/")
        manifest = read_manifest(self.step_dir / part)
        entry = next((f for f in manifest.files if f.path == name), None)
        if entry is None:
            raise CheckpointError(f"checkpoint: load: step {self.step}: {relpath} is not in "
                                  f"{part}/{MANIFEST}")
        return BlockVerifier(self.step, relpath, entry) if entry.blocks else None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.ranges.ensure(self.step, self.needed_ranges(plan))
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._piece(item).relpath, []).append(item)
        for relpath, items in sorted(by_file.items()):
            verifier = self._verifier(relpath)
            path = self.step_dir / relpath
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise CheckpointError(f"checkpoint: load: step {self.step}: couldn't open "
                                      f"{relpath}: {exc.strerror}") from None
            try:
                # In file order, so the blocks a read covers are checked as they arrive.
                for item in sorted(items, key=lambda i: (self._piece(i).offset,
                                                         list(i.storage_offsets))):
                    self._read_item(fd, relpath, item, planner, verifier)
            finally:
                os.close(fd)
            if verifier is not None:
                self.blocks_verified += verifier.checked
        return _done(None)

    def _pread_into(self, fd: int, relpath: str, view: memoryview, offset: int,
                    verifier: BlockVerifier | None = None) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"checkpoint: load: step {self.step}: {relpath} ends "
                                      f"at byte {offset + got}, the restore needs "
                                      f"{offset + len(view)}")
            got += n
        self.bytes_read += got
        if verifier is not None:
            verifier.feed(offset, view)

    def _read_item(self, fd: int, relpath: str, item: ReadItem, planner: LoadPlanner,
                   verifier: BlockVerifier | None) -> None:
        import torch

        piece = self._piece(item)
        runs = self._runs(item, piece)
        if item.type == LoadItemType.BYTE_IO:
            buf = bytearray(piece.length)
            self._pread_into(fd, relpath, memoryview(buf), piece.offset, verifier)
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
            self._pread_into(fd, relpath, view[pos:pos + n], off, verifier)
            pos += n
        if pos != len(view):
            raise CheckpointError(f"checkpoint: load: step {self.step}: "
                                  f"{item.storage_index.fqn}: stored piece gives {pos} bytes, "
                                  f"the destination holds {len(view)}")
        if not direct:
            target.copy_(dest)
        planner.commit_tensor(item, target)

