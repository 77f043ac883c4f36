"""Unit tests of the root side: run directories, slot ownership checks, evidence, the watcher."""

from __future__ import annotations

import json
import os
import pickle
import select
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import start_sleeper

from slurm_resilience import safefs
from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.config import Config
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.config.schema import JobTmpfsSection, NodeSection
from slurm_resilience.hang import evidence, jobrecord, steps
from slurm_resilience.hang.watcher import HangWatcher, read_slots
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.heartbeat.writer import Heartbeat, process_start_ticks
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.proc import Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeClock

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks need root")

OTHER_UID = 65534  # nobody
NODE = "node1"


def FrozenClock() -> FakeClock:
    """Both clocks stand still but when advanced: step times are exactly what a test says."""
    return FakeClock(time.monotonic(), wall=time.time())


def _watcher(cfg: Config, runner: object, clock: FakeClock, node: str = NODE) -> HangWatcher:
    return HangWatcher(cfg, node, SlurmAdapter(runner=runner),  # type: ignore[arg-type]
                       clock=clock, sleep=clock.sleep, config_path="")


def _cfg(tmp_path: Path, **hb: object) -> Config:
    # No network listener in unit tests: the shared directory when one is given, else none.
    hb.setdefault("rendezvous", "directory" if "rendezvous_dir" in hb else "none")
    # Plain run dirs: these tests are about slots; the job's tmpfs has test_heartbeat_run_dir.
    return Config(node=NodeSection(state_dir=str(tmp_path / "state"),
                                   run_dir=str(tmp_path / "run"),
                                   job_tmpfs=JobTmpfsSection(enabled=False)),
                  heartbeat=replace(HeartbeatSection(step_timeout_s=1.0, warmup_timeout_s=1.0,
                                                     warmup_steps=0, min_timeout_s=0.5,
                                                     evidence_timeout_s=10,
                                                     rendezvous_wait_s=0), **hb))


def _ctx(cfg: Config, job_id: int = 42, uid: int = OTHER_UID) -> HookContext:
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_UID": str(uid), "SLURM_JOB_GID": str(uid),
           "SLURM_JOB_NODELIST": "node[1-2]"}
    return HookContext.from_env("prolog", cfg, env, node=NODE)


def test_prolog_creates_private_user_dir_and_root_record(tmp_path: Path) -> None:
    """The prolog makes job-<id> owned by the user with mode 0700, and a root-owned record."""
    cfg = _cfg(tmp_path)
    assert steps.prolog_run_dir(_ctx(cfg)) == []
    st = os.stat(P.job_dir(cfg.node.run_dir, NODE, 42))
    assert (st.st_uid, st.st_mode & 0o777) == (OTHER_UID, 0o700)
    records, errors = jobrecord.read_all(P.records_dir(cfg.node.run_dir, NODE))
    assert errors == [] and records[0].uid == OTHER_UID and records[0].nodes == ("node1", "node2")


