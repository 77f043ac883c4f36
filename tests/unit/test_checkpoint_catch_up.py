"""Ranks that disagree on the newest step while it is committed in S3: the node whose
stage-in chose an older step fetches the newer one (``ckpt.stage``) and every rank loads
it, loudly; when the fetch fails every rank raises naming the node and the cause.

Real gloo ranks (forked, CPU), two node agents' checkpoint services on their own
sockets, and a real S3-protocol server (moto)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import threading
from collections.abc import Iterator
from pathlib import Path

import dcp_ranks
import pytest
from conftest import events_saying
from dcp_ranks import _dshard
from moto_s3 import copy_step, upload_step

from slurm_resilience.agent.server import AgentServer
from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint.commit import step_name
from slurm_resilience.checkpoint.manager import CheckpointError, CheckpointManager
from slurm_resilience.checkpoint.staging import create_job_dir
from slurm_resilience.config import Config, load_text
from slurm_resilience.uploader.journal import Journal, new_record
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.service import Uploader
from slurm_resilience.uploader.upload_requests import on_stage

JOB = 12
USER = pwd.getpwuid(os.getuid()).pw_name
RUN = f"{USER}/run"
ROOT = Peer(pid=1, uid=0, gid=0)
NODES = ("a", "b")  # rank 0 runs on a, rank 1 on b


def _config(work: Path) -> str:
    return "\n".join([
        "node:", f"  state_dir: {work}/{{node}}/state", "checkpoint:",
        f"  staging_root: {work}/{{node}}/nvme", "  allowed_prefix: s3://ckpt/{user}/",
        "  stagein_intent_wait_s: 0", "  stagein_retry_s: 1",
        "agent:", f"  socket: {work}/{{node}}/agent.sock"]) + "\n"


@contextlib.contextmanager
def _agents(work: Path, s3: S3) -> Iterator[dict[str, Uploader]]:
    """Each node's checkpoint service behind its own agent socket."""
    (work / "c.yaml").write_text(_config(work))
    ups: dict[str, Uploader] = {}
    servers: list[AgentServer] = []
    for node in NODES:
        (work / node / "nvme").mkdir(parents=True, mode=0o755)
        create_job_dir(f"{work}/{node}/nvme", JOB, os.getuid(), os.getgid())
        up = Uploader(load_text(Config, _config(work)), node, s3=s3)
        server = AgentServer(f"{work}/{node}/agent.sock")
        for op, handler in up.handlers().items():
            server.route(op, handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        ups[node] = up
        servers.append(server)
    try:
        yield ups
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for up in ups.values():
            up.close()


def _stage_in(up: Uploader) -> dict[str, object]:
    """The prolog's job start with the run URI, and its stage-in finished."""
    up.on_job_start({"job_id": JOB, "uid": os.getuid(), "gid": os.getgid(), "user": USER,
                     "uri": f"s3://ckpt/{RUN}"}, ROOT)
    up.stageins[JOB].join()
    return up.on_status({"job_id": JOB}, ROOT)


def save_5_and_10(rank: int, world: int, job: Path) -> None:
    """Steps 5 and 10 saved whole by both ranks (values 5.0 and 10.0)."""
    ckpt = CheckpointManager(job)
    for step in (5, 10):
        ckpt.save(step, _dshard(rank, world, float(step)))
    ckpt.close()


def load_on_two_nodes(rank: int, world: int, job: Path) -> None:
    """Rank r is node NODES[r]'s local leader; it loads the newest step and writes what it
    got (or the error) and its stderr."""
    work = job.parent
    env = {"SLURM_RESILIENCE_CONFIG": str(work / "c.yaml"), "SLURM_JOB_ID": str(JOB),
           "SLURMD_NODENAME": NODES[rank], "SLURM_RESILIENCE_CKPT_URI": f"s3://ckpt/{RUN}",
           "LOCAL_RANK": "0"}
    os.environ["SLURMD_NODENAME"] = NODES[rank]
    err = io.StringIO()
    out: dict[str, object] = {}
    with contextlib.redirect_stderr(err):
        dest = _dshard(rank, world, 0.0)
        try:
            got = CheckpointManager.from_env(env).load_latest(dest)
            out["step"] = None if got is None else got.step
            out["values"] = sorted(set(dest["w"].full_tensor().tolist()))
        except CheckpointError as exc:
            out["error"] = str(exc)
    (work / f"stderr-{rank}").write_text(err.getvalue())
    (work / f"out-{rank}").write_text(json.dumps(out))


def _lagging_b(tmp_path: Path, s3: S3, ups: dict[str, Uploader]) -> None:
    """Node b's stage-in chose its local step 5 (S3 had nothing yet); then step 10 is
    committed in S3 and node a's stage-in takes it from there."""
    assert dcp_ranks.run_ranks(save_5_and_10, 2, tmp_path) == [0, 0]
    copy_step(tmp_path / "job" / step_name(5), tmp_path / "b" / "nvme" / f"job-{JOB}")
    b = _stage_in(ups["b"])
    assert (b["stagein"], b["step"], b["source"]) == ("done", 5, "local"), b
    upload_step(s3, RUN, tmp_path / "job" / step_name(10))
    a = _stage_in(ups["a"])
    assert (a["stagein"], a["step"], a["source"]) == ("done", 10, "s3"), a


def _outs(tmp_path: Path) -> list[dict[str, object]]:
    return [json.loads((tmp_path / f"out-{r}").read_text()) for r in range(2)]


def test_a_node_behind_a_step_committed_in_s3_fetches_it_and_every_rank_loads_it(
        tmp_path: Path, s3: S3, events: Path) -> None:
    """Node b's stage-in chose step 5 while step 10 is committed in S3 (staged in on a):
    b's agent stages step 10 in, both ranks load step 10 whole, each warns on its stderr
    naming both steps and node b, and the log says so."""
    with _agents(tmp_path, s3) as ups:
        _lagging_b(tmp_path, s3, ups)
        assert dcp_ranks.run_ranks(load_on_two_nodes, 2, tmp_path) == [0, 0]
        b = ups["b"].on_status({"job_id": JOB}, ROOT)
    assert _outs(tmp_path) == [{"step": 10, "values": [10.0]}] * 2
    assert (b["stagein"], b["step"], b["source"]) == ("done", 10, "s3"), b
    for rank in range(2):
        err = (tmp_path / f"stderr-{rank}").read_text()
        assert "step 10 is committed in S3 (staged in for rank 0 on a) but the stage-in " \
               "for rank 1 on b chose step 5; fetching step 10 from S3 on b" in err, err
    said = events_saying(events, "staging the step the job's ranks agreed on")
    assert [(e["step"], e["staged"]) for e in said] == [(10, 5)], said
    ranks = events_saying(events, "the nodes that lack it stage it in through their node agent")
    assert sorted((e["rank"], e["step"], tuple(e["nodes"])) for e in ranks) == \
        [(0, 10, ("b",)), (1, 10, ("b",))], ranks


def test_a_failed_fetch_of_the_agreed_step_raises_on_every_rank_naming_node_and_cause(
        tmp_path: Path, s3: S3) -> None:
    """Step 10 gone from S3 before node b fetches it: every rank raises naming step 10,
    node b and why, and nothing older is loaded."""
    with _agents(tmp_path, s3) as ups:
        _lagging_b(tmp_path, s3, ups)
        s3.delete_keys("ckpt", [k for k in s3.list_keys("ckpt", "") if "step-00000010" in k])
        assert dcp_ranks.run_ranks(load_on_two_nodes, 2, tmp_path) == [0, 0]
    for out in _outs(tmp_path):
        err = str(out.get("error", ""))
        assert "step 10 is committed in S3 but couldn't be staged in on b: " in err, out
        assert "step 10 is not committed in s3://ckpt/" in err, out


@pytest.fixture(autouse=True)
def _no_node_name() -> Iterator[None]:
    """The ranks name their node in the environment; the test process keeps its own."""
    saved = os.environ.get("SLURMD_NODENAME")
    yield
    if saved is None:
        os.environ.pop("SLURMD_NODENAME", None)
    else:
        os.environ["SLURMD_NODENAME"] = saved


def test_ckpt_stage_takes_only_the_jobs_owner_a_step_number_and_a_run_uri(
        tmp_path: Path, s3: S3) -> None:
    """``ckpt.stage`` refuses another user's job, a step that is not a step number, a job
    without a run URI and a step the restore found corrupt; a repeat while it runs is a
    no-op."""
    with _agents(tmp_path, s3) as ups:
        up = ups["a"]
        up.on_job_start({"job_id": JOB, "uid": os.getuid(), "gid": os.getgid(),
                         "user": USER}, ROOT)
        owner = Peer(pid=2, uid=os.getuid(), gid=os.getgid())
        with pytest.raises(RequestError, match="has no run URI"):
            on_stage(up, {"job_id": JOB, "step": 10}, owner)
        other = Peer(pid=3, uid=os.getuid() + 4242, gid=0)
        with pytest.raises(RequestError, match="not to you"):
            on_stage(up, {"job_id": JOB, "step": 10}, other)
        assert _stage_in(up)["stagein"] == "done"
        for bad in (-1, True, "10", None):
            with pytest.raises(RequestError, match="is not a step number"):
                on_stage(up, {"job_id": JOB, "step": bad}, owner)
        up.jobs[JOB]["stagein_excluded"] = {"10": "a block's CRC32C"}
        with pytest.raises(RequestError, match="found step 10 corrupt"):
            on_stage(up, {"job_id": JOB, "step": 10}, owner)
        assert up.jobs[JOB].get("stagein_wanted") is None


def test_a_journal_record_keeps_a_wanted_step_and_drops_a_misshaped_one(
        tmp_path: Path) -> None:
    """The step ``ckpt.stage`` asked for survives an agent restart; anything but a step
    number there is dropped (and the record quarantined), so stage-in takes the newest."""
    d = tmp_path / "journal"
    d.mkdir(mode=0o700)
    for job, wanted in ((1, 10), (2, "ten"), (3, -1)):
        rec = {**new_record(job, 1000, 1000, "alice", "/nvme"), "uri": "s3://b/alice/r",
               "stagein_wanted": wanted}
        (d / f"job-{job}.json").write_text(json.dumps(rec))
    recs = Journal(d).load_all()
    assert [recs[j].get("stagein_wanted") for j in (1, 2, 3)] == [10, None, None]
