"""The agent's checkpoint service against a real S3 endpoint (``rclone serve s3``).

No Slurm here: the service's handlers are called as the agent's socket would
call them, and a real rclone S3 server holds the objects, so multipart uploads,
listings, aborts and corruption are the real thing.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import google_crc32c
import pytest
import torch
from conftest import as_user, free_port, rclone

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint.agent_ranges import batches
from slurm_resilience.checkpoint.commit import CheckpointError, committed_steps
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.ranges import ByteRange, merge_ranges
from slurm_resilience.checkpoint.staging import create_job_dir
from slurm_resilience.cli import main as cli_main
from slurm_resilience.config import Config, load_text
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.service import Uploader, s3_settings

REPO = Path(__file__).resolve().parents[2]
ROOT = Peer(pid=1, uid=0, gid=0)
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent side runs as root")


class Endpoint:
    """A real S3 server on loopback that a test can stop and start again."""

    def __init__(self, base: Path):
        self.dir = base / "s3"
        (self.dir / "ckpt").mkdir(parents=True)
        self.port = free_port()
        self.key, self.secret = secrets.token_hex(8), secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [rclone(), "serve", "s3", str(self.dir), "--addr", f"127.0.0.1:{self.port}",
             "--auth-key", f"{self.key},{self.secret}", "--config", "/dev/null"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                         timeout=0.5):
                return
            time.sleep(0.1)
        raise RuntimeError("rclone serve s3 did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Endpoint, Path]]:
    ep = Endpoint(tmp_path)
    ep.start()
    creds = tmp_path / "s3-keys"
    creds.write_text(f"{ep.key} {ep.secret}\n")
    creds.chmod(0o600)
    (tmp_path / "nvme").mkdir(mode=0o755)
    yield ep, tmp_path
    ep.stop()


def _cfg(ep: Endpoint, base: Path, **extra: object) -> Config:
    settings: dict[str, object] = {
        "staging_root": f"{base}/nvme", "allowed_prefix": "s3://ckpt/{user}/",
        "s3_endpoint": ep.url, "s3_credentials_file": f"{base}/s3-keys", "part_size": "5MiB",
        "concurrency": 4, "retry_initial_s": 0.05, "retry_max_s": 0.2, "request_timeout_s": 3,
        **extra}
    lines = ["node:", f"  state_dir: {base}/state", "checkpoint:"]
    lines += [f"  {k}: {v}" for k, v in settings.items()]
    return load_text(Config, "\n".join(lines) + "\n")


def _job(up: Uploader, base: Path, job_id: int, uri: str) -> Path:
    d = create_job_dir(f"{base}/nvme", job_id, 0, 0)
    up.on_job_start({"job_id": job_id, "uid": 0, "gid": 0, "user": "root"}, ROOT)
    up.on_register({"job_id": job_id, "uri": uri}, ROOT)
    _wait_stagein(up, job_id)
    return d


def _wait_stagein(up: Uploader, job_id: int) -> dict[str, object]:
    for _ in range(200):
        st = up.on_status({"job_id": job_id}, ROOT)
        if st["stagein"] in ("done", "failed"):
            return st
        time.sleep(0.05)
    raise AssertionError("stage-in did not finish")


class HandlerRanges:
    """AgentRanges without a socket: the service's ckpt.fetch handler answers directly.

    Stage-in of an S3 step brings only its metadata; a restore fetches its ranges."""

    def __init__(self, up: Uploader, job_id: int) -> None:
        self.up, self.job_id = up, job_id

    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        for batch in batches(merge_ranges(ranges)):
            self.up.on_fetch({"job_id": self.job_id, "step": step, "ranges": batch}, ROOT)


def _save(d: Path, step: int, mb: float = 0.1, value: float = 1.0) -> None:
    mgr = CheckpointManager(d)
    mgr.save(step, {"w": torch.full((int(mb * 262144),), value)})
    mgr.wait()


def test_upload_commit_last_then_new_job_stages_in_and_verifies(env: tuple[Endpoint, Path]
                                                                 ) -> None:
    """Committed steps go to S3 (COMMIT.json last); a new job's stage-in brings the newest."""
    ep, base = env
    up = Uploader(_cfg(ep, base), "n1")
    d = _job(up, base, 11, "s3://ckpt/root/run1")
    _save(d, 5, mb=12, value=5.0)  # > part_size: a real multipart upload
    _save(d, 10, mb=0.5, value=10.0)
    up.run_pass()
    assert up.on_status({"job_id": 11}, ROOT)["pending"] == []
    objs = sorted(p.relative_to(ep.dir / "ckpt/root/run1").as_posix()
                  for p in (ep.dir / "ckpt/root/run1").rglob("*") if p.is_file())
    assert "step-00000010/COMMIT.json" in objs and "step-00000005/rank-00000/.metadata" in objs
    verify = ["--config", str(_cfg_file(ep, base)), "ckpt", "verify", "s3://ckpt/root/run1"]
    assert cli_main([*verify, "--all"]) == 0

    d2 = _job(up, base, 12, "s3://ckpt/root/run1")  # empty NVMe
    st = up.on_status({"job_id": 12}, ROOT)
    assert (st["stagein"], st["step"], st["source"], st["mode"]) == ("done", 10, "s3",
                                                                     "metadata")
    loaded = CheckpointManager(d2, ranges=HandlerRanges(up, 12)).load_latest()
    assert loaded is not None and loaded.step == 10 and float(loaded.state["w"][0]) == 10.0
    up.run_pass()
    assert up.s3.parts_sent > 0


