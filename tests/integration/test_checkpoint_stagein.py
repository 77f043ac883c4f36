"""Stage-in and ``ckpt.fetch`` against a real S3 endpoint (``rclone serve s3``), with real
agent sockets and restores asked for by processes running as unprivileged test users.

Each "node" is the agent's checkpoint service with its own staging root and socket.
Steps are built the way the training side writes them (ChecksummingWriter and
commit_part: manifests with per-block CRC32C, a ``.metadata`` in rank 0). Faults
are real protocol-level ones from the S3 fault proxy (503 SlowDown, refused
connections).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import random
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_state import BuddyWatcher, JobNodes
from conftest import free_port, rclone

from slurm_resilience import events, log
from slurm_resilience.agent.server import AgentServer
from slurm_resilience.agent.service import Peer
from slurm_resilience.checkpoint.blocks import BLOCK_SIZE, covering
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    ChecksummingWriter,
    CommitMarker,
    Manifest,
    begin_part,
    commit_part,
    rank_name,
    step_name,
    write_commit_marker,
)
from slurm_resilience.checkpoint.quota import Quota
from slurm_resilience.checkpoint.staging import create_job_dir
from slurm_resilience.config import Config, load_text
from slurm_resilience.sandbox.s3faults import S3FaultProxy
from slurm_resilience.uploader.announce import announce_now
from slurm_resilience.uploader.buddy_peers import Staged
from slurm_resilience.uploader.buddy_service import BuddyService
from slurm_resilience.uploader.buddy_source import Choice
from slurm_resilience.uploader.buddy_store import JobFacts, Offer
from slurm_resilience.uploader.records import BackOff
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.service import Uploader, s3_settings

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
ROOT = Peer(pid=1, uid=0, gid=0)
MIB = 1024 * 1024
FILE = 12 * MIB + 4096  # several whole blocks and one short one per rank file
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent side runs as root")

USER_SCRIPT = """
import json, sys
from slurm_resilience.checkpoint.agent_ranges import AgentRanges
from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.checkpoint.ranges import ByteRange
sock, job, step, ranges = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
try:
    AgentRanges(sock, job, timeout_s=120).ensure(step, [ByteRange(*r) for r in ranges])
except CheckpointError as exc:
    print(exc)
    sys.exit(3)
