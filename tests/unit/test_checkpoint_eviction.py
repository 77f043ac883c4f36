"""Staging capacity: the eviction policy, the per-job quota, the reclaimable record and
the agent's pass over a real staging dir (sparse files stand in for a full NVMe)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from slurm_resilience.checkpoint import quota, reclaim_record
from slurm_resilience.checkpoint.commit import step_name
from slurm_resilience.checkpoint.errors import CheckpointError
from slurm_resilience.config import Config, load_text
from slurm_resilience.config.health import NvmeCheckSection
from slurm_resilience.config.loader import ByteSize
from slurm_resilience.health.checks import nvme as nvme_check
from slurm_resilience.health.checks.spec import NoState
from slurm_resilience.health.collectors import nvme as collector
from slurm_resilience.health.findings import Severity
from slurm_resilience.testing import FakeClock
from slurm_resilience.uploader.eviction import (
    StagedStep,
    evictable,
    plan_eviction,
    reclaimable,
)
from slurm_resilience.uploader.journal import JobRecord, JobState, new_record
from slurm_resilience.uploader.space import SpaceKeeper

GiB = 1 << 30
NOW = 1_000_000.0


def st(job: int, step: int, nbytes: int, at: float, *, s3: bool = False,
       ended: float | None = None, over: bool = False) -> StagedStep:
    return StagedStep(job, step, nbytes, at, s3, ended, over)


def ids(steps: list[StagedStep]) -> list[tuple[int, int]]:
    return [(s.job_id, s.step) for s in steps]


def test_running_jobs_newest_step_is_never_evicted() -> None:
    """A running job's newest step stays however full the disk, even when it is in S3."""
    steps = [st(1, 5, GiB, NOW - 100, s3=True), st(1, 6, GiB, NOW - 50, s3=True)]
    assert ids(plan_eviction(steps, free=0, target_free=100 * GiB, now=NOW,
                             grace_s=0)) == [(1, 5)]


def test_running_jobs_older_local_only_steps_stay() -> None:
    """A running job's older step that is not in S3 is its only copy: never evicted."""
    steps = [st(1, 5, GiB, NOW - 100), st(1, 6, GiB, NOW - 50)]
    assert plan_eviction(steps, 0, 100 * GiB, NOW, 0) == []
    assert reclaimable(steps) == 0


def test_steps_in_s3_go_first_then_local_only_after_grace_oldest_first() -> None:
    """In-S3 steps go at once (oldest first), then ended jobs' local-only steps whose
    grace is over (oldest first); those still in their grace wait."""
    steps = [
        st(1, 3, GiB, NOW - 10, s3=True, ended=NOW - 5),
        st(2, 7, GiB, NOW - 900, ended=NOW - 700),   # grace over
        st(3, 1, GiB, NOW - 5000, ended=NOW - 60),   # ended a minute ago: in its grace
        st(4, 2, GiB, NOW - 30, s3=True, ended=NOW - 20),
        st(2, 6, GiB, NOW - 1000, ended=NOW - 700),
    ]
    assert ids(evictable(steps, NOW, grace_s=600)) == [(4, 2), (1, 3), (2, 6), (2, 7)]
    assert ids(evictable(steps, NOW + 600, grace_s=600)) == [(4, 2), (1, 3), (3, 1), (2, 6),
                                                             (2, 7)]


def test_only_as_much_as_the_pressure_needs() -> None:
    """No pressure: nothing goes; a 1.5 GiB shortfall takes two 1 GiB steps."""
    steps = [st(1, s, GiB, NOW - 100 + s, s3=True, ended=NOW - 10) for s in range(5)]
    assert plan_eviction(steps, free=20 * GiB, target_free=10 * GiB, now=NOW, grace_s=0) == []
    plan = plan_eviction(steps, free=int(8.5 * GiB), target_free=10 * GiB, now=NOW, grace_s=0)
    assert ids(plan) == [(1, 0), (1, 1)]