def _on_a_terminal(argv: list[str]) -> str:
    """What ``argv`` shows a person at a terminal: its stdout and stderr on a pty."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the pty
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def test_ckpt_pull_and_verify_show_progress_on_a_terminal_only(env: tuple[Endpoint, Path],
                                                               tmp_path: Path) -> None:
    """`ckpt verify` and `ckpt pull` draw a byte progress bar on a terminal, and print only
    their results when piped."""
    ep, base = env
    up = Uploader(_cfg(ep, base), "n1")
    d = _job(up, base, 21, "s3://ckpt/root/bar")
    _save(d, 5, mb=12, value=5.0)  # over part_size: several ranges, so the bar moves
    up.run_pass()
    cli = [sys.executable, "-m", "slurm_resilience", "--config", str(_cfg_file(ep, base)),
           "ckpt"]
    shown = _on_a_terminal([*cli, "verify", "s3://ckpt/root/bar"])
    assert "step-00000005: 100%" in shown and "12.0M/12.0M" in shown, shown
    shown = _on_a_terminal([*cli, "pull", "s3://ckpt/root/bar", str(tmp_path / "pulled")])
    assert "100%" in shown and "step-00000005 ->" in shown, shown
    piped = subprocess.run([*cli, "verify", "s3://ckpt/root/bar"], capture_output=True,
                           text=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout == "step-00000005: ok\n", piped
    assert piped.stderr == "", piped.stderr


def _cfg_file(ep: Endpoint, base: Path) -> Path:
    p = base / "conf.yaml"
    p.write_text(f"checkpoint:\n  s3_endpoint: {ep.url}\n  s3_credentials_file: {base}/s3-keys\n"
                 "  part_size: 5MiB\n")
    return p


def _journal_parts(base: Path, job_id: int) -> int:
    import json

    path = base / "state" / "ckpt-journal" / f"job-{job_id}.json"
    try:
        rec = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0
    return sum(len(f.get("parts", {})) for st in rec["steps"].values()
               for f in st.get("files", {}).values())


def test_sigkilled_agent_resumes_without_resending_parts(env: tuple[Endpoint, Path]) -> None:
    """An agent killed mid multipart upload resumes from its journal: sent parts stay sent."""
    ep, base = env
    cfg_args = {"rate_limit": "8MiB", "concurrency": 1}
    up = Uploader(_cfg(ep, base, **cfg_args), "n1")
    d = _job(up, base, 21, "s3://ckpt/root/big")
    _save(d, 1, mb=40)  # 9 parts of 5 MiB at 8 MiB/s: about 5 s
    conf = base / "agent.yaml"
    conf.write_text("\n".join([
        "node:", f"  state_dir: {base}/state", "checkpoint:", f"  staging_root: {base}/nvme",
        "  allowed_prefix: s3://ckpt/{user}/", f"  s3_endpoint: {ep.url}",
        f"  s3_credentials_file: {base}/s3-keys", "  part_size: 5MiB", "  concurrency: 1",
        "  rate_limit: 8MiB"]) + "\n")
    script = textwrap.dedent(f"""
        from slurm_resilience import config
        from slurm_resilience.uploader.service import Uploader
        Uploader(config.load({str(conf)!r}), "n1").run_pass()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 60
    while _journal_parts(base, 21) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _journal_parts(base, 21)
    size = (d / "step-00000001/rank-00000/data.distcp").stat().st_size
    nparts = -(-size // (5 * 1024**2))
    assert 3 <= done < nparts
    resumed = Uploader(_cfg(ep, base), "n1")  # reads the journal like a restarted agent
    resumed.run_pass()
    assert resumed.on_status({"job_id": 21}, ROOT)["pending"] == []
    assert resumed.s3.parts_sent == nparts - done
    verify = ["--config", str(_cfg_file(ep, base)), "ckpt", "verify", "s3://ckpt/root/big"]
    assert cli_main(verify) == 0


def test_endpoint_down_backs_off_then_uploads_when_back(env: tuple[Endpoint, Path]) -> None:
    """With S3 down, save() still returns at once, the step stays pending, uploads back off,
    and it is committed in S3 once the endpoint is back."""
    ep, base = env
    up = Uploader(_cfg(ep, base), "n1")
    d = _job(up, base, 31, "s3://ckpt/root/down")
    ep.stop()
    mgr = CheckpointManager(d)
    mgr.save(3, {"w": torch.ones(1000)})  # local only: nothing on the save path waits on S3
    mgr.wait()
    assert up.on_status({"job_id": 31}, ROOT)["pending"] == []  # not seen before a pass
    up.run_pass()
    assert up.on_status({"job_id": 31}, ROOT)["pending"] == [3]
    next_try, delay = up.backoff[31]
    assert next_try > time.monotonic() and delay > up.ck.retry_initial_s
    assert up.on_job_end({"job_id": 31}, ROOT)["pending"] == [3]  # the epilog would hand over
    ep.start()
    time.sleep(0.3)
    up.run_pass()
    assert (ep.dir / "ckpt/root/down/step-00000003/COMMIT.json").is_file()
    assert 31 not in up.jobs and not d.exists()  # ended and safe in S3: staging dir removed


def test_corrupt_object_in_s3_fails_the_restore_naming_step_and_block(
        env: tuple[Endpoint, Path]) -> None:
    """A corrupted object of the newest step is caught by its block CRC32C when the restore
    fetches it: load_latest raises naming the step, file and block, never loading the bytes
    nor starting fresh (stage-in brings only metadata, so it can't see data corruption)."""
    ep, base = env
    up = Uploader(_cfg(ep, base), "n1")
    d = _job(up, base, 41, "s3://ckpt/root/corrupt")
    _save(d, 5, value=5.0)
    _save(d, 10, value=10.0)
    up.run_pass()
    obj = ep.dir / "ckpt/root/corrupt/step-00000010/rank-00000/data.distcp"
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    verify = ["--config", str(_cfg_file(ep, base)), "ckpt", "verify", "s3://ckpt/root/corrupt"]
    assert cli_main(verify) == 1
    d2 = _job(up, base, 42, "s3://ckpt/root/corrupt")
    st = up.on_status({"job_id": 42}, ROOT)
    assert (st["stagein"], st["step"], st["source"]) == ("done", 10, "s3")
    with pytest.raises(CheckpointError, match=r"couldn't load committed step 10: .*"
                       r"rank-00000/data\.distcp block 0 .*the object is corrupt"):
        CheckpointManager(d2, ranges=HandlerRanges(up, 42)).load_latest()


def test_planted_symlinks_are_not_uploaded_nor_followed(env: tuple[Endpoint, Path]) -> None:
    """A manifest entry turned into a link to /etc is refused; a stray link is never uploaded."""
    ep, base = env
    up = Uploader(_cfg(ep, base), "n1")
    d = _job(up, base, 51, "s3://ckpt/root/links")
    _save(d, 1)
    part = d / "step-00000001" / "rank-00000"
    os.symlink("/etc", part / "etc")  # not in the manifest
    _save(d, 2)
    part2 = d / "step-00000002" / "rank-00000"
    (part2 / ".metadata").unlink()
    os.symlink("/etc/shadow", part2 / ".metadata")  # in the manifest
    up.run_pass()
    run = ep.dir / "ckpt/root/links"
    uploaded = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    assert "step-00000001/COMMIT.json" in uploaded
    # step 2 was announced (its SAVE- and INTENT- records) but nothing of it was uploaded
    announced = re.compile(r"step-00000002/(SAVE-[^/]+|INTENT-[^/]+)$")
    assert not any("etc" in u or (u.startswith("step-00000002") and not announced.match(u))
                   for u in uploaded), sorted(uploaded)
    rec = up.jobs[51]["steps"]["2"]
    assert rec["state"] == "rejected" and "symlink" in rec["reason"]


def test_uri_outside_user_prefix_is_refused_and_nothing_written(env: tuple[Endpoint, Path]
                                                                 ) -> None:
    """Registering another user's prefix fails with a clear error and no object appears."""
    ep, base = env
    up = Uploader(_cfg(ep, base), "n1")
    create_job_dir(f"{base}/nvme", 61, 0, 0)
    up.on_job_start({"job_id": 61, "uid": 0, "gid": 0, "user": "root"}, ROOT)
    with pytest.raises(RequestError, match="outside the prefix user root may write to"):
        up.on_register({"job_id": 61, "uri": "s3://ckpt/alice/run"}, ROOT)
    with pytest.raises(RequestError, match="belongs to uid 0"):
        up.on_register({"job_id": 61, "uri": "s3://ckpt/root/x"}, Peer(pid=2, uid=1000, gid=1000))
    _save(base / "nvme" / "job-61", 1)
    up.run_pass()
    assert list((ep.dir / "ckpt").rglob("*")) == []


def test_retention_keeps_last_k_local_and_m_remote(env: tuple[Endpoint, Path]) -> None:
    """Older local steps go only after S3 holds them; S3 keeps the newest keep_remote steps."""
    ep, base = env
    up = Uploader(_cfg(ep, base, keep_local=1, keep_remote=2, remote_retention_grace_s=0), "n1")
    d = _job(up, base, 71, "s3://ckpt/root/ret")
    for step in (1, 2, 3):
        _save(d, step)
    ep.stop()
    up.run_pass()
    assert committed_steps(d) == [1, 2, 3]  # nothing safe in S3 yet: nothing deleted
    ep.start()
    up.backoff.clear()
    up.run_pass()
    up.run_pass()
    assert committed_steps(d) == [3]
    remote = sorted(p.name for p in (ep.dir / "ckpt/root/ret").iterdir())
    assert remote == ["step-00000002", "step-00000003"]


def test_orphaned_upload_of_our_key_is_aborted(env: tuple[Endpoint, Path]) -> None:
    """A multipart upload started before a crash but never journaled is aborted."""
    ep, base = env
    up = Uploader(_cfg(ep, base, rate_limit="6MiB", concurrency=1), "n1")
    d = _job(up, base, 81, "s3://ckpt/root/orph")
    _save(d, 1, mb=12)
    s3 = S3(s3_settings(_cfg(ep, base)))
    key = "root/orph/step-00000001/rank-00000/data.distcp"
    orphan = s3.client.create_multipart_upload(Bucket="ckpt", Key=key)["UploadId"]
    up.jobs[81]["steps"]["1"] = {"state": "pending", "files": {
        f"ckpt-{key}": {}, key: {"done": False, "upload_id": "gone", "parts": {}}}}
    up.run_pass()
    assert orphan not in [u for _, u, _ in s3.multipart_uploads("ckpt", "root/orph/")]
    assert up.on_status({"job_id": 81}, ROOT)["pending"] == []


def test_multipart_etag_matches_the_server(env: tuple[Endpoint, Path]) -> None:
    """Our MD5-of-part-MD5s ETag equals what the server answers, so a completed upload is
    verified without reading the object back; a wrong part list would not match."""
    from slurm_resilience.uploader.s3 import multipart_etag

    ep, base = env
    s3 = S3(s3_settings(_cfg(ep, base)))
    up = s3.client.create_multipart_upload(Bucket="ckpt", Key="root/e/x")["UploadId"]
    etags = [s3.client.upload_part(Bucket="ckpt", Key="root/e/x", UploadId=up, PartNumber=n,
                                   Body=os.urandom(5 * 1024 * 1024))["ETag"] for n in (1, 2)]
    done = s3.client.complete_multipart_upload(
        Bucket="ckpt", Key="root/e/x", UploadId=up,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in
                                   zip((1, 2), etags, strict=True)]})
    assert done["ETag"] == multipart_etag(etags)
    assert done["ETag"] != multipart_etag(etags[::-1])