def test_job_records_are_typed_when_read(tmp_path: Path) -> None:
    """A record reads back field for field; one whose uid is a bool or whose start time is
    text is reported by name (int(True) made it uid 1 before), and the others still load."""
    cfg = _cfg(tmp_path)
    records_dir = P.records_dir(cfg.node.run_dir, NODE)
    good = jobrecord.JobRecord(42, OTHER_UID, OTHER_UID, "u", 1.5, ("node1",))
    jobrecord.write(records_dir, good)
    for job_id, bad in ((43, {"uid": True}), (44, {"started": "yesterday"})):
        doc = {**jobrecord.JobRecord(job_id, 0, 0, "r", 2.0).to_json(), **bad}
        fd = os.open(records_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            safefs.replace_file(fd, f"{job_id}.json", json.dumps(doc).encode())
        finally:
            os.close(fd)
    records, errors = jobrecord.read_all(records_dir)
    assert records == [good]
    assert sorted(e.split(".json: ", 1)[-1] for e in errors) == [
        "job record: started 'yesterday' is not a time",
        "job record: uid True is not a non-negative integer"]


def test_prolog_refuses_a_symlinked_run_dir(tmp_path: Path) -> None:
    """A symlink on the way to the run directory is not followed: nothing is created there."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "run").symlink_to(target)
    problems = steps.prolog_run_dir(_ctx(_cfg(tmp_path)))
    assert problems and "couldn't create heartbeat dir" in problems[0].reason
    assert list(target.iterdir()) == []


def test_epilog_removes_dir_without_following_links(tmp_path: Path) -> None:
    """Cleanup deletes the job's dir and record but not what a planted symlink points to."""
    cfg = _cfg(tmp_path)
    steps.prolog_run_dir(_ctx(cfg))
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    jobdir = Path(P.job_dir(cfg.node.run_dir, NODE, 42))
    (jobdir / "link").symlink_to(outside)
    (jobdir / "sub").mkdir()
    (jobdir / "sub" / "link2").symlink_to(outside / "keep.txt")
    steps.epilog_run_dir(_ctx(cfg))
    assert not jobdir.exists() and (outside / "keep.txt").read_text() == "x"
    assert jobrecord.read_all(P.records_dir(cfg.node.run_dir, NODE))[0] == []


def _record(uid: int, job_id: int = 42) -> jobrecord.JobRecord:
    return jobrecord.JobRecord(job_id, uid, uid, "u", time.time(), (NODE,))


def test_slots_not_owned_by_the_job_user_are_refused(tmp_path: Path) -> None:
    """Only regular slot files owned by the job user count: others' files and links are refused."""
    cfg = _cfg(tmp_path)
    steps.prolog_run_dir(_ctx(cfg))
    jobdir = Path(P.job_dir(cfg.node.run_dir, NODE, 42))
    good = Heartbeat(str(jobdir / "hb-rank-0.slot"), rank=0, world_size=3, job_id=42)
    os.chown(jobdir / "hb-rank-0.slot", OTHER_UID, OTHER_UID)
    Heartbeat(str(jobdir / "hb-rank-1.slot"), rank=1, world_size=3, job_id=42)  # root-owned
    (jobdir / "hb-rank-2.slot").symlink_to(jobdir / "hb-rank-0.slot")
    views, errors = read_slots(cfg.node.run_dir, NODE, _record(OTHER_UID))
    assert [v.rank for v in views] == [0]
    assert any("hb-rank-1.slot" in e and "owned by uid 0" in e for e in errors)
    assert any("hb-rank-2.slot" in e for e in errors)
    good.close()


def test_job_dir_with_wrong_owner_or_mode_is_ignored(tmp_path: Path) -> None:
    """A run dir not owned by the job's user, or open to others, yields no slots at all."""
    cfg = _cfg(tmp_path)
    steps.prolog_run_dir(_ctx(cfg))
    jobdir = Path(P.job_dir(cfg.node.run_dir, NODE, 42))
    jobdir.chmod(0o755)
    views, errors = read_slots(cfg.node.run_dir, NODE, _record(OTHER_UID))
    assert views == [] and "mode 755" in errors[0]
    views, errors = read_slots(cfg.node.run_dir, NODE, _record(1234))
    assert views == [] and "expected 1234" in errors[0]


def test_same_process_checks_start_time_and_uid() -> None:
    """A pid is only trusted with the slot's start time and the job's uid (no pid reuse, no
    other user's process)."""
    me, start = os.getpid(), process_start_ticks()
    assert evidence.same_process(me, start, os.getuid())
    assert not evidence.same_process(me, start + 1, os.getuid())
    assert not evidence.same_process(me, start, OTHER_UID)
    assert not evidence.same_process(1, 0, 0)


def test_nccl_dump_is_copied_as_bytes_never_unpickled(tmp_path: Path) -> None:
    """The flight recorder is triggered through the job's FIFO and its dump kept as opaque
    bytes, under a name of its job, run and node; a name another capture took is left alone
    and the dump kept under a new one."""
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Boom(str(marker)))
    pipe_prefix, dump_prefix = tmp_path / "nccl_pipe_", tmp_path / "nccl_trace_"
    os.mkfifo(f"{pipe_prefix}3.pipe")

    # Open before the trigger: a FIFO without a reader refuses the agent's non-blocking write.
    pipe_fd = os.open(f"{pipe_prefix}3.pipe", os.O_RDONLY | os.O_NONBLOCK)

    def pytorch_side() -> None:  # what PyTorch's watchdog does: read the pipe, write the dump
        select.select([pipe_fd], [], [], 10)
        os.read(pipe_fd, 1)
        os.close(pipe_fd)
        Path(f"{dump_prefix}3").write_bytes(payload)

    reader = threading.Thread(target=pytorch_side)
    reader.start()
    env = {**os.environ, evidence.NCCL_PIPE_ENV: str(pipe_prefix),
           evidence.NCCL_FILE_ENV: str(dump_prefix)}
    proc = start_sleeper(env)
    try:
        save = tmp_path / "saved"
        save.mkdir()
        prefix = evidence.trace_prefix(42, 1, "node/1")
        assert prefix == "nccl-trace-job42-run1-node_1"
        (save / f"{prefix}-rank3.bin").write_bytes(b"an earlier capture's dump")
        fd = os.open(save, os.O_RDONLY | os.O_DIRECTORY)
        result = evidence.nccl_flight_recorder(proc.pid, 3, os.getuid(), fd, wait_s=5,
                                               clock=_UntilDone(reader), poll_s=0.01,
                                               save_prefix=prefix)
        os.close(fd)
    finally:
        proc.kill()
        proc.wait()
        reader.join(5)
    assert result.get("bytes") == len(payload), result
    assert result.get("saved_as") == f"{prefix}-rank3.1.bin", result
    assert (save / f"{prefix}-rank3.1.bin").read_bytes() == payload
    assert (save / f"{prefix}-rank3.bin").read_bytes() == b"an earlier capture's dump"
    assert not marker.exists()


