"""Two saves of one step number (a job took an older step past a half-uploaded step N,
then saved N again) against a real S3-protocol endpoint (moto): save ids keep them apart.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
from pathlib import Path

import pytest

from slurm_resilience.agent.service import Peer
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    CommitMarker,
    Manifest,
    commit_part,
    new_save_id,
    rank_name,
    step_name,
    verify_step,
    write_commit_marker,
)
from slurm_resilience.checkpoint.prefix import parse_uri
from slurm_resilience.checkpoint.staging import create_job_dir, open_job_dir
from slurm_resilience.config import Config, load_text
from slurm_resilience.uploader.intent import Intent
from slurm_resilience.uploader.journal import StepState
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.service import Uploader
from slurm_resilience.uploader.stagein import StageinPolicy, read_remote_step, stage_in

ROOT = Peer(pid=1, uid=0, gid=0)
OLD = "0000000000000001-j3.r0.deadbeef"  # the dead job's save of step 10 (long ago)
RUN = "run"
STEP = 10
URI = parse_uri(f"s3://ckpt/{RUN}")


def _part(job: Path, step: int, rank: int, world: int, save_id: str, data: bytes) -> None:
    """One rank's committed part of ``step`` (and the node's COMMIT.json) in ``job``."""
    tmp = job / step_name(step) / f"{rank_name(rank)}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "data.bin").write_bytes(data)
    commit_part(tmp, step, rank, save_id=save_id)


def _node_step(job: Path, step: int, ranks: list[int], world: int, save_id: str,
               tag: bytes) -> None:
    for r in ranks:
        _part(job, step, r, world, save_id, tag + b"-rank%d" % r)
    write_commit_marker(job, step, world, save_id)


def _agent(base: Path, node: str, s3: S3, job_id: int) -> tuple[Uploader, Path]:
    """A node agent's checkpoint service with one registered job whose stage-in is done
    (so its pass uploads at once); the job's staging dir."""
    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {base}/state",
        "checkpoint:", "  enabled: true", f"  staging_root: {base}/nvme",
        "  allowed_prefix: s3://ckpt/", "  stagein_intent_wait_s: 0"]) + "\n")
    (base / "nvme").mkdir(parents=True, mode=0o755, exist_ok=True)
    job = Path(base / "nvme" / f"job-{job_id}")
    if not job.exists():
        job = create_job_dir(str(base / "nvme"), job_id, os.getuid(), os.getgid())
    up = Uploader(cfg, node, s3=s3)
    if job_id not in up.jobs:
        up.on_job_start({"job_id": job_id, "uid": os.getuid(), "gid": os.getgid(),
                         "user": pwd.getpwuid(os.getuid()).pw_name}, ROOT)
        up.jobs[job_id]["uri"] = str(URI)
        up.jobs[job_id]["stagein"] = {"state": "done"}  # type: ignore[typeddict-item]
        up.journal.write(up.jobs[job_id])
    return up, job


def _key(rel: str) -> str:
    return f"{RUN}/{step_name(STEP)}/{rel}"


def _get(s3: S3, rel: str) -> bytes:
    return s3.get_bytes("ckpt", _key(rel))


def _dead_job_left_half(s3: S3, tmp: Path) -> None:
    """The dead job 3 (save OLD, world size 2): node n4 uploaded rank 0 (its data, its
    manifest, its intent); node dead9 (rank 1) died before uploading anything."""
    src = tmp / "dead-src"
    src.mkdir()
    _node_step(src, STEP, [0], 2, OLD, b"old")
    part = src / step_name(STEP) / rank_name(0)
    for name in ("data.bin", "MANIFEST.json"):
        s3.client.put_object(Bucket="ckpt", Key=_key(f"{rank_name(0)}/{name}"),
                             Body=(part / name).read_bytes())
    for node, ranks in (("n4", [0]), ("dead9", [1])):
        body = Intent(STEP, 3, node, tuple(ranks), 2, 0.0, OLD).to_json()
        s3.client.put_object(Bucket="ckpt", Key=_key(f"INTENT-{node}.json"), Body=body)