# -- issue 16: S3 done right, an upload path no job can stop -----------------------------------

def _uploader(ep: Endpoint, base: Path, max_parts: int = 10_000, **extra: object) -> Uploader:
    from dataclasses import replace

    cfg = _cfg(ep, base, **extra)
    return Uploader(cfg, "n1", s3=S3(replace(s3_settings(cfg), max_parts=max_parts)))


def _objects(ep: Endpoint, run: str) -> list[str]:
    root = ep.dir / "ckpt" / run
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _forge_step(d: Path, step: int, files: dict[str, tuple[int, str, tuple[str, ...]]]) -> None:
    """A committed step whose files are sparse (``size`` bytes of zeros) and whose manifest
    lists the given CRC32Cs, as a job could write it."""
    from slurm_resilience.checkpoint.commit import CommitMarker, FileEntry, Manifest

    part = d / f"step-{step:08d}" / "rank-00000"
    part.mkdir(parents=True)
    entries = []
    for name, (size, crc, blocks) in files.items():
        with open(part / name, "wb") as fh:
            fh.truncate(size)
        entries.append(FileEntry(name, size, crc, blocks))
    (part / "MANIFEST.json").write_bytes(Manifest(step, 0, tuple(entries)).to_json())
    (d / f"step-{step:08d}" / "COMMIT.json").write_bytes(CommitMarker(step, 1).to_json())