print("ok")
"""


def _traversable(path: Path) -> None:
    """Others may traverse ``path`` and its parents (test users run this checkout's venv)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


@dataclass
class World:
    base: Path
    s3_dir: Path
    port: int
    key: str
    secret: str
    proxy: S3FaultProxy
    s3: S3  # straight to the endpoint, for the test's own writes


@pytest.fixture
def world(test_users: tuple[str, ...]) -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="sr-stagein-"))
    base.chmod(0o755)
    _traversable(REPO)
    s3_dir = base / "s3"
    (s3_dir / "ckpt").mkdir(parents=True)
    port, key, secret = free_port(), secrets.token_hex(8), secrets.token_hex(16)
    proc = subprocess.Popen(
        [rclone(), "serve", "s3", str(s3_dir), "--addr", f"127.0.0.1:{port}",
         "--auth-key", f"{key},{secret}", "--config", "/dev/null"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            break
        time.sleep(0.1)
    creds = base / "s3-keys"
    creds.write_text(f"{key} {secret}\n")
    creds.chmod(0o600)
    proxy = S3FaultProxy(port)
    proxy.accept()
    direct = S3(s3_settings(_cfg(base, "direct", f"http://127.0.0.1:{port}")))
    try:
        yield World(base, s3_dir, port, key, secret, proxy, direct)
    finally:
        proxy.refuse()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)


def _cfg(base: Path, node: str, endpoint: str, **extra: object) -> Config:
    settings: dict[str, object] = {
        "staging_root": f"{base}/{node}/nvme", "allowed_prefix": "s3://ckpt/{user}/",
        "s3_endpoint": endpoint, "s3_credentials_file": f"{base}/s3-keys", "part_size": "5MiB",
        "concurrency": 4, "retry_initial_s": 0.05, "retry_max_s": 0.2, "request_timeout_s": 3,
        "stagein_retry_s": 3, "stagein_intent_wait_s": 1, "fetch_concurrency": 4, **extra}
    lines = ["node:", f"  state_dir: {base}/{node}/state", "checkpoint:"]
    lines += [f"  {k}: {v}" for k, v in settings.items()]
    return load_text(Config, "\n".join(lines) + "\n")


@dataclass
class Node:
    name: str
    up: Uploader
    sock: str
    server: AgentServer

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.up.close()


@contextlib.contextmanager
def _nodes(w: World, names: list[str], **extra: object) -> Iterator[list[Node]]:
    out = []
    for name in names:
        (w.base / name).mkdir(exist_ok=True)
        (w.base / name).chmod(0o755)
        up = Uploader(_cfg(w.base, name, w.proxy.url, **extra), name)
        run = w.base / name / "run"
        run.mkdir(mode=0o755, exist_ok=True)
        server = AgentServer(str(run / "agent.sock"), max_bytes=65536, io_timeout=60)
        for op, handler in up.handlers().items():
            server.route(op, handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        out.append(Node(name, up, str(run / "agent.sock"), server))
    try:
        yield out
    finally:
        for n in out:
            n.close()


def _start_job(node: Node, w: World, job: int, user: str, uri: str) -> dict[str, object]:
    pw = pwd.getpwnam(user)
    create_job_dir(f"{w.base}/{node.name}/nvme", job, pw.pw_uid, pw.pw_gid)
    node.up.on_job_start({"job_id": job, "uid": pw.pw_uid, "gid": pw.pw_gid, "user": user},
                         ROOT)
    node.up.on_register({"job_id": job, "uri": uri}, Peer(pid=2, uid=pw.pw_uid, gid=pw.pw_gid))
    return _wait_stagein(node, job)


def _wait_stagein(node: Node, job: int) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = node.up.on_status({"job_id": job}, ROOT)
        if st["stagein"] in ("done", "failed"):
            return st
        time.sleep(0.05)
    raise AssertionError("stage-in did not finish")


def _build_step(w: World, run: str, step: int, world_size: int, seed: int,
                save_id: str = "") -> Path:
    """A committed step as the training side writes it, in a scratch dir of the test."""
    src = w.base / "src" / run.replace("/", "_")
    src.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for rank in range(world_size):
        tmp = begin_part(src, step, rank)
        entries = []
        names = ["data.distcp", ".metadata"] if rank == 0 else ["data.distcp"]
        for name in names:
            writer = ChecksummingWriter(tmp / name)
            writer.write(rng.randbytes(FILE if name == "data.distcp" else 4096))
            entries.append(writer.close())
        commit_part(tmp, step, rank, known=entries, save_id=save_id)
    write_commit_marker(src, step, world_size, save_id or None)
    return src / step_name(step)


def _upload(w: World, run: str, sdir: Path, commit: bool = True, only: str = "") -> None:
    """Put a built step (or its files under ``only``) into S3 (COMMIT.json last, or not)."""
    for path in sorted(p for p in sdir.rglob("*") if p.is_file() and p.name != COMMIT
                       and p.relative_to(sdir).as_posix().startswith(only)):
        key = f"{run}/{sdir.name}/{path.relative_to(sdir).as_posix()}"
        w.s3.client.put_object(Bucket="ckpt", Key=key, Body=path.read_bytes())
    if commit:
        w.s3.client.put_object(Bucket="ckpt", Key=f"{run}/{sdir.name}/{COMMIT}",
                               Body=(sdir / COMMIT).read_bytes())


def _copy_part(sdir: Path, rank: int, job_dir: Path, user: str, with_commit: bool) -> None:
    """A rank part this node saved itself (owned by the job's user)."""
    dest = job_dir / sdir.name
    shutil.copytree(sdir / f"rank-{rank:05d}", dest / f"rank-{rank:05d}")
    if with_commit:
        shutil.copy(sdir / COMMIT, dest / COMMIT)
    shutil.chown(job_dir, user, user)
    for p in [dest, *dest.rglob("*")]:
        shutil.chown(p, user, user)


def _ensure_as(user: str, node: Node, job: int, step: int,
               ranges: list[tuple[str, int, int]]) -> subprocess.CompletedProcess[str]:
    pw = pwd.getpwnam(user)
    return subprocess.run(
        ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
         str(PYTHON), "-c", USER_SCRIPT, node.sock, str(job), str(step),
         json.dumps([list(r) for r in ranges])],
        capture_output=True, text=True, timeout=180, cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": pw.pw_dir})


def _same_bytes(node_job: Path, sdir: Path, rel: str, offset: int, length: int) -> bool:
    with open(node_job / sdir.name / rel, "rb") as a, open(sdir / rel, "rb") as b:
        a.seek(offset)
        b.seek(offset)
        return a.read(length) == b.read(length)


def test_node_replacement_partial_local_step_fetches_only_asked_ranges(
        world: World, test_users: tuple[str, ...]) -> None:
    """A node holding a partial step 10 (not in S3) and a fresh node both stage in step 5,
    the newest complete one, with the passed-over step 10 reported; each then fetches
    only the blocks its ranks ask for, and the node's own part of step 5 is not fetched."""
    user, w = test_users[0], world
    run = f"{user}/replace"
    step5 = _build_step(w, run, 5, 4, seed=5)
    _upload(w, run, step5)
    step10 = _build_step(w, run, 10, 4, seed=10)
    with _nodes(w, ["n1", "n2"]) as (n1, n2):
        job_dir = w.base / "n1" / "nvme" / "job-101"
        create_job_dir(f"{w.base}/n1/nvme", 101, *_ids(user))
        _copy_part(step10, 0, job_dir, user, with_commit=True)  # died before uploading
        _copy_part(step5, 0, job_dir, user, with_commit=False)
        st1 = _start_job(n1, w, 101, user, f"s3://ckpt/{run}")
        st2 = _start_job(n2, w, 101, user, f"s3://ckpt/{run}")
        for st in (st1, st2):
            assert (st["stagein"], st["step"], st["source"], st["mode"]) == (
                "done", 5, "s3", "metadata"), st
        assert [f["step"] for f in st1["fallbacks"]] == [10]  # type: ignore[attr-defined]
        assert "only ranks [0] of 0..3" in st1["fallbacks"][0]["reason"]  # type: ignore[index]
        # Set aside (into the root-only .stale/): the job's later save(10) must not find
        # its COMMIT.json and skip the new step 10 as already committed.
        assert not (job_dir / step10.name).exists()
        n2_dir = w.base / "n2" / "nvme" / "job-101" / step5.name
        assert sorted(p.relative_to(n2_dir).as_posix() for p in n2_dir.rglob("*")
                      if p.is_file()) == [COMMIT, "rank-00000/.metadata",
                                          "rank-00000/MANIFEST.json", "rank-00001/MANIFEST.json",
                                          "rank-00002/MANIFEST.json", "rank-00003/MANIFEST.json"]

        asked1 = [("rank-00000/data.distcp", 0, FILE), ("rank-00001/data.distcp", 0, FILE)]
        asked2 = [("rank-00002/data.distcp", 0, FILE),
                  ("rank-00003/data.distcp", 9 * MIB, MIB)]  # only the blocks that hold it
        for node, asked in ((n1, asked1), (n2, asked2)):
            out = _ensure_as(user, node, 101, 5, asked)
            assert out.returncode == 0, out.stdout + out.stderr
        f1, f2 = (n.up.fetcher.stats(101) for n in (n1, n2))
        blocks = len(covering(0, FILE, FILE))
        assert (f1["fetched_bytes"], f1["local_blocks"]) == (FILE, blocks)  # rank 1 only
        held = covering(9 * MIB, MIB, FILE)  # the whole blocks that hold rank 3's range
        widened = min(FILE, (held[-1] + 1) * BLOCK_SIZE) - held[0] * BLOCK_SIZE
        assert (f2["fetched_bytes"], f2["local_blocks"]) == (FILE + widened, 0)
        for name, asked in (("n1", asked1), ("n2", asked2)):
            for rel, off, length in asked:
                assert _same_bytes(w.base / name / "nvme" / "job-101", step5, rel, off, length)
        assert os.stat(n2_dir / "rank-00003" / "data.distcp").st_uid == _ids(user)[0]
        again = _ensure_as(user, n2, 101, 5, asked2)  # already present: nothing fetched
        assert again.returncode == 0 and n2.up.fetcher.stats(101)["fetched_bytes"] == f2[
            "fetched_bytes"]


def _ids(user: str) -> tuple[int, int]:
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


def test_a_second_fetch_never_opens_a_file_the_first_is_still_creating(
        world: World, test_users: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of a node asking for the same file at once (replicated tensors) both get it:
    the second never opens the target while the first is still creating it (root's, short)."""
    user, w = test_users[0], world
    run = f"{user}/same"
    sdir = _build_step(w, run, 3, 1, seed=3)
    _upload(w, run, sdir)
    uid, gid = _ids(user)
    created, second_done = threading.Event(), threading.Event()
    real_fchown = os.fchown

    def slow_fchown(fd: int, owner: int, group: int) -> None:
        # Hold the first creator between create and chown until the second request is done
        # (or, when it is kept waiting as it should be, for a moment).
        if os.readlink(f"/proc/self/fd/{fd}").endswith("data.distcp") and not created.is_set():
            created.set()
            second_done.wait(timeout=1.0)
        real_fchown(fd, owner, group)

    request = {"job_id": 152, "step": 3, "ranges": [["rank-00000/data.distcp", 0, FILE]]}
    peer = Peer(pid=2, uid=uid, gid=gid)
    with _nodes(w, ["n1"]) as (n1,):
        st = _start_job(n1, w, 152, user, f"s3://ckpt/{run}")
        assert (st["stagein"], st["step"]) == ("done", 3), st
        monkeypatch.setattr(os, "fchown", slow_fchown)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(n1.up.on_fetch, request, peer)
            assert created.wait(timeout=30)
            second = pool.submit(n1.up.on_fetch, request, peer)
            second.add_done_callback(lambda _: second_done.set())
            answers = [first.result(), second.result()]
        assert all(a["ok"] for a in answers)
        assert n1.up.fetcher.stats(152)["fetched_bytes"] == FILE  # each block once
    assert _same_bytes(w.base / "n1" / "nvme" / "job-152", sdir, "rank-00000/data.distcp", 0,
                       FILE)


def test_injected_503s_on_newest_step_still_give_that_step(
        world: World, test_users: tuple[str, ...]) -> None:
    """503 SlowDown on the newest step's manifests and data is retried, never taken for
    corruption: stage-in still takes step 10 and the fetched bytes verify."""
    user, w = test_users[0], world
    run = f"{user}/slow"
    for step in (5, 10):
        _upload(w, run, _build_step(w, run, step, 2, seed=step))
    meta_faults = w.proxy.fail(f"{run}/step-00000010/rank-00001/MANIFEST.json", count=6)
    data_faults = w.proxy.fail(f"{run}/step-00000010/rank-00001/data.distcp", count=5)
    with _nodes(w, ["n1"]) as (n1,):
        st = _start_job(n1, w, 201, user, f"s3://ckpt/{run}")
        assert (st["stagein"], st["step"], st["fallbacks"]) == ("done", 10, []), st
        out = _ensure_as(user, n1, 201, 10, [("rank-00001/data.distcp", 0, FILE)])
        assert out.returncode == 0, out.stdout + out.stderr
    assert (meta_faults.injected, data_faults.injected) == (6, 5)
    src = w.base / "src" / run.replace("/", "_") / "step-00000010"
    assert _same_bytes(w.base / "n1" / "nvme" / "job-201", src, "rank-00001/data.distcp", 0,
                       FILE)


def test_s3_down_at_job_start_fails_with_clear_error(
        world: World, test_users: tuple[str, ...]) -> None:
    """With S3 refusing connections at job start, stage-in fails with an error naming the
    cause (never "none" or a silent fresh start)."""
    user, w = test_users[0], world
    run = f"{user}/down"
    _upload(w, run, _build_step(w, run, 5, 1, seed=1))
    with _nodes(w, ["n1"]) as (n1,):
        w.proxy.refuse()
        st = _start_job(n1, w, 301, user, f"s3://ckpt/{run}")
    assert st["stagein"] == "failed" and st["step"] is None
    error = str(st["error"])
    assert f"couldn't list s3://ckpt/{run}" in error and "S3 unreachable" in error, error
    assert "stagein_retry_s" in error


def test_intent_without_commit_waits_then_errors_or_falls_back_loudly(
        world: World, test_users: tuple[str, ...]) -> None:
    """A step with an intent record but no COMMIT.json is waited for; when the wait runs
    out stage-in fails naming the step and the uploading node, unless the opt-in fallback
    is on (then the older step is taken and the fallback shows in the status); and a
    COMMIT.json that arrives during the wait is taken."""
    user, w = test_users[0], world
    run = f"{user}/intent"
    _upload(w, run, _build_step(w, run, 5, 2, seed=5))
    step10 = _build_step(w, run, 10, 2, seed=10)
    _upload(w, run, step10, commit=False)
    w.s3.client.put_object(Bucket="ckpt", Key=f"{run}/step-00000010/INTENT-old7.json",
                           Body=b'{"step": 10, "job_id": 7, "node": "old7", "ranks": [1], '
                                b'"world_size": 2, "time": 0}')
    uri = f"s3://ckpt/{run}"
    with _nodes(w, ["n1"]) as (n1,):
        st = _start_job(n1, w, 401, user, uri)
    assert st["stagein"] == "failed", st
    assert "step 10 is committed but still uploading from node(s) old7" in str(st["error"])
    with _nodes(w, ["n2"], stagein_intent_fallback="true") as (n2,):
        st = _start_job(n2, w, 402, user, uri)
    assert (st["stagein"], st["step"]) == ("done", 5), st
    assert [f["step"] for f in st["fallbacks"]] == [10]  # type: ignore[attr-defined]
    with _nodes(w, ["n3"], stagein_intent_wait_s=60) as (n3,):
        pw = pwd.getpwnam(user)
        create_job_dir(f"{w.base}/n3/nvme", 403, pw.pw_uid, pw.pw_gid)
        n3.up.on_job_start({"job_id": 403, "uid": pw.pw_uid, "gid": pw.pw_gid, "user": user},
                           ROOT)
        n3.up.on_register({"job_id": 403, "uri": uri}, ROOT)
        assert n3.up.on_status({"job_id": 403}, ROOT)["stagein"] == "running"
        w.s3.client.put_object(Bucket="ckpt", Key=f"{run}/step-00000010/{COMMIT}",
                               Body=(step10 / COMMIT).read_bytes())
        st = _wait_stagein(n3, 403)
    assert (st["stagein"], st["step"], st["fallbacks"]) == ("done", 10, []), st


def test_requeue_onto_node_holding_part_of_uploading_step_uploads_it_and_takes_it(
        world: World, test_users: tuple[str, ...]) -> None:
    """A step whose other rank is in S3 with an intent record waits for this node's part:
    stage-in on the node that holds that part uploads it, and the step commits and is
    taken, instead of waiting on itself until the intent wait runs out."""
    user, w = test_users[0], world
    run = f"{user}/requeue"
    _upload(w, run, _build_step(w, run, 5, 2, seed=5))
    step10 = _build_step(w, run, 10, 2, seed=10)
    _upload(w, run, step10, commit=False, only="rank-00001/")
    w.s3.client.put_object(Bucket="ckpt", Key=f"{run}/step-00000010/INTENT-n9.json",
                           Body=b'{"step": 10, "job_id": 9, "node": "n9", "ranks": [1], '
                                b'"world_size": 2, "time": 0}')
    with _nodes(w, ["n1"], stagein_intent_wait_s=60) as (n1,):
        job_dir = w.base / "n1" / "nvme" / "job-801"
        create_job_dir(f"{w.base}/n1/nvme", 801, *_ids(user))
        _copy_part(step10, 0, job_dir, user, with_commit=True)
        st = _start_job(n1, w, 801, user, f"s3://ckpt/{run}")
    assert (st["stagein"], st["step"], st["source"], st["fallbacks"]) == (
        "done", 10, "s3", []), st
    in_s3 = w.s3_dir / "ckpt" / run / "step-00000010"
    assert (in_s3 / COMMIT).is_file() and (in_s3 / "INTENT-n1.json").is_file()
    assert (in_s3 / "rank-00000" / "data.distcp").stat().st_size == FILE


def test_corrupt_metadata_falls_back_and_corrupt_data_fails_the_fetch(
        world: World, test_users: tuple[str, ...]) -> None:
    """A corrupted .metadata of the newest step fails verification: stage-in falls back to
    the step before and says so in the status; a corrupted data block fails the fetch
    with an error naming the step, the file and the block."""
    user, w = test_users[0], world
    run = f"{user}/corrupt"
    for step in (5, 10):
        _upload(w, run, _build_step(w, run, step, 2, seed=step))
    meta = w.s3_dir / "ckpt" / run / "step-00000010" / "rank-00000" / ".metadata"
    meta.write_bytes(b"x" + meta.read_bytes()[1:])
    data = w.s3_dir / "ckpt" / run / "step-00000005" / "rank-00001" / "data.distcp"
    raw = bytearray(data.read_bytes())
    raw[BLOCK_SIZE + 10] ^= 0x40
    data.write_bytes(bytes(raw))
    with _nodes(w, ["n1"]) as (n1,):
        st = _start_job(n1, w, 501, user, f"s3://ckpt/{run}")
        assert (st["stagein"], st["step"]) == ("done", 5), st
        assert [f["step"] for f in st["fallbacks"]] == [10]  # type: ignore[attr-defined]
        out = _ensure_as(user, n1, 501, 5, [("rank-00001/data.distcp", 0, FILE)])
    assert out.returncode == 3
    assert "step 5: rank-00001/data.distcp block 1" in out.stdout and "corrupt" in out.stdout


def test_fetch_refuses_another_users_job_and_planted_links(
        world: World, test_users: tuple[str, ...]) -> None:
    """Another user asking to fetch a job's ranges is refused; links the job's user plants
    where the agent would write (a rank dir, a data file) are refused, never followed."""
    user, other, w = test_users[0], test_users[1], world
    run = f"{user}/hostile"
    _upload(w, run, _build_step(w, run, 5, 3, seed=5))
    canary = w.base / "canary"
    canary.write_bytes(b"keep")
    with _nodes(w, ["n1"]) as (n1,):
        st = _start_job(n1, w, 601, user, f"s3://ckpt/{run}")
        assert st["step"] == 5, st
        out = _ensure_as(other, n1, 601, 5, [("rank-00000/data.distcp", 0, 10)])
        assert out.returncode == 3 and "belongs to uid" in out.stdout, out.stdout + out.stderr
        sdir = w.base / "n1" / "nvme" / "job-601" / "step-00000005"
        shutil.rmtree(sdir / "rank-00001")
        plant = ["setpriv", f"--reuid={_ids(user)[0]}", f"--regid={_ids(user)[1]}",
                 "--clear-groups", "ln", "-s"]
        subprocess.run([*plant, "/tmp", str(sdir / "rank-00001")], check=True)
        subprocess.run([*plant, str(canary), str(sdir / "rank-00002" / "data.distcp")],
                       check=True)
        out1 = _ensure_as(user, n1, 601, 5, [("rank-00001/data.distcp", 0, 10)])
        out2 = _ensure_as(user, n1, 601, 5, [("rank-00002/data.distcp", 0, 10)])
        assert n1.up.fetcher.stats(601)["fetched_bytes"] == 0
    assert out1.returncode == 3 and "not a real directory" in out1.stdout, out1.stdout
    assert out2.returncode == 3 and "couldn't open rank-00002/data.distcp" in out2.stdout
    assert canary.read_bytes() == b"keep" and not Path("/tmp/data.distcp").exists()


def _root_job(w: World, node: Node, job: int, run: str) -> Path:
    """A job of root's on ``node`` with the run's URI, staged in: its staging dir."""
    create_job_dir(f"{w.base}/{node.name}/nvme", job, 0, 0)
    node.up.on_job_start({"job_id": job, "uid": 0, "gid": 0, "user": "root"}, ROOT)
    node.up.on_register({"job_id": job, "uri": f"s3://ckpt/{run}"}, ROOT)
    _wait_stagein(node, job)
    return w.base / node.name / "nvme" / f"job-{job}"


def test_uploader_writes_intent_record_before_any_data(
        world: World, test_users: tuple[str, ...]) -> None:
    """When the agent finds a newly committed step, its first write to S3 for that step is
    INTENT-<node>.json (job, node, ranks, world size); COMMIT.json comes last."""
    w = world
    run = "root/intent-order"
    with _nodes(w, ["n1"]) as (n1,):
        job_dir = _root_job(w, n1, 701, run)
        tmp = begin_part(job_dir, 3, 0)
        (tmp / "data.distcp").write_bytes(os.urandom(1000))
        commit_part(tmp, 3, 0)
        write_commit_marker(job_dir, 3, 1)
        n1.up.run_pass()
    puts = [p for m, p in w.proxy.requests if m == "PUT" and "step-00000003" in p]
    assert puts[0].endswith("/step-00000003/INTENT-n1.json"), puts
    assert puts[-1].endswith(f"/step-00000003/{COMMIT}"), puts
    doc = json.loads((w.s3_dir / "ckpt" / run / "step-00000003" / "INTENT-n1.json").read_text())
    assert (doc["job_id"], doc["node"], doc["ranks"], doc["world_size"]) == (701, "n1", [0], 1)


def _hold_copy(svc: BuddyService, job: int, nodes: tuple[str, ...], source: str,
               sdir: Path, rank: int) -> None:
    """``source``'s part of a step (rank ``rank``) received and verified in ``svc``'s buddy
    area, as a transfer from the source leaves it."""
    marker = CommitMarker.from_json((sdir / COMMIT).read_bytes())
    manifest = Manifest.from_json((sdir / rank_name(rank) / MANIFEST).read_bytes())
    offer = Offer(job, source, marker.step, marker, {rank: manifest},
                  sum(f.size for f in manifest.files))
    svc.store.begin(JobFacts(job, nodes), offer, Quota(1 << 40, 0.5, 1 << 41), used=0)
    for rel, _ in offer.files():
        svc.store.chunk(job, source, marker.step, rel, 0, (sdir / rel).read_bytes())
    svc.store.finish(job, source, marker.step)


def _in_s3(w: World, run: str, step: int) -> set[str]:
    prefix = f"{run}/{step_name(step)}/"
    return {k[len(prefix):] for k in w.s3.list_keys("ckpt", prefix)}


def test_a_lost_nodes_part_goes_up_from_its_buddys_copy_and_the_next_run_takes_the_step(
        world: World, test_users: tuple[str, ...]) -> None:
    """Job 301 on n1 and n2 (rank 0 on n1, rank 1 on n2) commits step 10 on both, and n2's
    part reaches n1, its buddy, as a verified copy; n2 is lost before its own upload. While
    n2 is a node of the job as n1 knows it, n1 uploads its own part only and the step waits
    for n2's. Once the job ended on n1, n1 uploads n2's part from the copy (checked against
    its manifest on the way), the step commits, and the job's next run, on n3, stages in
    step 10, not step 5. The buddy area stays while the step uploads, then goes."""
    user, w = test_users[0], world
    run = f"{user}/handoff"
    _upload(w, run, _build_step(w, run, 5, 2, seed=5))
    step10 = _build_step(w, run, 10, 2, seed=10, save_id="000000000000000a-j301.r0.hand")
    nodes = ("n1", "n2")
    with _nodes(w, ["n1", "n3"]) as (n1, n3):
        st = _start_job(n1, w, 301, user, f"s3://ckpt/{run}")
        assert (st["stagein"], st["step"]) == ("done", 5), st
        watcher = BuddyWatcher(n1.up.cfg, jobs={301: JobNodes(0, nodes)})
        now = [1000.0]
        buddy = BuddyService(n1.up.cfg, "n1", str(w.base / "n1-events.json"), watcher,
                             clock=lambda: now[0])
        n1.up.buddy, buddy.uploader = buddy, n1.up
        _hold_copy(buddy, 301, nodes, "n2", step10, rank=1)
        job_dir = w.base / "n1" / "nvme" / "job-301"
        _copy_part(step10, 0, job_dir, user, with_commit=True)  # the job's save on n1

        n1.up.run_pass()  # n2 is still in the job: its part is its own to upload
        assert _in_s3(w, run, 10) >= {"rank-00000/MANIFEST.json", "rank-00000/data.distcp"}
        assert not _in_s3(w, run, 10) & {COMMIT, "rank-00001/MANIFEST.json"}
        assert n1.up.current(301)["steps"]["10"]["state"] == "waiting-peers"

        n1.up.on_job_end({"job_id": 301}, ROOT)  # the job is requeued away from n2
        del watcher.jobs[301]
        now[0] += 60
        buddy.tick()  # the area outlives the job while its step uploads
        assert buddy.store.held(301)["n2"].step == 10
        n1.up.run_pass()
        got = _in_s3(w, run, 10)
        assert {COMMIT, "rank-00001/MANIFEST.json", "rank-00001/data.distcp"} <= got, got
        body = w.s3.client.get_object(Bucket="ckpt", Key=f"{run}/{step_name(10)}/rank-00001/"
                                                         "data.distcp")["Body"].read()
        assert body == (step10 / "rank-00001" / "data.distcp").read_bytes()
        counters = events.read(str(w.base / "n1-events.json"))["counters"]
        assert counters.get(f"{events.BUDDY}|uploaded") == 1, counters
        assert counters.get(f"{events.BUDDY_BYTES}|uploaded") == FILE, counters

        st3 = _start_job(n3, w, 301, user, f"s3://ckpt/{run}")  # the requeued run
        assert (st3["stagein"], st3["step"], st3["source"]) == ("done", 10, "s3"), st3
        now[0] += 60
        buddy.tick()
        assert 301 not in buddy.store.jobs()


def test_a_buddy_copy_that_fails_its_check_never_goes_up_nor_stops_the_nodes_own_part(
        world: World, test_users: tuple[str, ...]) -> None:
    """The copy held of the lost node's part went bad on the disk: the hand-off reads it
    against its manifest, uploads nothing of it (no manifest, no commit), logs and counts
    the failure once (never reading the copy again), and n1's own part of the step stays
    uploaded and waiting, as before."""
    user, w = test_users[0], world
    run = f"{user}/handoff-bad"
    step10 = _build_step(w, run, 10, 2, seed=11, save_id="000000000000000a-j302.r0.bad")
    nodes = ("n1", "n2")
    with _nodes(w, ["n1"]) as (n1,):
        st = _start_job(n1, w, 302, user, f"s3://ckpt/{run}")
        assert st["stagein"] == "done", st
        buddy = BuddyService(n1.up.cfg, "n1", str(w.base / "n1-events.json"),
                             BuddyWatcher(n1.up.cfg))
        n1.up.buddy, buddy.uploader = buddy, n1.up
        _hold_copy(buddy, 302, nodes, "n2", step10, rank=1)
        held = (w.base / "n1" / "nvme" / ".buddy" / "job-302" / "from-n2" / step_name(10)
                / "rank-00001" / "data.distcp")
        with open(held, "r+b") as fh:  # one flipped byte, after its verified arrival
            fh.seek(FILE // 2)
            byte = fh.read(1)
            fh.seek(FILE // 2)
            fh.write(bytes([byte[0] ^ 0xFF]))
        _copy_part(step10, 0, w.base / "n1" / "nvme" / "job-302", user, with_commit=True)
        n1.up.on_job_end({"job_id": 302}, ROOT)
        n1.up.run_pass()
        n1.up.run_pass()  # the bad copy is not read (nor counted) again
        got = _in_s3(w, run, 10)
        assert "rank-00000/MANIFEST.json" in got and COMMIT not in got, got
        assert "rank-00001/MANIFEST.json" not in got and "rank-00001/data.distcp" not in got
        assert n1.up.current(302)["steps"]["10"]["state"] == "waiting-peers"
        counters = events.read(str(w.base / "n1-events.json"))["counters"]
        assert counters.get(f"{events.BUDDY}|failed") == 1, counters


def test_a_step_committed_during_an_s3_outage_is_announced_before_a_requeue_releases_the_job(
        world: World) -> None:
    """After an S3 outage the uploader backs off, so a step committed while S3 was down has
    no intent record in S3 for a while: a requeued run listing S3 then would resume from an
    older step. Before the agent releases a job it requeued away from a lost node, the
    uploader tries the job at once and announces that step (uploader/announce.py); with S3
    still down it says which step is left unannounced, after a bounded wait."""
    w = world
    run = "root/announce"
    with _nodes(w, ["n1"]) as (n1,):
        job_dir = _root_job(w, n1, 801, run)

        def commit_locally(step: int) -> None:  # rank 0 of 2: the other node's part never comes
            tmp = begin_part(job_dir, step, 0)
            (tmp / "data.distcp").write_bytes(os.urandom(1000))
            commit_part(tmp, step, 0)
            write_commit_marker(job_dir, step, 2)

        intent = w.s3_dir / "ckpt" / run / "step-00000003" / "INTENT-n1.json"
        w.proxy.refuse()
        commit_locally(3)
        n1.up.run_pass()  # S3 down: the step is pending here, announced nowhere
        w.proxy.accept()
        n1.up.tell(BackOff(801, 600.0))  # the job's uploads back off after the outage
        n1.up.run_pass()
        assert not intent.exists()  # the window a requeued run's stage-in could fall into
        assert announce_now(n1.up, 801, wait_s=60) == ""
        assert json.loads(intent.read_text())["job_id"] == 801

        w.proxy.refuse()
        commit_locally(4)
        why = announce_now(n1.up, 801, wait_s=1)
    assert why.startswith("step 4, committed on n1, is not announced in S3 after 1s "
                          "(checkpoint.requeue_announce_wait_s; S3 unreachable?)"), why
    assert not (w.s3_dir / "ckpt" / run / "step-00000004").exists()


def test_moments_after_s3_failed_a_fetch_asks_the_jobs_nodes_before_s3(
        world: World, test_users: tuple[str, ...]) -> None:
    """A relaunch after a node loss with S3 down: the stage-in (or the uploads) just spent
    stagein_retry_s on S3. Within that long of it, a fetch of parts this node lacks asks the
    job's nodes first (the buddy service; stubbed here), and S3 is not asked at all when
    they make the step whole here. Otherwise S3 comes first, as always."""
    user, w = test_users[0], world
    run = f"{user}/peers-first"
    with _nodes(w, ["n1"]) as (n1,):
        job_dir = w.base / "n1" / "nvme" / "job-901"
        create_job_dir(f"{w.base}/n1/nvme", 901, *_ids(user))
        assert _start_job(n1, w, 901, user, f"s3://ckpt/{run}")["stagein"] == "done"
        asked: list[int] = []
        steps = {s: _build_step(w, run, s, 2, seed=s) for s in (7, 8)}

        def peers(job_id: int, jfd: int, gid: int, step: int) -> bool:
            asked.append(step)  # the lost node's part, as its buddy would give it
            _copy_part(steps[step], 1, job_dir, user, with_commit=False)
            return True

        n1.up.fetcher.peers = peers
        for sdir in steps.values():
            _copy_part(sdir, 0, job_dir, user, with_commit=True)  # this node's own part
        wanted = [("rank-00001/data.distcp", 0, FILE)]
        n1.up.fetcher.note_s3_unreachable()
        out = _ensure_as(user, n1, 901, 7, wanted)
        assert out.returncode == 0, out.stdout + out.stderr
        assert asked == [7]
        assert not [p for _, p in w.proxy.requests if "step-00000007" in p]
        n1.up.fetcher.s3_failed_at = None  # S3 has not failed lately: it is asked first
        out = _ensure_as(user, n1, 901, 8, wanted)
        assert out.returncode == 0, out.stdout + out.stderr
        assert asked == [7, 8]
        assert [m for m, p in w.proxy.requests if "step-00000008/COMMIT.json" in p] == ["HEAD"]
    assert _same_bytes(job_dir, steps[7], "rank-00001/data.distcp", 0, FILE)


class _Peers:
    """The buddy service as stage-in uses it, stubbed: the job's nodes hold ``step``
    whole (what buddy_peers.stage finds and places); records what it was asked."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.asked: list[tuple[int, str]] = []

    def stage(self, job_id: int, jfd: int, gid: int, s3_steps: set[int], s3_error: str, *,
              force: bool = False) -> Staged:
        self.asked.append((job_id, s3_error))
        return Staged(Choice(self.step, (), ()), 0)

    def newer_held(self, job_id: int, step: int | None) -> bool:
        return False

    def status(self, job_id: int) -> dict[str, object]:
        return {}


def test_a_stage_in_while_s3_refuses_connections_asks_the_jobs_nodes_without_retrying_s3(
        world: World, test_users: tuple[str, ...], tmp_path: Path) -> None:
    """A node joining a relaunch while S3 is down: its endpoint refuses the connection, so
    the stage-in asks the job's nodes at once (they hold the step) instead of retrying S3
    for stagein_retry_s first, says so, and the ranks' fetches ask them first too. With S3
    taking connections, S3 is asked first as always and the job's nodes are not."""
    user, w = test_users[0], world
    run = f"{user}/refused"
    peers = _Peers(step=12)
    log.configure(mode="json", level="info", file=str(tmp_path / "ev.jsonl"))
    try:
        with _nodes(w, ["n1"]) as (n1,):
            n1.up.buddy = peers  # type: ignore[assignment]
            w.proxy.refuse()
            st = _start_job(n1, w, 1001, user, f"s3://ckpt/{run}")
            assert (st["stagein"], st["step"], st["source"]) == ("done", 12, "buddy"), st
            assert [j for j, _ in peers.asked] == [1001]
            assert f"S3 endpoint {w.proxy.url} takes no connection: " in peers.asked[0][1]
            assert n1.up.fetcher.s3_failed_at is not None  # the ranks' fetches: peers first
            w.proxy.accept()
            st = _start_job(n1, w, 1002, user, f"s3://ckpt/{run}")
            assert (st["stagein"], st["step"]) == ("done", None), st
            assert [j for j, _ in peers.asked] == [1001]
    finally:
        log.reset()
    said = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert [e.get("job_id") for e in said if e["event"] == "stage-in: S3 takes no connection; "
            "asking the job's nodes first"] == [1001]
    assert not [e for e in said if e["event"].startswith("stage-in: S3 request failed")]