def test_a_step_still_to_be_uploaded_is_never_evicted() -> None:
    """An ended job's step that S3 does not hold yet stays, however full the disk."""
    steps = [StagedStep(1, 3, GiB, NOW - 5000, False, NOW - 4000, True, uploading=True)]
    assert plan_eviction(steps, 0, 10 * GiB, NOW, grace_s=0) == []
    assert reclaimable(steps) == 0


def test_a_job_over_its_quota_loses_the_grace() -> None:
    """A local-only step of an ended job over its quota goes at once, grace or not."""
    steps = [st(9, 1, 90 * GiB, NOW - 5, ended=NOW - 3, over=True)]
    assert ids(plan_eviction(steps, 0, 10 * GiB, NOW, grace_s=600)) == [(9, 1)]


def test_reclaimable_counts_steps_in_their_grace() -> None:
    """What eviction gives back without any job's help includes steps still in their grace
    but never a running job's newest step."""
    steps = [st(1, 2, 3 * GiB, NOW, ended=NOW), st(2, 1, 5 * GiB, NOW),
             st(2, 0, 7 * GiB, NOW - 1, s3=True)]
    assert reclaimable(steps) == 10 * GiB


def test_quota_refuses_a_save_naming_the_quota_the_usage_and_the_setting() -> None:
    """check_save raises before the write, naming usage, quota and the setting."""
    q = quota.job_quota(100 * GiB, 0.5)
    quota.check_save(3, 10 * GiB, 40 * GiB, q)  # exactly at the quota: allowed
    with pytest.raises(CheckpointError) as exc:
        quota.check_save(3, 10 * GiB, 40 * GiB + 1, q)
    msg = str(exc.value)
    assert f"job 3 uses {10 * GiB:,} bytes of its {50 * GiB:,}-byte quota" in msg
    assert "checkpoint.job_quota_fraction=0.5" in msg and f"adds {40 * GiB + 1:,}" in msg
    assert not quota.over_quota(50 * GiB, q) and quota.over_quota(50 * GiB + 1, q)


def test_reclaimable_record_is_measured_at_check_time_and_taken_only_fresh(
        tmp_path: Path) -> None:
    """The gate measures the recorded steps when it checks (bytes added since count, a
    symlinked step counts nothing); a stale or mangled record counts as nothing and says
    why."""
    root, state = tmp_path / "nvme", str(tmp_path / "state")
    _step(root, 3, 1, 2 * GiB)
    _step(root, 3, 2, GiB)
    os.symlink("/", root / "job-3" / step_name(9))
    reclaim_record.write(state, str(root), [("job-3", step_name(1)), ("job-3", step_name(9)),
                                            ("job-4", step_name(1))], NOW)
    size = 2 * GiB + len(json.dumps({"step": 1}))
    assert reclaim_record.read(state, apparent=True, now=NOW + 10) == (size, None)
    with open(root / "job-3" / step_name(1) / "more", "wb") as fh:
        fh.truncate(GiB)
    assert reclaim_record.read(state, apparent=True, now=NOW + 10) == (size + GiB, None)
    value, why = reclaim_record.read(state, apparent=True,
                                     now=NOW + reclaim_record.MAX_AGE_S + 1)
    assert value == 0 and why and "old" in why
    Path(reclaim_record.path(state)).write_text("{nope")
    value, why = reclaim_record.read(state, apparent=True, now=NOW)
    assert value == 0 and why and "unreadable" in why
    assert reclaim_record.read(str(tmp_path / "none"), apparent=True, now=NOW) == (0, None)


def test_nvme_check_counts_reclaimable_bytes() -> None:
    """A disk short of free space passes when eviction can give the rest back, fails
    naming both figures when it cannot."""
    snap = collector.NvmeSnapshot("/nvme", exists=True, total=100 * GiB, free=5 * GiB,
                                  reclaimable=90 * GiB)
    cfg = NvmeCheckSection(min_free=ByteSize(10 * GiB))
    found = nvme_check.check(snap, cfg, NoState()).findings
    assert [f.severity for f in found] == [Severity.OK]
    assert "+90.0GiB reclaimable by checkpoint eviction" in found[0].message
    snap.reclaimable = 2 * GiB
    found = nvme_check.check(snap, cfg, NoState()).findings
    assert [f.message for f in found if f.severity is Severity.FAIL] == [
        "nvme 5.0GiB free (+2.0GiB reclaimable by checkpoint eviction) of 100.0GiB "
        "(expected >=10.0GiB)"]