def test_part_limit_boundary_raises_part_size(env: tuple[Endpoint, Path]) -> None:
    """With the part limit lowered to 4, a 6-part file goes up in 4 larger parts and verifies
    (the same rule lets a 5 TiB object fit in 10,000 parts)."""
    ep, base = env
    up = _uploader(ep, base, max_parts=4)
    d = _job(up, base, 101, "s3://ckpt/root/parts")
    _save(d, 1, mb=26)  # 26 MiB + header: 6 parts of 5 MiB, more than 4
    up.run_pass()
    assert up.on_status({"job_id": 101}, ROOT)["pending"] == []
    assert up.s3.parts_sent == 4
    verify = ["--config", str(_cfg_file(ep, base)), "ckpt", "verify", "s3://ckpt/root/parts"]
    assert cli_main(verify) == 0


def test_permanent_s3_error_fails_the_step_with_its_reason(env: tuple[Endpoint, Path]) -> None:
    """A refused request (403: the node's key was revoked) stops that step with the reason
    in the journal and ckpt.status, and is never retried."""
    from dataclasses import replace

    ep, base = env
    up = _uploader(ep, base)
    d = _job(up, base, 111, "s3://ckpt/root/denied")
    _save(d, 1, mb=12)
    revoked = base / "revoked-keys"
    revoked.write_text(f"{ep.key} {'0' * 32}\n")
    revoked.chmod(0o600)
    up._s3 = S3(replace(up.s3.settings, credentials_file=str(revoked)))
    up.run_pass()
    st = up.on_status({"job_id": 111}, ROOT)
    assert st["pending"] == [] and "403" in st["failed"].get("1", ""), st
    from slurm_resilience.uploader import upload_status

    shown = upload_status.render(upload_status.collect(base / "state" / "ckpt-journal"))
    assert "job 111 (root) s3://ckpt/root/denied" in shown and "step 1 not uploaded" in shown
    assert up.jobs[111]["steps"]["1"]["state"] == "failed"
    calls = up.s3.parts_sent, up.s3.objects_put
    up.backoff.clear()
    up.run_pass()
    assert (up.s3.parts_sent, up.s3.objects_put) == calls


