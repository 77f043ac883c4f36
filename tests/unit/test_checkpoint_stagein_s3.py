"""Stage-in against a real S3-protocol endpoint (moto): what it passes over and why."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from moto_s3 import copy_step, upload_step

from slurm_resilience.checkpoint.commit import COMMIT, committed_steps, read_marker, step_name
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.prefix import parse_uri
from slurm_resilience.checkpoint.s3 import S3
from slurm_resilience.checkpoint.stagein import StageinPolicy, stage_in
from slurm_resilience.checkpoint.staging import (
    STALE,
    create_job_dir,
    open_job_dir,
    set_aside_step,
)

JOB = 7


def _saved(where: Path, step: int, value: float) -> Path:
    """A committed DCP step (world size 1) made by the real manager; its step dir."""
    where.mkdir()
    mgr = CheckpointManager(where)
    mgr.save(step, {"w": torch.full((1000,), value)})
    mgr.close()
    return where / step_name(step)


def _root(tmp_path: Path) -> tuple[str, Path]:
    root = tmp_path / "nvme"
    root.mkdir(mode=0o755)
    return str(root), create_job_dir(str(root), JOB, os.getuid(), os.getgid())


def _aside(root: str, jfd: int) -> Callable[[int, str], None]:
    def aside(step: int, why: str) -> None:
        set_aside_step(root, JOB, jfd, step_name(step), why)

    return aside


def test_partial_local_step_passed_over_is_set_aside_so_its_save_is_written(
        tmp_path: Path, s3: S3) -> None:
    """A node holding part of step 10 (its COMMIT.json too; the other node died before
    uploading) while S3 holds a complete step 5: stage-in takes 5 and sets the local
    step 10 aside under the root-only .stale/. The requeued run's save(10) then writes
    and commits a new step 10, instead of every rank skipping it as 'already committed'
    (the new step 10 was never written nor uploaded)."""
    root, job = _root(tmp_path)
    upload_step(s3, "run", _saved(tmp_path / "old5", 5, 5.0))
    partial = copy_step(_saved(tmp_path / "old10", 10, 10.0), job)
    (partial / COMMIT).write_text(json.dumps({"format": 2, "step": 10, "world_size": 2}))
    with open_job_dir(root, JOB) as jfd:
        res = stage_in(s3, parse_uri("s3://ckpt/run"), jfd, os.getuid(), os.getgid(),
                       StageinPolicy(retry_s=0), set_aside=_aside(root, jfd))
    assert (res.step, res.source, [f.step for f in res.fallbacks]) == (5, "s3", [10])
    assert "only ranks [0] of 0..1 are on this node" in res.fallbacks[0].reason
    assert committed_steps(job) == [5]
    (aside,) = os.listdir(Path(root) / STALE)
    assert aside.startswith(f"job-{JOB}.{step_name(10)}.")
    mgr = CheckpointManager(job)
    mgr.save(10, {"w": torch.full((1000,), 11.0)})
    mgr.close()
    assert committed_steps(job) == [5, 10]
    assert read_marker(job / step_name(10)).world_size == 1
    got = CheckpointManager(job).load_latest()
    assert got is not None and got.step == 10 and torch.equal(got.state["w"],
                                                               torch.full((1000,), 11.0))


def test_set_aside_moves_a_planted_link_never_its_target(tmp_path: Path) -> None:
    """A step "dir" that is a symlink the job planted is moved as the link itself."""
    root, job = _root(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / COMMIT).write_text("{}")
    (job / step_name(3)).symlink_to(target)
    with open_job_dir(root, JOB) as jfd:
        set_aside_step(root, JOB, jfd, step_name(3), "test")
    assert not (job / step_name(3)).exists() and (target / COMMIT).is_file()
    (aside,) = (Path(root) / STALE).iterdir()
    assert aside.is_symlink()