def test_resave_never_commits_a_mix_of_the_dead_saves_ranks_and_the_new_ones(
        tmp_path: Path, s3: S3, events: Path) -> None:
    """S3 holds the dead job's rank 0 of step 10 (save OLD). The new job saves step 10
    again (save NEW) on n1 (rank 0) and n2 (rank 1); n2 finishes first. Every rank's
    manifest is then in S3, but rank 0's is OLD's: it is not counted and nothing is
    committed (before save ids, n2 committed OLD's rank 0 with its rank 1). Once n1
    uploads, the step commits with NEW in every manifest and the marker, and a stage-in
    brings NEW's bytes."""
    _dead_job_left_half(s3, tmp_path)
    new = new_save_id({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})
    assert new > OLD and "-j7.r1." in new
    up1, job1 = _agent(tmp_path / "n1", "n1", s3, 7)
    up2, job2 = _agent(tmp_path / "n2", "n2", s3, 7)
    _node_step(job1, STEP, [0], 2, new, b"new")
    _node_step(job2, STEP, [1], 2, new, b"new")

    up2.run_pass()
    assert up2.jobs[7]["steps"][str(STEP)]["state"] == StepState.WAITING_PEERS
    assert s3.head("ckpt", _key(COMMIT)) is None, "a mix of two saves was committed"
    stale = [json.loads(x) for x in events.read_text().splitlines()
             if "manifests of another save" in x]
    assert stale and stale[-1]["stale_ranks"] == {"0": OLD}, events.read_text()

    up1.run_pass()
    assert up1.jobs[7]["steps"][str(STEP)]["state"] == StepState.COMMITTED
    marker, manifests = read_remote_step(s3, URI, STEP)
    assert marker.save_id == new
    assert {r: m.save_id for r, m in manifests.items()} == {0: new, 1: new}
    assert _get(s3, f"{rank_name(0)}/data.bin") == b"new-rank0"
    up2.run_pass()  # n2 finds its own save committed by n1
    assert up2.jobs[7]["steps"][str(STEP)]["state"] == StepState.COMMITTED

    # A later job's stage-in takes step 10 and gets the new save's bytes.
    _up3, job3 = _agent(tmp_path / "n3", "n3", s3, 8)
    with open_job_dir(str(tmp_path / "n3" / "nvme"), 8) as jfd:
        res = stage_in(s3, URI, jfd, os.getuid(), os.getgid(), StageinPolicy(retry_s=0),
                       set_aside=lambda step, why: None)
    assert (res.step, res.source, res.fallbacks) == (STEP, "s3", ())
    got = job3 / step_name(STEP)
    assert (got / rank_name(0) / "data.bin").read_bytes() == b"new-rank0"
    assert (got / rank_name(1) / "data.bin").read_bytes() == b"new-rank1"
    assert verify_step(job3, STEP).save_id == new