# -- the agent's pass over a real staging dir --------------------------------------------

def _cfg(tmp_path: Path, fraction: float = 0.5) -> Config:
    return load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme",
        f"  job_quota_fraction: {fraction}", "  eviction_grace_s: 600",
        "health:", "  nvme:", f"    path: {tmp_path}/nvme", "    size_limit: 100GiB",
        "    min_free: 10GiB"]) + "\n")


def _step(root: Path, job: int, step: int, nbytes: int) -> None:
    d = root / f"job-{job}" / step_name(step)
    d.mkdir(parents=True)
    with open(d / "rank-0.bin", "wb") as fh:
        fh.truncate(nbytes)  # sparse: counts against size_limit, costs no disk
    (d / "COMMIT.json").write_text(json.dumps({"step": step}))


def _rec(tmp_path: Path, job: int, ended: float | None) -> JobRecord:
    rec = new_record(job, os.getuid(), os.getgid(), "u", f"{tmp_path}/nvme")
    if ended is not None:
        rec["state"], rec["ended_at"] = JobState.ENDED, ended
    return rec


def _gate(tmp_path: Path, now: float) -> list[str]:
    snap = collector.collect(f"{tmp_path}/nvme", size_limit=100 * GiB, active=False)
    snap.reclaimable, snap.reclaim_note = reclaim_record.read(f"{tmp_path}/state",
                                                              apparent=True, now=now)
    found = nvme_check.check(snap, NvmeCheckSection(min_free=ByteSize(10 * GiB)),
                             NoState()).findings
    return [f.message for f in found if f.severity is not Severity.OK]


def test_ended_jobs_local_step_filling_the_disk_never_fails_the_gate(tmp_path: Path) -> None:
    """A finished job's local-only step within its quota that leaves 5 GiB free: the gate
    passes at once (reclaimable), and the step is evicted when its grace ends."""
    root = tmp_path / "nvme"
    _step(root, 4, 1, 45 * GiB)
    _step(root, 5, 1, 45 * GiB)
    clock = FakeClock(wall=NOW)
    keeper = SpaceKeeper(_cfg(tmp_path), "n1", clock=clock)
    recs = [_rec(tmp_path, 4, NOW - 10), _rec(tmp_path, 5, None)]
    assert keeper.run(recs, set()) == []  # job 4's grace runs; job 5 runs
    assert _gate(tmp_path, NOW) == []
    assert keeper.over_quota == {}
    clock.advance(600)
    assert [(s.job_id, s.step) for s in keeper.run(recs, set())] == [(4, 1)]
    assert not (root / "job-4" / step_name(1)).exists()
    assert (root / "job-5" / step_name(1)).exists()
    assert reclaim_record.read(f"{tmp_path}/state", apparent=True, now=clock.time()) == (0, None)
    assert _gate(tmp_path, clock.time()) == []


def test_job_over_its_quota_is_named_and_evicted_at_once(tmp_path: Path) -> None:
    """A 3-second job's 95 GiB local-only step (over its 50% quota) is evicted on the
    first pass under pressure, and ckpt.status's message names the quota."""
    root = tmp_path / "nvme"
    _step(root, 7, 1, 95 * GiB)
    keeper = SpaceKeeper(_cfg(tmp_path), "n1", clock=FakeClock(wall=NOW))
    rec = _rec(tmp_path, 7, NOW - 1)
    assert [(s.job_id, s.step) for s in keeper.run([rec], set())] == [(7, 1)]
    assert "job 7 uses" in keeper.over_quota[7] and "job_quota_fraction" in keeper.over_quota[7]
    assert _gate(tmp_path, NOW) == []