def test_a_dump_that_could_not_be_kept_names_no_file(tmp_path: Path) -> None:
    """Every candidate name taken, or the directory refusing the write: no saved_as, and
    save_error says why."""
    save = tmp_path / "saved"
    save.mkdir()
    for n in range(evidence.SAVE_ATTEMPTS):
        (save / (f"t-rank0.{n}.bin" if n else "t-rank0.bin")).write_bytes(b"other")
    fd = os.open(save, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert evidence.save_trace(fd, "t-rank0", b"mine")[0] == ""
        assert "names taken" in evidence.save_trace(fd, "t-rank0", b"mine")[1]
        assert evidence.save_trace(fd, "t-rank1", b"mine") == ("t-rank1.bin", "")
    finally:
        os.close(fd)
    name, error = evidence.save_trace(-1, "t-rank2", b"mine")  # a bad directory: EBADF
    assert name == "" and error.startswith("couldn't keep the dump as t-rank2.bin")
    assert {p.read_bytes() for p in save.iterdir() if p.name.startswith("t-rank0")} == {
        b"other"}


class _UntilDone(FakeClock):
    """A clock that stands still while ``thread`` runs and for a few polls after it ends, then
    jumps past any deadline: the wait is bounded by the writer's progress, not by how busy
    the machine is."""

    def __init__(self, thread: threading.Thread, polls_after: int = 3) -> None:
        super().__init__()
        self.thread, self.left = thread, polls_after

    def monotonic(self) -> float:
        if self.thread.is_alive():
            return 0.0
        self.left -= 1
        return 0.0 if self.left >= 0 else 1e9


class _Boom:
    """Unpickling this would create a marker file: proof that nothing was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


class FakeRunner:
    """Answers ``scontrol`` like slurmctld for one running job; records every argv."""

    def __init__(self, job_id: int, batch_host: str, comment: str = ""):
        self.job_id, self.batch_host, self.comment = job_id, batch_host, comment
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        if list(argv[1:]) == ["--version"]:  # the adapter reads 22.05's text form
            return Completed(tuple(argv), 0, "slurm 22.05.8\n", "", 0.0)
        self.calls.append(list(argv))
        out = ""
        if argv[1:3] == ["show", "job"]:
            out = (f"JobId={self.job_id} JobName=t UserId=root(0) JobState=RUNNING Restarts=0 "
                   f"BatchHost={self.batch_host} NodeList=node1 NumNodes=1 "
                   f"Requeue=1 AdminComment={self.comment or '(null)'} "
                   "StdOut=/nonexistent/x.out")
        elif argv[1:3] == ["show", "node"]:
            out = f"NodeName={argv[3]} State=MIXED CPUTot=2 CPUAlloc=2 Reason=(null)"
        return Completed(tuple(argv), 0, out, "", 0.0)


HANGER = textwrap.dedent("""
    import sys, time
    from slurm_resilience.heartbeat.writer import Heartbeat
    rank, world = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 2 else (0, 1)
    hb = Heartbeat(sys.argv[1], rank=rank, world_size=world, job_id=42)
    for step in range(3):
        hb.beat(step)
        time.sleep(0.05)
    print("hanging", flush=True)
    def stuck_forever():
        time.sleep(600)
    stuck_forever()
""")


def _hanging_job(tmp_path: Path, cfg: Config) -> subprocess.Popen[bytes]:
    steps.prolog_run_dir(_ctx(cfg, uid=0))
    slot = Path(P.job_dir(cfg.node.run_dir, NODE, 42)) / "hb-rank-0.slot"
    proc = subprocess.Popen([sys.executable, "-c", HANGER, str(slot)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"hanging\n"
    return proc


def test_watcher_detects_hang_captures_stack_and_requeues(tmp_path: Path) -> None:
    """A rank that stops beating is found, its stack dumped, and the job requeued once."""
    cfg = _cfg(tmp_path)
    runner = FakeRunner(42, NODE)
    clock = FakeClock(real=True)
    watcher = _watcher(cfg, runner, clock)
    proc = _hanging_job(tmp_path, cfg)
    try:
        clock.advance(1.3)
        watcher.tick()
        assert [r.state for r in watcher.jobs[42].verdict.ranks] == ["hung"]
        watcher.wait()
        watcher.tick()  # the same run is never handled twice
        watcher.wait()
    finally:
        proc.kill()
        proc.wait()
    requeues = [c for c in runner.calls if c[1] == "requeue"]
    assert requeues == [["scontrol", "requeue", "42"]]
    report = json.loads(next((tmp_path / "state" / "incidents").glob("*.json")).read_text())
    assert report["decision"]["action"] == "requeue"
    assert "stuck_forever" in report["evidence"][NODE]["ranks"][0]["stack"]
    text = next((tmp_path / "state" / "incidents").glob("*.txt")).read_text()
    assert "rank    0 on node1" in text and "stuck_forever" in text


def test_observe_mode_reports_without_acting(tmp_path: Path) -> None:
    """In observe mode the incident is written but nothing is drained or requeued."""
    cfg = _cfg(tmp_path, mode="observe")
    runner = FakeRunner(42, NODE)
    clock = FakeClock(real=True)
    watcher = _watcher(cfg, runner, clock)
    proc = _hanging_job(tmp_path, cfg)
    try:
        clock.advance(1.3)
        watcher.tick()
        watcher.wait()
    finally:
        proc.kill()
        proc.wait()
    assert not [c for c in runner.calls if c[1] in ("requeue", "requeuehold", "update")]
    report = json.loads(next((tmp_path / "state" / "incidents").glob("*.json")).read_text())
    assert report["decision"]["action"] == "report"


def test_other_users_cannot_report_or_see_a_job(tmp_path: Path) -> None:
    """hang.report from a uid other than the job's is refused in the same words as for a job
    not watched at all (no ownership oracle); hang.status hides the job."""
    cfg = _cfg(tmp_path)
    steps.prolog_run_dir(_ctx(cfg))
    watcher = _watcher(cfg, FakeRunner(42, NODE), FakeClock(real=True))
    watcher.tick()
    with pytest.raises(RequestError) as theirs:
        watcher.handle_report({"job_id": 42}, Peer(pid=1, uid=1234, gid=1234))
    with pytest.raises(RequestError) as none:
        watcher.handle_report({"job_id": 43}, Peer(pid=1, uid=1234, gid=1234))
    assert str(theirs.value) == f"no job 42 of uid 1234 is watched on {NODE}"
    assert str(none.value) == str(theirs.value).replace("42", "43")
    assert "65534" not in str(theirs.value)
    assert watcher.handle_status({}, Peer(pid=1, uid=1234, gid=1234))["jobs"] == []
    assert watcher.handle_status({}, Peer(pid=1, uid=OTHER_UID, gid=1))["jobs"][0]["job_id"] == 42


def test_two_agents_racing_on_one_hang_requeue_once(tmp_path: Path) -> None:
    """Two watchers (an agent and its restarted twin) seeing the same hang requeue it once."""
    cfg = _cfg(tmp_path)
    runner = FakeRunner(42, NODE)
    clock = FakeClock(real=True)
    first = _watcher(cfg, runner, clock)
    second = _watcher(cfg, runner, clock)
    proc = _hanging_job(tmp_path, cfg)
    try:
        clock.advance(1.3)
        threads = [threading.Thread(target=w.tick) for w in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first.wait()
        second.wait()
    finally:
        proc.kill()
        proc.wait()
    assert [c for c in runner.calls if c[1] == "requeue"] == [["scontrol", "requeue", "42"]]


def test_auto_tuned_timeout_survives_an_agent_restart(tmp_path: Path) -> None:
    """The auto-tuned step timeout is persisted per job and read back by a new watcher."""
    cfg = _cfg(tmp_path, auto_tune=True, auto_tune_min_steps=2, auto_tune_factor=10,
               nccl_timeout_s=600, nccl_margin_s=60)
    steps.prolog_run_dir(_ctx(cfg, uid=0))
    slot = Path(P.job_dir(cfg.node.run_dir, NODE, 42)) / "hb-rank-0.slot"
    clock = FrozenClock()
    hb = Heartbeat(str(slot), rank=0, world_size=1, job_id=42, clock=clock)
    for step, dt in enumerate([5.0, 0.1, 0.3, 0.2]):  # the first interval is start-up
        clock.advance(dt)
        hb.beat(step)
    watcher = _watcher(cfg, FakeRunner(42, NODE), clock)
    watcher.tick()
    tuned = watcher.jobs[42].verdict.tuned_timeout_s
    assert tuned == pytest.approx(0.3 * 10)  # the slowest step times auto_tune_factor
    again = _watcher(cfg, FakeRunner(42, NODE), FakeClock(real=True))
    assert again.tuned.get(42) == tuned
    hb.close()


def test_old_markers_and_tuned_timeouts_are_cleaned_up(tmp_path: Path) -> None:
    """Act markers and tuned timeouts older than the retention are removed; fresh ones stay."""
    cfg = _cfg(tmp_path)
    watcher = _watcher(cfg, FakeRunner(42, NODE), FakeClock(real=True))
    assert watcher.store.claim(7, 0, 0.0) and not watcher.store.claim(7, 0, 0.0)
    watcher.tuned.save(7, 12.0)
    watcher.tuned.save(8, 12.0)
    old = time.time() - 30 * 86400
    os.utime(Path(watcher.state_dir) / "acted" / "7-0", (old, old))
    os.utime(Path(watcher.state_dir) / "tune-7.json", (old, old))
    assert watcher.cleanup(time.time() - 14 * 86400) == 2
    assert sorted(p.name for p in Path(watcher.state_dir).glob("tune-*")) == ["tune-8.json"]


BEATER = textwrap.dedent("""
    import sys, time
    from slurm_resilience.heartbeat.writer import Heartbeat
    hb = Heartbeat(sys.argv[1], rank=0, world_size=2, job_id=42)
    print("beating", flush=True)
    step = 0
    while True:
        hb.beat(step)
        step += 1
        time.sleep(0.05)
""")


class TwoNodeRunner(FakeRunner):
    """A job on node[1-2] whose batch host is node1."""

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        out = super().run(argv, timeout=timeout, check=check)
        text = out.stdout.replace("NodeList=node1 NumNodes=1", "NodeList=node[1-2] NumNodes=2")
        return Completed(out.argv, 0, text, "", 0.0)


def test_batch_host_acts_on_a_hang_published_by_another_node(tmp_path: Path) -> None:
    """Rank 1 on node2 hangs while rank 0 on the batch host keeps beating: node2's agent
    publishes it, the batch host's agent blames node2 (lowest step) and requeues once."""
    cfg = Config(node=NodeSection(state_dir=str(tmp_path / "{node}" / "state"),
                                  run_dir=str(tmp_path / "{node}" / "run"),
                                  job_tmpfs=JobTmpfsSection(enabled=False)),
                 heartbeat=HeartbeatSection(step_timeout_s=1.0, warmup_timeout_s=1.0,
                                            warmup_steps=0, min_timeout_s=0.5,
                                            evidence_timeout_s=10, rendezvous_wait_s=2,
                                            rendezvous="directory",
                                            rendezvous_dir=str(tmp_path / "rdv")))
    runner = TwoNodeRunner(42, "node1")
    procs = []
    for node, code in (("node1", BEATER), ("node2", HANGER)):
        ctx = _ctx(cfg, uid=0)
        ctx.node = node
        steps.prolog_run_dir(ctx)
        rank = 0 if node == "node1" else 1
        slot = Path(P.job_dir(cfg.node.run_dir, node, 42)) / f"hb-rank-{rank}.slot"
        argv = [sys.executable, "-c", code, str(slot), str(rank), "2"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE))
        assert procs[-1].stdout is not None and procs[-1].stdout.readline()
    clocks = {n: FakeClock(real=True) for n in ("node1", "node2")}
    watchers = {n: _watcher(cfg, runner, clocks[n], n) for n in ("node1", "node2")}
    try:
        clocks["node2"].advance(1.3)  # node2's rank stalled; node1's keeps beating
        watchers["node2"].tick()
        watchers["node2"].wait()
        watchers["node1"].tick()
        watchers["node1"].wait()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    acts = [c[1:] for c in runner.calls if c[1] in ("requeue", "requeuehold", "update")]
    assert acts[0][:2] == ["update", "NodeName=node2"] and "suspect hang job 42" in acts[0][3]
    assert [a[0] for a in acts[1:]] == ["update", "requeuehold", "update", "update"]
    assert acts[-1] == ["update", "JobId=42", "ExcNodeList=node2"]
    report = json.loads(next((tmp_path / "node1" / "state" / "incidents").glob("*.json"))
                        .read_text())
    assert report["trigger"] == "hang seen on node2"
    assert report["blame"]["nodes"] == ["node2"] and report["blame"]["rule"] == "lowest step"
    assert [(c["node"], c["verdict"]) for c in report["decision"]["nodes"]] == [
        ("node2", "suspect")]


