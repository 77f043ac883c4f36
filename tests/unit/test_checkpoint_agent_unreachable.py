"""A job with a run URI whose node agent can't be reached: an error on every rank by
default (checkpoint.agent_unreachable: error), a warning on every rank with local-only;
found once per node within agent.request_timeout_s; the reachable agents are told, and
show the missing nodes in ckpt status, the log and the metrics."""

from __future__ import annotations

import json
import os
import pwd
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import events_saying

from slurm_resilience.agent.server import AgentServer
from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint.manager import CheckpointError, CheckpointManager
from slurm_resilience.checkpoint.staging import create_job_dir
from slurm_resilience.config import Config, load_text
from slurm_resilience.uploader.cli import format_status
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.service import Uploader

USER = pwd.getpwuid(os.getuid()).pw_name
URI = f"s3://ckpt/{USER}/run"
JOB = 5


def _env(tmp_path: Path, node: str, sock: str, *, policy: str = "",
         timeout_s: float = 5.0, conf: Path | None = None) -> dict[str, str]:
    """A job's environment on ``node``, with a config naming the agent socket (written
    here unless ``conf`` names one already written)."""
    if conf is None:
        conf = tmp_path / "c.yaml"
        conf.write_text("\n".join([
            "checkpoint:", "  allowed_prefix: s3://ckpt/{user}/",
            f"  staging_root: {tmp_path}/{{node}}",
            *([f"  agent_unreachable: {policy}"] if policy else []),
            "agent:", f"  socket: {sock}", f"  request_timeout_s: {timeout_s}"]) + "\n")
    (tmp_path / node / f"job-{JOB}").mkdir(parents=True, exist_ok=True)
    return {"SLURM_RESILIENCE_CONFIG": str(conf), "SLURM_JOB_ID": str(JOB),
            "SLURMD_NODENAME": node, "SLURM_RESILIENCE_CKPT_URI": URI, "LOCAL_RANK": "0"}


def test_a_missing_agent_stops_the_job_by_default_naming_the_node(tmp_path: Path) -> None:
    """No agent socket on the node: from_env raises at once, naming the node, the socket,
    what is lost, the site's policy and the ways out."""
    env = _env(tmp_path, "n1", f"{tmp_path}/gone.sock")
    with pytest.raises(CheckpointError) as err:
        CheckpointManager.from_env(env)
    msg = str(err.value)
    assert msg.startswith("checkpoint: register: couldn't reach the node agent on n1 ("), msg
    assert f"{tmp_path}/gone.sock" in msg and "No such file" in msg
    assert f"checkpoints saved there would never reach {URI}" in msg
    assert "checkpoint.agent_unreachable is error" in msg and "--exclude=n1" in msg


def test_a_stopped_agent_is_given_up_on_after_the_agent_request_timeout(
        tmp_path: Path) -> None:
    """An agent whose socket accepts connections but never answers (a stopped process) is
    given up on after agent.request_timeout_s, and the error says that limit."""
    path = f"{tmp_path}/stopped.sock"
    stopped = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stopped.bind(path)
    stopped.listen(8)  # connections complete in the backlog; nobody ever reads them
    try:
        with pytest.raises(CheckpointError) as err:
            CheckpointManager.from_env(_env(tmp_path, "n1", path, timeout_s=0.2))
    finally:
        stopped.close()
    assert "couldn't reach the node agent on n1" in str(err.value)
    assert "no answer within 0.2s: agent.request_timeout_s" in str(err.value), str(err.value)


