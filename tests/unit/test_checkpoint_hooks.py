"""Prolog/epilog steps of checkpoint staging against an in-process agent socket."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_resilience.agent.server import AgentServer
from slurm_resilience.checkpoint import steps
from slurm_resilience.checkpoint.commit import committed_steps
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.uploader import Uploader
from slurm_resilience.config import Config, load_text
from slurm_resilience.hooks.context import HookContext

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