def test_old_agent_resuming_after_a_newer_save_committed_the_step_leaves_it_alone(
        tmp_path: Path, s3: S3) -> None:
    """The dead node dead9 comes back (its agent restarts from its journal) with rank 1 of
    step 10, save OLD, half uploaded (data sent, manifest not). Meanwhile the new job's
    save NEW committed step 10. The old agent stops that upload (failed, naming the
    other save) and writes nothing: every object of the step is as NEW left it, except
    the old agent's own intent record, withdrawn."""
    up9, job9 = _agent(tmp_path / "dead9", "dead9", s3, 3)
    _node_step(job9, STEP, [1], 2, OLD, b"old")
    up9.run_pass()  # rank 1's data and manifest go up; the step waits for rank 0
    st = up9.jobs[3]["steps"][str(STEP)]
    assert st["state"] == StepState.WAITING_PEERS and st["save_id"] == OLD
    mkey = _key(f"{rank_name(1)}/MANIFEST.json")
    st["files"] = {k: v for k, v in st["files"].items() if not k.endswith("MANIFEST.json")}
    up9.journal.write(up9.jobs[3])  # as if it died between the data and the manifest
    del up9  # its process is gone (close() would close the shared S3 client)

    new = new_save_id({"SLURM_JOB_ID": "7"})
    up1, job1 = _agent(tmp_path / "n1", "n1", s3, 7)
    up2, job2 = _agent(tmp_path / "n2", "n2", s3, 7)
    _node_step(job1, STEP, [0], 2, new, b"new")
    _node_step(job2, STEP, [1], 2, new, b"new")
    up1.run_pass()
    up2.run_pass()
    assert up2.jobs[7]["steps"][str(STEP)]["state"] == StepState.COMMITTED
    before = {k: s3.get_bytes("ckpt", k) for k in s3.list_keys("ckpt", f"{RUN}/")}

    back, _ = _agent(tmp_path / "dead9", "dead9", s3, 3)  # the reboot: journal reloaded
    assert back.jobs[3]["steps"][str(STEP)]["state"] == StepState.WAITING_PEERS
    back.run_pass()
    st = back.jobs[3]["steps"][str(STEP)]
    assert st["state"] == StepState.FAILED, st
    assert "already committed in S3 by another save" in st["reason"] and new in st["reason"]
    after = {k: s3.get_bytes("ckpt", k) for k in s3.list_keys("ckpt", f"{RUN}/")}
    # Only its own (OLD) intent record went; everything of the committed step is as it was.
    own = _key("INTENT-dead9.json")
    assert Intent.from_json(before[own], own).save_id == OLD
    assert after == {k: v for k, v in before.items() if k != own}, "the old agent wrote"
    assert Manifest.from_json(s3.get_bytes("ckpt", mkey)).save_id == new


def test_old_agent_stops_when_a_newer_save_of_the_step_is_under_way(
        tmp_path: Path, s3: S3) -> None:
    """Not committed yet, but a newer save of step 10 announced itself (SAVE-<id>, before
    any of its data): the old agent stops before its first file and sends nothing."""
    new = new_save_id({"SLURM_JOB_ID": "7"})
    s3.client.put_object(Bucket="ckpt", Key=_key(f"SAVE-{new}"), Body=b"")
    up9, job9 = _agent(tmp_path / "dead9", "dead9", s3, 3)
    _node_step(job9, STEP, [1], 2, OLD, b"old")
    up9.run_pass()
    st = up9.jobs[3]["steps"][str(STEP)]
    assert st["state"] == StepState.FAILED
    assert "newer save of step 10 is under way" in st["reason"], st
    assert sorted(s3.list_keys("ckpt", f"{RUN}/")) == [_key(f"SAVE-{new}")]


def test_a_resave_of_a_step_whose_earlier_save_failed_is_uploaded_anew(
        tmp_path: Path, s3: S3, events: Path) -> None:
    """Job 7 saves step 10 (save A) while another save X of step 10 had announced itself:
    A's upload fails for good, naming X. X never commits (its job died); job 7 then saves
    step 10 again (save B, newer than X). The failed journal entry does not hide B: the
    step starts over and commits with B in every manifest and the marker."""
    up, job = _agent(tmp_path / "n1", "n1", s3, 7)
    first = new_save_id({"SLURM_JOB_ID": "7"})
    other = new_save_id({"SLURM_JOB_ID": "6"})
    s3.client.put_object(Bucket="ckpt", Key=_key(f"SAVE-{other}"), Body=b"")
    _node_step(job, STEP, [0], 1, first, b"first")
    up.run_pass()
    st = up.jobs[7]["steps"][str(STEP)]
    assert (st["state"], st["save_id"]) == (StepState.FAILED, first), st
    up.run_pass()  # a failed save is never retried
    assert up.jobs[7]["steps"][str(STEP)]["state"] == StepState.FAILED
    assert s3.head("ckpt", _key(COMMIT)) is None

    again = new_save_id({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})
    assert again > other > first
    shutil.rmtree(job / step_name(STEP))  # the job's own re-save replaces the local step
    _node_step(job, STEP, [0], 1, again, b"again")
    up.run_pass()
    st = up.jobs[7]["steps"][str(STEP)]
    assert st["state"] == StepState.COMMITTED, st
    marker, manifests = read_remote_step(s3, URI, STEP)
    assert marker.save_id == again and {r: m.save_id for r, m in manifests.items()} == {
        0: again}
    assert _get(s3, f"{rank_name(0)}/data.bin") == b"again-rank0"
    said = [json.loads(x) for x in events.read_text().splitlines()
            if "earlier save was not uploaded" in x]
    assert [(e["save_id"], e["earlier_save_id"]) for e in said] == [(again, first)]


