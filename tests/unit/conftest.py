"""Fixtures of the unit tests: a real S3-protocol endpoint (moto, see moto_s3.py), and the
log's JSON events."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_resilience import log
from slurm_resilience.checkpoint.s3 import S3, S3Settings


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server_mod = pytest.importorskip("moto.server",
                                     reason="moto[server] (the dev extra) serves S3 here")
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"] = os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(moto_endpoint: str, request: pytest.FixtureRequest) -> S3:
    """An S3 client of ours on a fresh, empty bucket ``ckpt`` (one server per module)."""
    client = S3(S3Settings(endpoint=moto_endpoint, attempts=1, retry_initial_s=0.01,
                           request_timeout_s=10.0))
    client.client.create_bucket(Bucket="ckpt")

    def empty() -> None:
        keys = list(client.list_keys("ckpt", ""))
        if keys:
            client.delete_keys("ckpt", keys)
        client.client.delete_bucket(Bucket="ckpt")

    request.addfinalizer(empty)
    return client


@pytest.fixture
def events(tmp_path: Path) -> Iterator[Path]:
    """The JSON lines file the log writes to during the test."""
    f = tmp_path / "events.jsonl"
    log.configure(mode="json", level="info", file=str(f))
    yield f
    log.reset()