def test_local_only_warns_and_keeps_the_nodes_checkpoints_local(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With checkpoint.agent_unreachable: local-only the job goes on: stderr says which
    node's checkpoints never reach S3, and a restore still refuses to guess from local
    steps (the run's S3 steps are unknown)."""
    mgr = CheckpointManager.from_env(_env(tmp_path, "n1", f"{tmp_path}/gone.sock",
                                          policy="local-only"))
    err = capsys.readouterr().err
    assert "checkpoint: register: WARNING: couldn't reach the node agent on n1" in err, err
    assert f"stay on that node and never reach {URI}" in err
    assert "checkpoint.agent_unreachable is local-only" in err
    assert mgr.agent_socket is None
    with pytest.raises(CheckpointError, match="the node agent is unreachable"):
        mgr.load_latest()


def test_the_config_refuses_an_unknown_policy() -> None:
    """checkpoint.agent_unreachable takes error or local-only, and the error lists them."""
    from slurm_resilience.config.loader import ConfigError

    with pytest.raises(ConfigError, match=r"agent_unreachable.*'error'.*'local-only'"):
        load_text(Config, "checkpoint:\n  agent_unreachable: ignore\n")


# -- two ranks on two nodes, one agent missing --------------------------------------------------

@pytest.fixture
def n1_agent(tmp_path: Path) -> Iterator[tuple[AgentServer, list[dict[str, Any]]]]:
    """A real agent socket server on n1 whose ckpt.register records what it was told."""
    told: list[dict[str, Any]] = []
    srv = AgentServer(str(tmp_path / "n1" / "agent.sock"))
    srv.route("ckpt.register", lambda req, peer: (told.append(dict(req)), {"ok": True})[1])
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, told
    srv.shutdown()
    srv.server_close()


def _two_nodes(rank: int, world: int, job: Path) -> None:
    """Rank r runs on node n{r+1} (its local leader); only n1 has an agent."""
    import contextlib

    work = job.parent
    env = _env(work, f"n{rank + 1}", "", conf=work / "c.yaml")
    out = work / f"out-{rank}"
    with (work / f"stderr-{rank}").open("w") as err, contextlib.redirect_stderr(err):
        try:
            mgr = CheckpointManager.from_env(env)
            out.write_text(json.dumps({"socket": mgr.agent_socket}))
        except CheckpointError as exc:
            out.write_text(json.dumps({"error": str(exc)}))


@pytest.mark.parametrize("policy", ["error", "local-only"])
def test_every_rank_names_the_node_whose_agent_is_missing(
        tmp_path: Path, n1_agent: tuple[AgentServer, list[dict[str, Any]]],
        policy: str) -> None:
    """Two nodes, n2's agent missing: both ranks raise (error) or warn (local-only) naming
    n2; with local-only n1's agent is told that n2's checkpoints never reach S3."""
    import dcp_ranks

    _env(tmp_path, "n1", f"{tmp_path}/{{node}}/agent.sock", policy=policy)  # the config
    assert dcp_ranks.run_ranks(_two_nodes, 2, tmp_path) == [0, 0]
    outs = [json.loads((tmp_path / f"out-{r}").read_text()) for r in (0, 1)]
    _, told = n1_agent
    if policy == "error":
        for out in outs:
            assert out["error"].startswith("checkpoint: register: couldn't reach the node "
                                           "agent on n2 ("), out
        assert [t["unreachable_nodes"] for t in told] == [[]]
        return
    assert outs[0]["socket"] == str(tmp_path / "n1" / "agent.sock") and outs[1]["socket"] is None
    for r in (0, 1):
        err = (tmp_path / f"stderr-{r}").read_text()
        assert "WARNING: couldn't reach the node agent on n2" in err, err
    assert [t["unreachable_nodes"] for t in told] == [[], ["n2"]]


def _one_node(rank: int, world: int, job: Path) -> None:
    """Both ranks run on n1, whose agent is there."""
    mgr = CheckpointManager.from_env(_env(job.parent, "n1", "", conf=job.parent / "c.yaml"))
    (job.parent / f"out-{rank}").write_text(json.dumps({"socket": mgr.agent_socket}))


def test_a_node_registers_once_whatever_its_ranks_local_rank_says(
        tmp_path: Path, n1_agent: tuple[AgentServer, list[dict[str, Any]]]) -> None:
    """Two ranks on one node (both claiming LOCAL_RANK 0) make one ckpt.register: the
    agent is asked once per node, not once per rank."""
    import dcp_ranks

    _env(tmp_path, "n1", f"{tmp_path}/{{node}}/agent.sock")  # the config
    assert dcp_ranks.run_ranks(_one_node, 2, tmp_path) == [0, 0]
    sock = str(tmp_path / "n1" / "agent.sock")
    assert [json.loads((tmp_path / f"out-{r}").read_text())["socket"] for r in (0, 1)] == \
        [sock, sock]
    _, told = n1_agent
    assert len(told) == 1 and told[0]["job_id"] == JOB and told[0]["uri"] == URI


# -- the reachable agent's side ---------------------------------------------------------------

ROOT = Peer(pid=1, uid=0, gid=0)


def test_the_reachable_agent_shows_the_missing_nodes(tmp_path: Path, s3: S3,
                                                     events: Path) -> None:
    """Told at register which of the job's nodes have no agent, the agent logs an error
    event, and ckpt status and its answer name those nodes; a bad list is refused."""
    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme",
        "  allowed_prefix: s3://ckpt/", "  stagein_intent_wait_s: 0"]) + "\n")
    (tmp_path / "nvme").mkdir(mode=0o755)
    create_job_dir(f"{tmp_path}/nvme", JOB, os.getuid(), os.getgid())
    up = Uploader(cfg, "n1", s3=s3)
    up.on_job_start({"job_id": JOB, "uid": os.getuid(), "gid": os.getgid(), "user": USER,
                     "uri": "s3://ckpt/run"}, ROOT)
    up.stageins[JOB].join()
    with pytest.raises(RequestError, match="unreachable_nodes must be a list"):
        up.on_register({"job_id": JOB, "uri": "s3://ckpt/run",
                        "unreachable_nodes": ["n 2"]}, ROOT)
    up.on_register({"job_id": JOB, "uri": "s3://ckpt/run", "unreachable_nodes": ["n3", "n2"]},
                   ROOT)
    st = up.on_status({"job_id": JOB}, ROOT)
    assert st["unreachable_nodes"] == ["n2", "n3"]
    assert ("  WARNING: the job's ranks couldn't reach the agent on n2, n3: checkpoints saved "
            "there stay there, so no step commits in S3 until it returns"
            ) in format_status(JOB, "n1", st)
    said = events_saying(events, "couldn't reach the node agent on other nodes")
    assert len(said) == 1 and said[0]["level"] == "error" and said[0]["nodes"] == ["n2", "n3"]
    up.close()


