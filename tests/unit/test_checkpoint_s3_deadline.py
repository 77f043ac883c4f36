"""Stage-in and restore against an S3 endpoint that accepts connections and never answers:
they end by checkpoint.stagein_retry_s with an error naming S3, the endpoint and the
operation, and start no new request after that deadline; a stage-in that outlived the
job's staging dir says so."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_resilience.checkpoint.prefix import parse_uri
from slurm_resilience.checkpoint.ranges import ByteRange
from slurm_resilience.checkpoint.staging import create_job_dir, open_job_dir
from slurm_resilience.uploader.deadline import DeadlineExceeded, run_within
from slurm_resilience.uploader.fetch import FetchError, FetchJob, FetchSettings, RangeFetcher
from slurm_resilience.uploader.s3 import S3, S3Settings
from slurm_resilience.uploader.stagein import StageinFailed, StageinPolicy, stage_in

JOB = 11


class SilentEndpoint:
    """A real TCP listener on loopback that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, never read from nor written to

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def silent(monkeypatch: pytest.MonkeyPatch) -> Iterator[SilentEndpoint]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    endpoint = SilentEndpoint()
    yield endpoint
    endpoint.close()


def _client(url: str) -> S3:
    # Requests that would each wait 5 s, four attempts: far past the stage-in deadline.
    return S3(S3Settings(endpoint=url, request_timeout_s=5.0, attempts=4,
                         retry_initial_s=0.01))


def test_stagein_against_a_silent_endpoint_fails_by_its_deadline_naming_s3(
        silent: SilentEndpoint, tmp_path: Path) -> None:
    """Stage-in's listing on an endpoint that never answers fails once stagein_retry_s is
    over, naming S3, the endpoint, the operation and the setting, with one request made."""
    root = tmp_path / "nvme"
    root.mkdir()
    create_job_dir(str(root), JOB, os.getuid(), os.getgid())
    uri = parse_uri("s3://ckpt/alice/run")
    with open_job_dir(str(root), JOB) as jfd, pytest.raises(StageinFailed) as err:
        stage_in(_client(silent.url), uri, jfd, os.getuid(), os.getgid(),
                 StageinPolicy(retry_s=0.3), set_aside=lambda step, why: None)
    msg = str(err.value)
    assert f"couldn't list {uri}: no answer from S3 endpoint {silent.url} within 1s " \
           "(checkpoint.stagein_retry_s" in msg, msg
    assert len(silent.conns) == 1  # no second attempt once the deadline passed


def test_restore_fetch_from_a_silent_endpoint_fails_naming_s3_and_the_operation(
        silent: SilentEndpoint, tmp_path: Path) -> None:
    """A restore's ckpt.fetch of a step it must look up in S3 fails by the deadline with a
    FetchError naming the step, S3, the endpoint and the request it was waiting for."""
    root = tmp_path / "nvme"
    root.mkdir()
    create_job_dir(str(root), JOB, os.getuid(), os.getgid())
    s3 = _client(silent.url)
    fetcher = RangeFetcher(FetchSettings(), lambda: s3,
                           StageinPolicy(retry_s=0.2, endpoint=silent.url))
    job = FetchJob(JOB, os.getuid(), os.getgid(), str(root), parse_uri("s3://ckpt/alice/run"))
    try:
        with pytest.raises(FetchError) as err:
            fetcher.fetch(job, 5, [ByteRange("rank-00000/data.distcp", 0, 10)])
    finally:
        fetcher.close()
    msg = str(err.value)
    assert msg.startswith("checkpoint: fetch: step 5: "), msg
    assert f"couldn't look for step 5 in s3://ckpt/alice/run: no answer from S3 endpoint " \
           f"{silent.url} within 1s" in msg, msg


def test_an_operation_past_its_limit_is_given_up_and_its_retries_stop() -> None:
    """run_within gives up on an operation at its limit; inside it, the deadline is known
    (seconds_left), so S3.call starts no attempt after it."""
    from slurm_resilience.uploader.deadline import seconds_left

    release = threading.Event()
    seen: list[float | None] = []

    def hung() -> None:
        seen.append(seconds_left())
        release.wait(10)

    with pytest.raises(DeadlineExceeded, match=r"no result within 0\.05s: no answer"):
        run_within(hung, 0.05)
    release.set()
    assert seen and seen[0] is not None and 0 < seen[0] <= 0.05
    assert run_within(lambda: 7, 1.0) == 7
    assert seconds_left() is None  # the caller's own context has no deadline


def test_stagein_whose_staging_dir_went_away_says_so_not_just_enoent(
        tmp_path: Path, s3: S3) -> None:
    """A stage-in that finds the job's staging dir gone (the epilog removed it after the
    job gave up waiting) says that, instead of a bare 'No such file or directory'."""
    import pwd

    from slurm_resilience.agent.service import Peer
    from slurm_resilience.config import Config, load_text
    from slurm_resilience.uploader.service import Uploader

    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme",
        "  allowed_prefix: s3://ckpt/"]) + "\n")
    (tmp_path / "nvme").mkdir(mode=0o755)
    up = Uploader(cfg, "n1", s3=s3)
    root = Peer(pid=1, uid=0, gid=0)
    up.on_job_start({"job_id": JOB, "uid": os.getuid(), "gid": os.getgid(),
                     "user": pwd.getpwuid(os.getuid()).pw_name, "uri": "s3://ckpt/run"}, root)
    up.stageins[JOB].join()
    st = up.on_status({"job_id": JOB}, root)
    up.close()
    assert st["stagein"] == "failed"
    assert str(st["error"]).startswith(f"checkpoint: stage-in: job {JOB}'s staging dir is gone "
                                       "(the job ended, or its load gave up"), st["error"]
    assert "No such file or directory" in str(st["error"])