def test_observations_left_by_an_earlier_run_are_ignored(tmp_path: Path) -> None:
    """A requeued job's new node does not act on rendezvous pieces older than its prolog."""
    cfg = _cfg(tmp_path, rendezvous_dir=str(tmp_path / "rdv"))
    old_piece = tmp_path / "rdv" / "job-42" / "run-0" / "node9.json"
    old_piece.parent.mkdir(parents=True)
    old_piece.write_text("{}")
    past = time.time() - 60
    os.utime(old_piece, (past, past))
    steps.prolog_run_dir(_ctx(cfg, uid=0))
    runner = FakeRunner(42, NODE)
    watcher = _watcher(cfg, runner, FakeClock(real=True))
    watcher.tick()
    watcher.wait()
    assert [c for c in runner.calls if c[1:3] != ["show", "node"]] == []
    assert not watcher.store.seen


class SpareRunner(FakeRunner):
    """The job holds node1 and node2 (its spare)."""

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        done = super().run(argv, timeout=timeout, check=check, input_text=input_text, env=env)
        return replace(done, stdout=done.stdout.replace("NodeList=node1 NumNodes=1",
                                                        "NodeList=node[1-2] NumNodes=2"))


def test_a_registered_launcher_is_ordered_to_relaunch_instead_of_a_requeue(
        tmp_path: Path) -> None:
    """With the job's launcher registered (a spare in the job, passing the gate), the hang
    is decided as a relaunch: no requeue, an order for relaunch 1 on the spare, and the
    ledger records the attempt; the launcher's next registration ends the order."""
    cfg = _cfg(tmp_path)
    runner = SpareRunner(42, NODE)
    clock = FakeClock(real=True)  # the hanging job's slot carries real times
    watcher = _watcher(cfg, runner, clock)
    proc = _hanging_job(tmp_path, cfg)
    owner = Peer(pid=1, uid=0, gid=0)  # the job's user here (the prolog ran it as uid 0)
    try:
        watcher.tick()
        watcher.handle_launch_register({"job_id": 42, "relaunch": 0, "nodes": ["node1"],
                                        "spares": ["node2"], "max_restarts": 3}, owner)
        clock.advance(1.3)
        watcher.tick()
        watcher.wait()
    finally:
        proc.kill()
        proc.wait()
    assert not [c for c in runner.calls if c[1] in ("requeue", "requeuehold")], runner.calls
    report = json.loads(next((tmp_path / "state" / "incidents").glob("*.json")).read_text())
    assert report["decision"]["action"] == "relaunch", report["decision"]
    order = watcher.handle_launch_poll({"job_id": 42}, owner)["order"]
    assert isinstance(order, dict) and order["relaunch"] == 1
    blamed = [c["node"] for c in report["decision"]["nodes"]]
    assert order["nodes"] == (["node2"] if blamed == ["node1"] else ["node1"]), report
    assert "restart=0]" in report["decision"]["ledger"]
    watcher.handle_launch_register({"job_id": 42, "relaunch": 1, "nodes": order["nodes"],
                                    "spares": [], "max_restarts": 3}, owner)
    assert watcher.handle_launch_poll({"job_id": 42}, owner) == {"order": None}