def test_verify_and_stage_in_refuse_a_step_whose_manifests_mix_saves(
        tmp_path: Path, s3: S3) -> None:
    """S3 holds step 10 committed as save NEW whose rank 1 manifest is save OLD: read and
    verify refuse it naming the step and rank 1; stage-in passes over it for the legacy
    step 5 (no save ids anywhere), which still loads."""
    new = new_save_id({"SLURM_JOB_ID": "7"})
    src = tmp_path / "src"
    src.mkdir()
    _node_step(src, 5, [0], 1, "", b"legacy")
    assert b"save_id" not in (src / step_name(5) / COMMIT).read_bytes()
    _node_step(src, STEP, [0], 2, new, b"new")
    _part(src, STEP, 1, 2, OLD, b"old-rank1")
    for p in sorted(src.rglob("*")):
        if p.is_file():
            s3.client.put_object(Bucket="ckpt", Key=f"{RUN}/{p.relative_to(src).as_posix()}",
                                 Body=p.read_bytes())
    with pytest.raises(CheckpointError, match=r"step 10 mixes saves.*ranks \[1\]"):
        read_remote_step(s3, URI, STEP)
    with pytest.raises(CheckpointError, match=r"step 10 mixes saves.*ranks \[1\]"):
        verify_step(src, STEP)
    _up, job = _agent(tmp_path / "n1", "n1", s3, 8)
    with open_job_dir(str(tmp_path / "n1" / "nvme"), 8) as jfd:
        res = stage_in(s3, URI, jfd, os.getuid(), os.getgid(), StageinPolicy(retry_s=0),
                       set_aside=lambda step, why: None)
    assert (res.step, [f.step for f in res.fallbacks]) == (5, [STEP])
    assert "ranks [1]" in res.fallbacks[0].reason and OLD in res.fallbacks[0].reason
    assert verify_step(job, 5).save_id == ""
    assert (job / step_name(5) / rank_name(0) / "data.bin").read_bytes() == b"legacy-rank0"
    assert CommitMarker.from_json((job / step_name(5) / COMMIT).read_bytes()).save_id == ""


def test_a_dcp_save_records_one_save_id_in_its_manifest_and_marker(tmp_path: Path) -> None:
    """The real manager: the coordinator's save id is in the rank's manifest and in the
    step's COMMIT.json; two saves get different ids, ordered as they were made."""
    import torch

    from slurm_resilience.checkpoint.commit import read_manifest, read_marker
    from slurm_resilience.checkpoint.manager import CheckpointManager

    mgr = CheckpointManager(tmp_path)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((10,), float(step))})
    mgr.close()
    ids = []
    for step in (1, 2):
        sdir = tmp_path / step_name(step)
        marker = read_marker(sdir)
        assert marker.save_id and read_manifest(sdir / rank_name(0)).save_id == marker.save_id
        ids.append(marker.save_id)
    assert ids[0] < ids[1]
