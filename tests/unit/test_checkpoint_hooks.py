"""Prolog/epilog steps of checkpoint staging against an in-process agent socket."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_resilience import log
from slurm_resilience.agent.server import AgentServer
from slurm_resilience.checkpoint.commit import committed_steps
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.config import Config, load_text
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.testing import FakeClock
from slurm_resilience.uploader import steps
from slurm_resilience.uploader.service import Uploader

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root-side hooks")
UID, GID = 54321, 54321


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Config, Uploader]]:
    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state",
        "agent:", f"  socket: {tmp_path}/run/agent.sock",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme/{{node}}",
        "  epilog_wait_s: 1"]) + "\n")
    up = Uploader(cfg, "n1")
    server = AgentServer(f"{tmp_path}/run/agent.sock")
    for op, handler in up.handlers().items():
        server.route(op, handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield cfg, up
    server.shutdown()
    server.server_close()


def _ctx(cfg: Config, kind: str, job: int) -> HookContext:
    return HookContext(kind=kind, cfg=cfg, node="n1", env={}, job_id=job, uid=UID, gid=GID,  # type: ignore[arg-type]
                       user="nobody")


def test_prolog_creates_owned_dir_and_registers_job(agent: tuple[Config, Uploader],
                                                    tmp_path: Path) -> None:
    """The prolog makes job-<id> (owner = job user, 0700) and the agent knows the job."""
    cfg, up = agent
    assert steps.prolog(_ctx(cfg, "prolog", 7)) == []
    st = os.lstat(tmp_path / "nvme" / "n1" / "job-7")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (UID, 0o700)
    assert up.jobs[7]["uid"] == UID and up.jobs[7]["user"] == "nobody"


@pytest.mark.parametrize(("uri", "event", "why"), [
    ("s3://ckpt/nobody/../root/run", "job option refused; the job runs without it",
     "expected s3://bucket/prefix without '..'"),  # refused by the hook's own re-check
    ("s3://ckpt/root/run", "prolog: --ckpt-uri refused",
     "outside the prefix user nobody may write to"),  # well formed, another user's prefix
])
def test_a_forged_ckpt_uri_is_refused_with_a_logged_reason(
        agent: tuple[Config, Uploader], tmp_path: Path, uri: str, event: str, why: str) -> None:
    """A user's own plugstack can set SPANK_SLURM_RESILIENCE_CKPT_URI to anything: the
    Python re-checks (the hook's, then the agent's prefix check) refuse it, the job starts
    without a run URI (no stage-in from someone else's prefix), and the log says why."""
    cfg, up = agent
    up.ck = dataclasses.replace(up.ck, allowed_prefix="s3://ckpt/{user}/")
    ctx = _ctx(cfg, "prolog", 8)
    ctx.env = {"SPANK_SLURM_RESILIENCE_CKPT_URI": uri}
    log.configure(mode="json", level="info", file=str(tmp_path / "ev.jsonl"))
    try:
        assert steps.prolog(ctx) == []
    finally:
        log.reset()
    assert 8 in up.jobs and not up.jobs[8].get("uri")
    said = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert any(e["event"] == event and why in str(e.get("why", e.get("error")))
               for e in said), said


def test_prolog_sets_a_symlinked_staging_dir_aside(agent: tuple[Config, Uploader],
                                                tmp_path: Path) -> None:
    """A link where the job dir goes is set aside, never followed and never a drain: the job
    gets a real dir of its own."""
    cfg, _ = agent
    (tmp_path / "nvme" / "n1").mkdir(parents=True)
    etc_mode = os.stat("/etc").st_mode
    os.symlink("/etc", tmp_path / "nvme" / "n1" / "job-8")
    assert steps.prolog(_ctx(cfg, "prolog", 8)) == []
    job = tmp_path / "nvme" / "n1" / "job-8"
    assert job.is_dir() and not job.is_symlink() and os.stat("/etc").st_mode == etc_mode


def test_epilog_keeps_local_only_steps_and_removes_empty_dirs(
        agent: tuple[Config, Uploader], tmp_path: Path) -> None:
    """Without a URI a job's committed steps are the only copy: kept for local_only_keep_s,
    then removed by the agent; an empty dir goes at once."""
    cfg, up = agent
    for job in (9, 10):
        steps.prolog(_ctx(cfg, "prolog", job))
    jdir = tmp_path / "nvme" / "n1" / "job-9"
    mgr = CheckpointManager(jdir)
    mgr.save(1, {"w": torch.ones(3)})
    mgr.wait()
    (jdir / "step-00000002" / "rank-00000.tmp").mkdir(parents=True)  # a crashed save
    assert steps.epilog(_ctx(cfg, "epilog", 9)) == []
    assert steps.epilog(_ctx(cfg, "epilog", 10)) == []
    assert committed_steps(jdir) == [1] and not (jdir / "step-00000002" / "rank-00000.tmp").exists()
    assert not (tmp_path / "nvme" / "n1" / "job-10").exists()
    up.run_pass()
    assert up.jobs[9]["state"] == "ended" and committed_steps(jdir) == [1]  # kept for a requeue
    up.jobs[9]["ended_at"] = time.time() - up.ck.local_only_keep_s - 1
    up.run_pass()
    assert 9 not in up.jobs and not jdir.exists()  # local_only_keep_s later: NVMe freed


def test_epilog_without_agent_keeps_dir(tmp_path: Path) -> None:
    """With the agent down the epilog cleans crashed saves but deletes nothing else."""
    cfg = load_text(Config, "\n".join([
        "agent:", f"  socket: {tmp_path}/none.sock", "checkpoint:", "  enabled: true",
        f"  staging_root: {tmp_path}/nvme"]) + "\n")
    from slurm_resilience.checkpoint.staging import create_job_dir

    d = create_job_dir(f"{tmp_path}/nvme", 11, UID, GID)
    (d / "step-00000001" / "rank-00000.tmp").mkdir(parents=True)
    (d / "keep").write_text("x")
    assert steps.epilog(_ctx(cfg, "epilog", 11)) == []
    assert (d / "keep").exists() and not (d / "step-00000001" / "rank-00000.tmp").exists()


class _Ticks(FakeClock):
    """A clock that moves one second each time the removal looks at it."""

    def monotonic(self) -> float:
        self.advance(1.0)
        return super().monotonic()


def _big_tree(root: Path, job: int) -> Path:
    from slurm_resilience.checkpoint.staging import create_job_dir

    d = create_job_dir(str(root), job, UID, GID)
    for i in range(20):
        sub = d / f"d{i}"
        sub.mkdir()
        for j in range(10):
            (sub / f"f{j}").write_bytes(b"x")
    return d


def _events(path: Path) -> list[dict[str, object]]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _told(up: Uploader) -> bool:
    return up.stale_due


def test_epilog_removal_over_its_budget_is_handed_to_the_agent(
        agent: tuple[Config, Uploader], tmp_path: Path) -> None:
    """A tree the epilog can't remove within its share of the budget (the clock runs out
    after a few entries) is set aside under .stale/ at once, the job's name is free, the
    agent is told and removes the rest in its own passes, each bounded; all of it said."""
    from slurm_resilience import log

    _, up = agent
    root = tmp_path / "nvme" / "n1"
    _big_tree(root, 21)
    events = tmp_path / "events.jsonl"
    log.configure(mode="json", level="info", file=str(events))
    try:
        up.stale_due = False
        steps.remove_or_hand_off(str(root), 21, f"{tmp_path}/run/agent.sock", budget_s=30,
                                 timeout=5, clock=_Ticks())
        assert not (root / "job-21").exists()
        stale = os.listdir(root / ".stale")
        assert len(stale) == 1 and stale[0].startswith("job-21.")
        assert _told(up), "the agent was not told"
        said = [e for e in _events(events) if "handed to the agent" in str(e["event"])]
        assert said and "30s" in str(said[0]["removal"])
        up.ck = dataclasses.replace(up.ck, remove_max_entries=50)
        passes = 0
        while _told(up):
            up.run_pass()  # each pass removes at most 50 entries, then yields
            passes += 1
            assert passes < 20
        assert passes > 1 and os.listdir(root / ".stale") == []
    finally:
        log.reset()


def test_epilog_removal_over_budget_without_agent_sets_the_tree_aside(tmp_path: Path) -> None:
    """The agent can't be reached: the tree stays set aside under .stale/ (root-only, out of
    the job's name) with a log event, and the agent removes it when it next starts."""
    from slurm_resilience import log

    root = tmp_path / "nvme"
    _big_tree(root, 22)
    events = tmp_path / "events.jsonl"
    log.configure(mode="json", level="info", file=str(events))
    try:
        steps.remove_or_hand_off(str(root), 22, f"{tmp_path}/none.sock", budget_s=10,
                                 timeout=1, clock=_Ticks())
    finally:
        log.reset()
    assert not (root / "job-22").exists() and len(os.listdir(root / ".stale")) == 1
    said = [e for e in _events(events) if "set aside under .stale/" in str(e["event"])]
    assert said and said[0]["agent_error"]
    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state", "checkpoint:", "  enabled: true",
        f"  staging_root: {root}"]) + "\n")
    Uploader(cfg, "n1").run_pass()  # a fresh agent looks at .stale/ at once
    assert os.listdir(root / ".stale") == []


def test_epilog_budget_for_removal_is_a_share_of_its_spare_time() -> None:
    """The removal's seconds come from what the epilog's limit leaves over, never more."""
    from slurm_resilience.config.budgets import EPILOG_REMOVE_SHARE, epilog_remove_s, hook_waits

    cfg = load_text(Config, "checkpoint:\n  enabled: true\n")
    spare = cfg.hooks.epilog_timeout_s - sum(
        w.seconds for w in hook_waits(cfg)["hooks.epilog_timeout_s"])
    assert spare > 0 and epilog_remove_s(cfg) == spare * EPILOG_REMOVE_SHARE