def test_bytes_that_do_not_match_the_manifest_are_never_uploaded(env: tuple[Endpoint, Path]
                                                                  ) -> None:
    """A sparse file listed with a made-up CRC32C is refused: multipart aborted, nothing in
    S3, step rejected; a wrong block CRC is caught; a small file too, and
    the step's files already sent are deleted."""
    from slurm_resilience.checkpoint.blocks import BLOCK_SIZE
    from slurm_resilience.checkpoint.crc_combine import combine_parts

    ep, base = env
    up = _uploader(ep, base)
    d = _job(up, base, 121, "s3://ckpt/root/forged")
    size = 24 * 1024 * 1024
    zero_block = f"{google_crc32c.value(bytes(BLOCK_SIZE)):08x}"
    _forge_step(d, 1, {"big.bin": (size, "1badc0de", ())})
    blocks = [zero_block] * (size // BLOCK_SIZE)
    blocks[1] = "0badb10c"
    # A manifest consistent in itself (its block CRCs add up to its file CRC, else it is
    # refused before any byte is read): the bytes of block 1 disagree with it.
    consistent = f"{combine_parts([(int(b, 16), BLOCK_SIZE) for b in blocks]):08x}"
    _forge_step(d, 2, {"big.bin": (size, consistent, tuple(blocks))})
    _forge_step(d, 3, {"good.bin": (1000, f"{google_crc32c.value(bytes(1000)):08x}", ()),
                       "small.bin": (1000, "1badc0de", ())})  # good.bin goes up, then away
    _forge_step(d, 4, {"evil.bin": (size, "0\r\nx-amz-acl: public-read", ())})
    up.run_pass()
    steps = up.jobs[121]["steps"]
    assert {s: steps[s]["state"] for s in "1234"} == dict.fromkeys("1234", "rejected")
    assert "not 8 hex digits" in steps["4"]["reason"]
    assert "manifest says size 25165824 crc32c 1badc0de" in steps["1"]["reason"]
    assert "block 1" in steps["2"]["reason"]
    assert _objects(ep, "root/forged") == []
    assert list(up.s3.multipart_uploads("ckpt", "root/forged/")) == []


def test_commit_marker_is_never_replaced_and_the_mode_is_logged(env: tuple[Endpoint, Path]
                                                                ) -> None:
    """rclone ignores If-None-Match (and CRC32C headers): the fallbacks are used and logged
    once; a second job's step 5 in the same run is not mixed into the first's."""
    from slurm_resilience import log

    ep, base = env
    logfile = base / "agent.log"
    log.configure(mode="json", level="info", file=str(logfile))
    try:
        up = _uploader(ep, base)
        d1 = _job(up, base, 131, "s3://ckpt/root/mix")
        _save(d1, 5, value=1.0)
        _save(d1, 6, value=1.0)
        up.run_pass()
    finally:
        log.reset()
    events = logfile.read_text()
    assert events.count('"mode": "check-then-put"') == 1
    assert events.count("ignores CRC32C checksums") == 1
    first = (ep.dir / "ckpt/root/mix/step-00000005/rank-00000/data.distcp").read_bytes()
    d2 = create_job_dir(f"{base}/nvme", 132, 0, 0)  # a second job, no stage-in yet
    up.on_job_start({"job_id": 132, "uid": 0, "gid": 0, "user": "root"}, ROOT)
    _save(d2, 5, value=2.0)
    up.on_register({"job_id": 132, "uri": "s3://ckpt/root/mix"}, ROOT)
    _wait_stagein(up, 132)
    up.run_pass()
    st = up.on_status({"job_id": 132}, ROOT)
    assert "already committed in S3" in st["failed"].get("5", ""), st
    assert (ep.dir / "ckpt/root/mix/step-00000005/rank-00000/data.distcp").read_bytes() == first
    assert up.s3.put_if_absent("ckpt", "root/mix/step-00000005/COMMIT.json", b"{}",
                               "00000000") is False


def test_retention_over_the_run_listing_with_several_jobs(env: tuple[Endpoint, Path]) -> None:
    """keep_remote=2 over three jobs sharing a URI leaves the newest two steps, not one
    leaked step per job ([3,4] -> [7,8] -> [11,12])."""
    ep, base = env
    up = _uploader(ep, base, keep_remote=2, remote_retention_grace_s=0)
    for job, steps in ((141, (3, 4)), (142, (7, 8)), (143, (11, 12))):
        d = _job(up, base, job, "s3://ckpt/root/shared")
        for step in steps:
            _save(d, step)
        up.run_pass()
        up.on_job_end({"job_id": job}, ROOT)
        up.run_pass()
    assert sorted({o.split("/")[0] for o in _objects(ep, "root/shared")}) == [
        "step-00000011", "step-00000012"]


def test_local_only_steps_are_retained_and_ended_dirs_removed(env: tuple[Endpoint, Path]
                                                              ) -> None:
    """Without a URI the newest keep_local steps stay; an ended job's dir goes after
    local_only_keep_s (0 here), so NVMe does not fill."""
    ep, base = env
    up = _uploader(ep, base, keep_local=2, local_only_keep_s=0)
    d = create_job_dir(f"{base}/nvme", 151, 0, 0)
    up.on_job_start({"job_id": 151, "uid": 0, "gid": 0, "user": "root"}, ROOT)
    for step in (1, 2, 3):
        _save(d, step)
    up.run_pass()
    assert committed_steps(d) == [2, 3]
    up.on_job_end({"job_id": 151}, ROOT)
    up.run_pass()
    assert not d.exists() and 151 not in up.jobs


def _until(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_huge_upload_does_not_hold_a_small_one_back(env: tuple[Endpoint, Path]) -> None:
    """With one upload slot, a job that commits while a huge upload is under way starts at
    the next tick and finishes while the huge one still has most of its parts to send."""
    ep, base = env
    up = _uploader(ep, base, concurrency=1, rate_limit="20MiB")
    big = _job(up, base, 161, "s3://ckpt/root/big-run")
    small = _job(up, base, 162, "s3://ckpt/root/small-run")
    _save(big, 1, mb=60)  # 13 parts
    _save(small, 1, mb=6)  # 2 parts
    up.backoff[162] = (time.monotonic() + 3600, 1.0)  # not due yet at the first tick
    up.tick()
    _until(lambda: len(up.s3.sent_log) >= 1, "the first part of the big upload")
    up.backoff.clear()  # the small job's step is due now
    up.tick()
    marker = ep.dir / "ckpt/root/small-run/step-00000001/COMMIT.json"
    _until(marker.exists, "the small job's commit")
    _until(lambda: not up.syncing.get(161) or not up.syncing[161].is_alive(), "the big upload")
    order = [owner for owner, _, _ in up.s3.sent_log]
    assert order.count("job-161") >= 12 and order.count("job-162") == 2, order
    last_small = max(i for i, o in enumerate(order) if o == "job-162")
    assert order[last_small + 1:].count("job-161") >= 6, order
    assert up.on_status({"job_id": 161}, ROOT)["pending"] == []
    up.close()


class _BuggyUploader(Uploader):
    """An uploader with a bug that hits one job only (until ``fixed``)."""

    fixed = False

    def upload_step(self, rec: dict[str, object], jfd: int, uri: object, step: int) -> None:
        if rec["job_id"] == 171 and not self.fixed:
            raise RuntimeError("a bug in job 171's work")
        super().upload_step(rec, jfd, uri, step)  # type: ignore[arg-type]


def _plant_deep_tree(user: str, job_dir: Path, depth: int) -> None:
    """As ``user``: a ``depth``-level tree in their staging dir (handed over as an fd)."""
    fd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY)
    script = textwrap.dedent(f"""
        import os
        fd = {fd}
        for _ in range({depth}):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.symlink("/etc/passwd", "passwd", dir_fd=fd)
    """)
    try:
        subprocess.run([sys.executable, "-c", script], **as_user(user), pass_fds=(fd,), check=True,
                       cwd="/", timeout=120)
    finally:
        os.close(fd)


def test_no_job_can_stop_another_jobs_upload(env: tuple[Endpoint, Path],
                                             test_users: tuple[str, ...]) -> None:
    """A user's 1,500-level tree, a bug in one job's work and mis-shaped journal records do
    not stop another job's upload; each is logged, the agent starts, the tree goes."""
    import json
    import pwd

    ep, base = env
    user = test_users[0]
    pw = pwd.getpwnam(user)
    journal = base / "state" / "ckpt-journal"
    journal.mkdir(parents=True, mode=0o700)
    (journal / "job-901.json").write_text(json.dumps({"job_id": 901, "stagein": None}))
    (journal / "job-902.json").write_text("\x00garbage")
    cfg = _cfg(ep, base, remove_max_entries=500)
    up = _BuggyUploader(cfg, "n1")  # starts although two records are broken
    assert sorted(up.jobs) == []
    assert len(list((journal / "quarantine").iterdir())) == 2

    hostile = create_job_dir(f"{base}/nvme", 170, pw.pw_uid, pw.pw_gid)
    up.on_job_start({"job_id": 170, "uid": pw.pw_uid, "gid": pw.pw_gid, "user": user}, ROOT)
    _plant_deep_tree(user, hostile, 1500)
    buggy = _job(up, base, 171, "s3://ckpt/root/buggy")
    _save(buggy, 1)
    victim = _job(up, base, 172, "s3://ckpt/root/victim")
    _save(victim, 1)
    up.on_job_end({"job_id": 170}, ROOT)
    up.jobs[170]["ended_at"] = 1.0  # long ago: its local-only dir is due for removal
    up.run_pass()
    assert (ep.dir / "ckpt/root/victim/step-00000001/COMMIT.json").is_file()
    assert up.jobs[171]["state"] == "failed" and "a bug" in up.jobs[171]["error"]
    assert up.on_status({"job_id": 171}, ROOT)["upload_error"].startswith("RuntimeError")
    for _ in range(10):  # 500 entries a pass: the tree goes over a few passes
        up.run_pass()
    assert not hostile.exists() and 170 not in up.jobs
    assert Path("/etc/passwd").is_file()
    assert up.jobs[171]["state"] == "failed"  # not tried again at once
    from slurm_resilience.uploader.service import FAILED_RETRY_S

    up.fixed = True
    up.jobs[171]["failed_at"] -= FAILED_RETRY_S  # an hour later it gets one more try
    up.run_pass()
    st = up.on_status({"job_id": 171}, ROOT)
    assert st["pending"] == [] and st["upload_error"] is None
    assert up.jobs[171]["state"] == "active"