def test_running_job_filling_the_disk_keeps_its_step_and_the_gate_fails(
        tmp_path: Path) -> None:
    """A running job's newest step is not reclaimable: the gate still fails for space."""
    _step(tmp_path / "nvme", 8, 1, 95 * GiB)
    keeper = SpaceKeeper(_cfg(tmp_path, fraction=1.0), "n1", clock=FakeClock(wall=NOW))
    assert keeper.run([_rec(tmp_path, 8, None)], set()) == []
    assert _gate(tmp_path, NOW) == ["nvme 5.0GiB free of 100.0GiB (expected >=10.0GiB)"]


def test_a_node_without_a_staging_root_yet_has_nothing_to_do(tmp_path: Path) -> None:
    """Before any job staged on the node the pass evicts nothing and raises nothing."""
    assert SpaceKeeper(_cfg(tmp_path), "n1", clock=FakeClock(wall=NOW)).run([], set()) == []


def test_ckpt_status_names_a_job_over_its_staging_quota(tmp_path: Path) -> None:
    """After the agent's pass found a job over its quota, the job's ckpt.status says so
    with usage, quota and setting; a job within its quota gets None."""
    from slurm_resilience.agent.service import Peer
    from slurm_resilience.uploader.service import Uploader

    _step(tmp_path / "nvme", 7, 1, 60 * GiB)
    _step(tmp_path / "nvme", 8, 1, GiB)
    up = Uploader(_cfg(tmp_path), "n1")
    try:
        up.jobs = {7: _rec(tmp_path, 7, None), 8: _rec(tmp_path, 8, None)}
        up.keep_space()
        peer = Peer(pid=1, uid=os.getuid(), gid=os.getgid())
        over = str(up.on_status({"op": "ckpt.status", "job_id": 7}, peer)["staging_quota"])
        assert over.startswith(f"checkpoint: staging quota: job 7 uses {60 * GiB + 11:,} bytes")
        assert "job_quota_fraction=0.5" in over
        assert up.on_status({"op": "ckpt.status", "job_id": 8}, peer)["staging_quota"] is None
    finally:
        up.close()


def test_the_collector_measures_reclaimable_steps_only_when_the_disk_is_short(
        tmp_path: Path) -> None:
    """With enough free space the collector leaves the record alone (no walk on the
    healthy path); short of space it measures the recorded steps."""
    root, state = tmp_path / "nvme", str(tmp_path / "state")
    _step(root, 3, 1, 95 * GiB)
    reclaim_record.write(state, str(root), [("job-3", step_name(1))], time.time())
    roomy = collector.collect(str(root), size_limit=100 * GiB, active=False,
                              reclaim_dir=state, reclaim_below=GiB)
    assert roomy.reclaimable == 0
    short = collector.collect(str(root), size_limit=100 * GiB, active=False,
                              reclaim_dir=state, reclaim_below=10 * GiB)
    assert short.reclaimable == 95 * GiB + len(json.dumps({"step": 1}))


def test_a_save_past_the_jobs_share_of_the_disk_is_refused_before_it_writes(
        tmp_path: Path) -> None:
    """The training side holds a save to checkpoint.job_quota_fraction: one that would take
    the job's staging dir past it raises, naming the quota and the setting, and writes
    nothing; a save within it commits."""
    import torch

    from slurm_resilience.checkpoint.manager import CheckpointManager

    job = tmp_path / "job-7"
    job.mkdir()
    vfs = os.statvfs(job)
    disk = vfs.f_blocks * vfs.f_frsize
    roomy = CheckpointManager(job, job_id=7, quota_fraction=0.5)
    roomy.save(1, {"w": torch.zeros(1024)})
    roomy.close()
    tight = CheckpointManager(job, job_id=7, quota_fraction=64 * 1024 / disk)
    with pytest.raises(CheckpointError, match=r"staging quota: job 7 uses .*quota "
                                              r"\(checkpoint\.job_quota_fraction=.*this save "
                                              r"adds 262,144 bytes"):
        tight.save(2, {"w": torch.zeros(65536)})
    tight.close()
    assert sorted(p.name for p in job.iterdir() if p.name.startswith("step-")) == [
        "step-00000001"]