def test_ckpt_status_on_a_node_without_its_agent_says_its_checkpoints_stay_there(
        tmp_path: Path) -> None:
    """ckpt status asked of a node whose agent can't be reached says that the job's
    checkpoints there are not uploaded, naming the node and the cause."""
    import argparse

    from slurm_resilience.uploader.cli import run_status

    env = _env(tmp_path, "n7", f"{tmp_path}/{{node}}/agent.sock")
    args = argparse.Namespace(config=env["SLURM_RESILIENCE_CONFIG"], node="n7", job_id=JOB,
                              json=False)
    with pytest.raises(CheckpointError) as err:
        run_status(args)
    msg = str(err.value)
    assert msg.startswith("checkpoint: status: the agent on n7 can't be reached (agent: "
                          f"couldn't reach {tmp_path}/n7/agent.sock: "), msg
    assert f"job {JOB}'s checkpoints on n7 are not uploaded to S3" in msg


def test_an_agent_gone_after_register_is_said_on_the_next_save(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An agent that goes away during the job (after register) is said once on the local
    leader's stderr at the next save: this node's checkpoints are not uploaded."""
    import torch

    mgr = CheckpointManager(tmp_path, uri=URI, job_id=JOB,
                            agent_socket=str(tmp_path / "went-away.sock"))
    for step in (1, 2):
        mgr.save(step, {"w": torch.ones(4)})
        mgr.wait()
    err = capsys.readouterr().err
    assert err.count("checkpoint: WARNING: the node agent went away (") == 1, err
    assert f"this node's checkpoints are not uploaded to {URI} until it returns" in err
