"""A torch.distributed.checkpoint StorageWriter over a job's node-local staging dir.

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

The save id (commit.py) is decided once, by the coordinator in
``prepare_global_plan``, and reaches every rank in its plan's ``storage_data``: each
rank's manifest records it, the coordinator's COMMIT.json too, and the other nodes'
local leaders take it from their ranks' manifests. DCP's plan caching
(``enable_plan_caching``) hands ranks an earlier save's plan, so it is refused.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    ChecksummingWriter,
    FileEntry,
    StepExists,
    begin_part,
    commit_part,
    new_save_id,
    part_dirs,
    remove_tree,
    step_name,
    write_commit_marker,
)
from slurm_resilience.checkpoint.dcp_layout import (
    DATA_FILE,
    METADATA_FILE,
    StoredPiece,
    data_relpath,
)
from slurm_resilience.checkpoint.dcp_state import Snapshot, tensor_view


@dataclass(frozen=True)
class SaveTag:
    """What the coordinator hands every rank in its plan: the step and its save id."""

    step: int
    save_id: str


def done_future(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def check_checkpoint_id(step_dir: Path, checkpoint_id: str | os.PathLike[str] | None) -> None:
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
        self.save_id = ""  # this save's id, from the coordinator's global plan

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
        check_checkpoint_id(self.step_dir, checkpoint_id)
        self._tmp, self._entries, self.save_id = None, [], ""

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
        """Coordinator: decide this save's id once; every rank gets it with its plan."""
        tag = SaveTag(self.step, new_save_id())
        return [dataclasses.replace(p, storage_data=tag) for p in plans]

    def _save_tag(self, plan: SavePlan) -> str:
        tag = plan.storage_data
        if not isinstance(tag, SaveTag) or tag.step != self.step:
            raise CheckpointError(
                f"checkpoint: dcp: save of step {self.step}: the plan carries no save id for "
                f"this step ({tag!r}); DCP's plan caching (enable_plan_caching) is not "
                "supported with this storage writer")
        return tag.save_id

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._tmp is None:
            raise CheckpointError("checkpoint: dcp: write_data before set_up_storage_writer")
        self.save_id = self._save_tag(plan)
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
            commit_part(self._tmp, self.step, self.rank, known=self._entries,
                        save_id=self.save_id)
        return done_future(results)

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
        commit_part(self._tmp, self.step, self.rank, known=[*self._entries, entry],
                    save_id=self.save_id)
        write_commit_marker(self.job_dir, self.step, len(results), self.save_id)
