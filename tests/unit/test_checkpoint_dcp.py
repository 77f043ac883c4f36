"""DCP checkpoints across ranks: resharding, FSDP2, async saves, kills and disagreement.

Every test runs real ranks (forked processes, gloo on CPU) through dcp_ranks.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import dcp_ranks as ranks
import pytest
import torch

from slurm_resilience.checkpoint.commit import committed_steps, read_manifest
from slurm_resilience.checkpoint.manager import CheckpointManager


def test_four_ranks_save_two_and_eight_ranks_resume_equal(tmp_path: Path) -> None:
    """Row-, column-sharded and replicated DTensors saved by 4 ranks load element-by-element
    equal with 2 and with 8 ranks; every rank's part is committed with block CRCs."""
    assert ranks.run_ranks(ranks.reshard_save, 4, tmp_path) == [0] * 4
    step = tmp_path / "job" / "step-00000003"
    assert (step / "COMMIT.json").is_file()
    for r in range(4):
        names = {f.path for f in read_manifest(step / f"rank-{r:05d}").files}
        assert names == ({"data.distcp", ".metadata"} if r == 0 else {"data.distcp"})
    assert ranks.run_ranks(ranks.reshard_load, 2, tmp_path) == [0] * 2
    assert ranks.run_ranks(ranks.reshard_load, 8, tmp_path) == [0] * 8
    # Each rank asks its RangeSource for its share of the sharded tensors plus the small
    # replicated entries, never for whole files.
    with open(step / "rank-00000" / ".metadata", "rb") as fh:
        pieces = pickle.load(fh).storage_data.values()
    sharded = sum(p.length for p in pieces if p.shape is not None and len(p.shape) == 2)
    whole = sum(p.length for p in pieces) - sharded
    for world in (2, 8):
        for r in range(world):
            asked = int((tmp_path / f"asked-{world}-{r}").read_text())
            assert sharded // world <= asked <= sharded // world * 1.1 + whole, (world, r)


def test_fsdp2_model_and_optimizer_resume_at_another_world_size(tmp_path: Path) -> None:
    """fully_shard on a CPU gloo mesh: model and Adam state saved by 2 ranks (DTensors from
    get_state_dict) come back equal on 3 ranks, and training goes on."""
    assert ranks.run_ranks(ranks.fsdp_save, 2, tmp_path) == [0] * 2
    assert ranks.run_ranks(ranks.fsdp_load, 3, tmp_path) == [0] * 3


def test_async_save_commits_only_after_writes_are_durable(tmp_path: Path) -> None:
    """dcp.async_save through storage_writer(): while the writes are held no COMMIT.json
    exists and the previous step stays newest; after them the step loads."""
    assert ranks.run_ranks(ranks.async_gated, 2, tmp_path) == [0] * 2


def test_async_save_killed_mid_write_leaves_previous_step(tmp_path: Path) -> None:
    """A rank killed halfway through an async save's write leaves step 2 uncommitted; a new
    run loads step 1."""
    assert ranks.run_ranks(ranks.async_killed, 2, tmp_path) == [3, 9]
    assert committed_steps(tmp_path / "job") == [1]
    assert (tmp_path / "job" / "step-00000002" / "rank-00001.tmp").is_dir()
    assert ranks.run_ranks(ranks.load_one, 2, tmp_path) == [0] * 2
    for r in range(2):
        assert (tmp_path / f"loaded-{r}").read_text() == "1 1.0 1.0"


@pytest.mark.slow
def test_async_save_with_process_executor(tmp_path: Path) -> None:
    """dcp.async_save with DCP's process executor: the pickled writer commits in DCP's
    checkpoint daemon, and the step loads."""
    assert ranks.run_ranks(ranks.async_process, 2, tmp_path) == [0] * 2


def test_ranks_disagreeing_on_the_step_all_raise_the_same_error(tmp_path: Path) -> None:
    """A node without any step's marker (no step committed on every node) makes every
    rank raise one identical error naming each node's newest, never a silent load."""
    assert ranks.run_ranks(ranks.disagree, 2, tmp_path) == [0] * 2
    errors = [(tmp_path / f"error-{r}").read_text() for r in range(2)]
    assert errors[0] == errors[1]
    assert "ranks disagree on the newest committed step: no step is committed on every " \
           "node (newest: step 2 for rank 0 on" in errors[0]
    assert "none for rank 1 on" in errors[0]


def test_storage_writer_and_reader_with_plain_dcp(tmp_path: Path) -> None:
    """A DCP user's own dcp.save/dcp.load with storage_writer()/commit() and
    latest_step()/storage_reader() gives a committed step that load_latest() finds."""
    import torch.distributed.checkpoint as dcp

    ckpt = CheckpointManager(tmp_path)
    state = {"model": {"w": torch.arange(10.0)}, "step": 7}
    dcp.save(state, storage_writer=ckpt.storage_writer(7), no_dist=True)
    ckpt.commit(7)
    assert committed_steps(tmp_path) == [7]
    dest = {"model": {"w": torch.zeros(10)}, "step": 0}
    step = ckpt.latest_step()
    assert step == 7
    dcp.load(dest, storage_reader=ckpt.storage_reader(step), no_dist=True)
    assert torch.equal(dest["model"]["w"], torch.arange(10.0)) and dest["step"] == 7
    got = CheckpointManager(tmp_path).load_latest()
    assert got is not None and got.step == 7 and torch.equal(got.state["model"]["w"],
                                                             torch.arange(10.0))


def test_async_save_with_dcp_default_stager(tmp_path: Path) -> None:
    """dcp.async_save with DCP's own DefaultStager (async staging, an AsyncSaveResponse)
    through storage_writer(): commit() waits for its upload future, then the step loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    ckpt = CheckpointManager(tmp_path)
    stager = DefaultStager(StagingOptions(False, False, True, False))
    try:
        resp = dcp.async_save({"w": torch.arange(6.0)}, storage_writer=ckpt.storage_writer(9),
                              async_stager=stager, no_dist=True)
        ckpt.commit(9, resp)
        ckpt.wait()
    finally:
        stager.close()
    assert committed_steps(tmp_path) == [9]
    dest = {"w": torch.zeros(6)}
    got = ckpt.load_latest(dest)
    assert got is not None and got.step == 9 and torch.equal(dest["w"], torch.arange(6.0))
