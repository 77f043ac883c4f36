"""The checkpoint prolog and epilog when the node agent can't be reached or stays busy: the
job runs, the wait is bounded by ``agent.request_timeout_s`` (counted on an injected clock),
and the log names the cause in an error event that is also counted for the metrics."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from conftest import events_saying

from slurm_resilience import events as metric_events
from slurm_resilience.agent.server import AgentServer
from slurm_resilience.config import Config, load_text
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.testing import FakeClock
from slurm_resilience.uploader import steps

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root-side hooks")
UID, GID = 54321, 54321
TIMEOUT_S = 4.0


def _cfg(tmp_path: Path) -> Config:
    return load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state",
        "agent:", f"  socket: {tmp_path}/run/agent.sock", f"  request_timeout_s: {TIMEOUT_S}",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme/{{node}}"]) + "\n")


def _ctx(cfg: Config) -> HookContext:
    return HookContext(kind="prolog", cfg=cfg, node="n1", env={}, job_id=31, uid=UID, gid=GID,
                       user="nobody")


def test_prolog_without_an_agent_socket_lets_the_job_run_and_says_why(
        tmp_path: Path, events: Path) -> None:
    """No socket at all: the first try fails, nothing is waited for, the job's staging dir
    is there, and the warning names the socket that is missing."""
    clock = FakeClock(100.0)
    assert steps.prolog(_ctx(_cfg(tmp_path)), clock=clock) == []
    assert clock.slept == []
    assert (tmp_path / "nvme" / "n1" / "job-31").is_dir()
    said = events_saying(events, "couldn't reach the node agent; the job's checkpoints on "
                                 "this node get no stage-in and are not uploaded to S3")
    assert len(said) == 1 and said[0]["level"] == "error" and said[0]["hook"] == "prolog"
    assert "agent.sock" in str(said[0]["error"]) and "No such file" in str(said[0]["error"])
    counted = metric_events.read(metric_events.path_for(f"{tmp_path}/state", "n1"))
    assert counted["counters"] == {"ckpt_agent_unreachable|prolog": 1}


def test_prolog_against_a_busy_agent_gives_up_at_its_timeout(tmp_path: Path,
                                                             events: Path) -> None:
    """A real agent socket over its caps answers every connection "busy" (as the server
    does under a flood): the prolog retries with growing pauses until request_timeout_s
    has passed on its clock, never longer, then lets the job run and says it was busy."""
    server = AgentServer(f"{tmp_path}/run/agent.sock", max_connections=0, max_per_uid=0,
                         root_reserve=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        clock = FakeClock(100.0)
        assert steps.prolog(_ctx(_cfg(tmp_path)), clock=clock) == []
    finally:
        server.shutdown()
        server.server_close()
    assert len(clock.slept) > 3, "busy was not retried"
    assert sum(clock.slept) == pytest.approx(TIMEOUT_S)  # the last pause ends at the deadline
    assert max(clock.slept) <= 0.5
    assert server.stats.busy == len(clock.slept) + 1 and server.stats.admitted == 0
    said = events_saying(events, "couldn't reach the node agent")
    assert len(said) == 1 and "busy" in str(said[0]["error"])
    assert said[0]["waited_limit_s"] == TIMEOUT_S
    assert (tmp_path / "nvme" / "n1" / "job-31").is_dir()


def test_epilog_without_an_agent_logs_and_counts_it_and_keeps_the_staging_dir(
        tmp_path: Path, events: Path) -> None:
    """The epilog that finds no agent keeps the job's staging dir (its checkpoints were
    not uploaded), logs an error event naming the hook, and counts it for the metrics."""
    cfg = _cfg(tmp_path)
    clock = FakeClock(100.0)
    assert steps.prolog(_ctx(cfg), clock=clock) == []
    epilog = HookContext(kind="epilog", cfg=cfg, node="n1", env={}, job_id=31, uid=UID,
                         gid=GID, user="nobody")
    assert steps.epilog(epilog) == []
    assert (tmp_path / "nvme" / "n1" / "job-31").is_dir()
    said = events_saying(events, "couldn't reach the node agent")
    assert [e["hook"] for e in said] == ["prolog", "epilog"]
    assert "keeping the staging dir" in str(said[1]["error"])
    counted = metric_events.read(metric_events.path_for(f"{tmp_path}/state", "n1"))
    assert counted["counters"] == {"ckpt_agent_unreachable|prolog": 1,
                                   "ckpt_agent_unreachable|epilog": 1}