class _Deaths:
    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []

    def rank_died(self, job_id: int, ranks: Sequence[int]) -> bool:
        self.seen.append((job_id, list(ranks)))
        return True


def test_a_rank_that_dies_here_has_the_node_checked_once(tmp_path: Path) -> None:
    """Running, then its process gone before it finished: the node's health check is asked
    for (deathcheck.py). A rank already dead when first seen (an agent that started after
    the job's end) asks nothing; nor does a rank seen dead again."""
    cfg = _cfg(tmp_path)
    clock = FrozenClock()
    watcher = _watcher(cfg, FakeRunner(42, NODE), clock)
    deaths = watcher.death_check = _Deaths()  # type: ignore[assignment]
    proc = _hanging_job(tmp_path, cfg)
    try:
        watcher.tick()
        assert [r.state for r in watcher.jobs[42].verdict.ranks] == ["ok"]
    finally:
        proc.kill()
        proc.wait()
    watcher.tick()
    assert [r.state for r in watcher.jobs[42].verdict.ranks] == ["dead"]
    watcher.tick()
    assert deaths.seen == [(42, [0])]
    late = _watcher(cfg, FakeRunner(42, NODE), clock)
    late.death_check = _Deaths()  # type: ignore[assignment]
    late.tick()
    late.tick()
    assert late.death_check.seen == []  # type: ignore[attr-defined]
