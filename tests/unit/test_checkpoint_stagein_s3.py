"""Stage-in against a real S3-protocol endpoint (moto): what it passes over and why."""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from moto_s3 import copy_step, upload_step

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint.commit import COMMIT, committed_steps, read_marker, step_name
from slurm_resilience.checkpoint.manager import (
    ENV_ALLOW_OLDER,
    CheckpointError,
    CheckpointManager,
    Fallen,
    StageinStatus,
)
from slurm_resilience.checkpoint.prefix import parse_uri
from slurm_resilience.checkpoint.stagein_status import warn_fallbacks
from slurm_resilience.checkpoint.staging import (
    STALE,
    create_job_dir,
    open_job_dir,
    set_aside_step,
)
from slurm_resilience.config import Config, load_text
from slurm_resilience.uploader.cli import format_status
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.service import Uploader
from slurm_resilience.uploader.stagein import StageinPolicy, stage_in

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


ROOT = Peer(pid=1, uid=0, gid=0)
DEAD = b'{"step": 10, "job_id": 3, "node": "dead9", "ranks": [1], "world_size": 2, "time": 0}'
ALIVE = b'{"step": 10, "job_id": 3, "node": "n4", "ranks": [0], "world_size": 2, "time": 0}'


def _agent(tmp_path: Path, s3: S3) -> tuple[Uploader, str]:
    """The node agent's checkpoint service on moto; no wait for a step still uploading
    (stagein_intent_wait_s: 0), so nothing here waits on the wall clock."""
    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme",
        "  allowed_prefix: s3://ckpt/", "  stagein_intent_wait_s: 0"]) + "\n")
    up = Uploader(cfg, "n1", s3=s3)
    _root(tmp_path)
    return up, pwd.getpwuid(os.getuid()).pw_name


def _run_stagein(up: Uploader) -> dict[str, object]:
    up.stageins[JOB].join()
    return up.on_status({"job_id": JOB}, ROOT)


def _still_uploading(tmp_path: Path, s3: S3) -> None:
    """S3: a complete step 5, and step 10 with both nodes' intent records, where only the
    surviving node's rank 0 arrived (its node died before uploading rank 1)."""
    upload_step(s3, "run", _saved(tmp_path / "old5", 5, 5.0))
    upload_step(s3, "run", _saved(tmp_path / "old10", 10, 10.0), commit=False)
    for name, body in (("dead9", DEAD), ("n4", ALIVE)):
        s3.client.put_object(Bucket="ckpt", Key=f"run/step-00000010/INTENT-{name}.json",
                             Body=body)


def test_step_still_uploading_from_a_dead_node_fails_naming_it_and_the_opt_in(
        tmp_path: Path, s3: S3) -> None:
    """Without the job's opt-in, the bounded wait for step 10 ends in an error naming the
    step, the node whose part never arrived (and its ranks), and the opt-in."""
    _still_uploading(tmp_path, s3)
    up, user = _agent(tmp_path, s3)
    up.on_job_start({"job_id": JOB, "uid": os.getuid(), "gid": os.getgid(), "user": user,
                     "uri": "s3://ckpt/run"}, ROOT)
    st = _run_stagein(up)
    assert st["stagein"] == "failed", st
    error = str(st["error"])
    assert ("step 10 is committed but still uploading from node(s) dead9 (ranks [1] never "
            "arrived)") in error, error
    assert f"set {ENV_ALLOW_OLDER}=1 in the job's environment" in error
    assert up.jobs[JOB]["stagein"].get("still_uploading") == 10


def test_job_opt_in_takes_the_newest_older_step_loudly(
        tmp_path: Path, s3: S3, events: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The job's opt-in, told at register (even after the stage-in failed on that wait),
    takes the newest complete older step: a log event and a status line naming both
    steps, and a warning on the job's stderr."""
    _still_uploading(tmp_path, s3)
    up, user = _agent(tmp_path, s3)
    up.on_job_start({"job_id": JOB, "uid": os.getuid(), "gid": os.getgid(), "user": user,
                     "uri": "s3://ckpt/run"}, ROOT)
    assert _run_stagein(up)["stagein"] == "failed"
    with pytest.raises(RequestError, match="allow_older_step must be true or false"):
        up.on_register({"job_id": JOB, "uri": "s3://ckpt/run", "allow_older_step": "yes"},
                       ROOT)
    up.on_register({"job_id": JOB, "uri": "s3://ckpt/run", "allow_older_step": True}, ROOT)
    st = _run_stagein(up)
    assert (st["stagein"], st["step"], st["source"]) == ("done", 5, "s3"), st
    (fb,) = st["fallbacks"]  # type: ignore[misc]
    assert (fb["step"], fb["opt_in"]) == (10, ENV_ALLOW_OLDER)
    lines = format_status(JOB, "n1", st)
    assert (f"  WARNING: took OLDER step 5 instead of step 10 because {ENV_ALLOW_OLDER} is "
            "set") in lines, lines
    took = [json.loads(x) for x in events.read_text().splitlines()
            if "took an OLDER step" in x]
    assert [(e["step"], e["passed_over"], e["opt_in"]) for e in took] == [
        (5, 10, ENV_ALLOW_OLDER)]
    warn_fallbacks(StageinStatus("done", 5, None, (Fallen(10, fb["reason"], fb["opt_in"]),)))
    err = capsys.readouterr().err
    assert f"resuming from OLDER step 5, not step 10, because {ENV_ALLOW_OLDER} is set" in err


@pytest.mark.parametrize("value", ["maybe", "2", "enable"])
def test_opt_ins_are_validated(value: str) -> None:
    """An opt-in that is neither yes nor no is refused, naming the variable."""
    with pytest.raises(CheckpointError, match=f"{ENV_ALLOW_OLDER}='{value}' is not a yes/no"):
        CheckpointManager.from_env({ENV_ALLOW_OLDER: value})
