"""S3 downloads (stage-in, ``ckpt pull``): parallel ranged GETs streamed into the file through
one reused buffer per thread. A range whose connection is cut mid-body is fetched again
and the file holds every byte; a range that keeps failing raises naming it, never leaves
zeros behind a returned CRC32C (real S3 protocol: moto, behind a real TCP relay that
cuts connections)."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import threading
from pathlib import Path

import google_crc32c
import pytest

from slurm_resilience.checkpoint.crc import crc_hex
from slurm_resilience.uploader.s3 import S3, MiB, S3Settings, TransientS3Error
from slurm_resilience.uploader.s3_stream import direct_stream, read_into

SIZE = 3 * MiB + 1000  # four ranges of 1 MiB, the last short


class CuttingRelay:
    """A TCP relay to ``upstream`` that closes its first ``cuts`` connections once
    ``after`` bytes of the answer went back: a body cut off mid-range."""

    def __init__(self, upstream: str, cuts: int, after: int = 200_000) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.cuts, self.after = cuts, after
        self.accepted = 0
        self.cut = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
                cut = self.accepted <= self.cuts
            up = socket.create_connection(self.upstream)
            for args in ((conn, up, None), (up, conn, self.after if cut else None)):
                t = threading.Thread(target=self._pipe, args=args, daemon=True)
                t.start()
                self.threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if limit is not None and sent + len(data) > limit:
                    dst.sendall(data[:limit - sent])
                    with self.lock:
                        self.cut += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass  # the other side went away: end this direction too
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def _put(s3: S3) -> bytes:
    payload = os.urandom(SIZE)
    s3.client.put_object(Bucket="ckpt", Key="obj", Body=payload)
    return payload


def _client(url: str, attempts: int) -> S3:
    return S3(S3Settings(endpoint=url, part_size=MiB, concurrency=3, attempts=attempts,
                         retry_initial_s=0.01, request_timeout_s=10.0))


def _download(client: S3, path: Path, progress: list[int]) -> str:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        return client.download_fd("ckpt", "obj", SIZE, fd, progress.append)
    finally:
        os.close(fd)


def test_a_download_holds_every_byte_and_its_crc32c(s3: S3, moto_endpoint: str,
                                                    tmp_path: Path) -> None:
    payload = _put(s3)
    progress: list[int] = []
    got = _download(_client(moto_endpoint, 1), tmp_path / "f", progress)
    assert (tmp_path / "f").read_bytes() == payload
    assert got == crc_hex(google_crc32c.value(payload))
    assert sorted(progress) == [1000, MiB, MiB, MiB]


def test_ranges_cut_mid_body_are_fetched_again(s3: S3, moto_endpoint: str,
                                               tmp_path: Path) -> None:
    """The first three connections are cut 200 KB into their answer: those ranges are
    fetched again, the file is whole and each range is counted once."""
    payload = _put(s3)
    relay = CuttingRelay(moto_endpoint, cuts=3)
    try:
        progress: list[int] = []
        got = _download(_client(relay.url, 4), tmp_path / "f", progress)
    finally:
        relay.close()
    assert relay.cut == 3
    assert (tmp_path / "f").read_bytes() == payload
    assert got == crc_hex(google_crc32c.value(payload))
    assert sorted(progress) == [1000, MiB, MiB, MiB]


def test_a_range_that_keeps_failing_raises_naming_it(s3: S3, moto_endpoint: str,
                                                     tmp_path: Path) -> None:
    _put(s3)
    relay = CuttingRelay(moto_endpoint, cuts=1000)
    try:
        with pytest.raises(TransientS3Error, match=r"couldn't get obj bytes \d+-\d+ at S3 "
                                                   r"endpoint .* after 2 attempts"):
            _download(_client(relay.url, 2), tmp_path / "f", [])
    finally:
        relay.close()


def test_a_plain_get_body_is_read_from_the_socket_directly(s3: S3) -> None:
    """With the pinned boto3/urllib3, a GET's body is read straight into our buffer (no
    allocation and copy per chunk). A release that hides the stack under the body fails
    here instead of making restores quietly slower."""
    payload = _put(s3)
    body = s3.client.get_object(Bucket="ckpt", Key="obj", Range="bytes=0-99999")["Body"]
    try:
        direct = direct_stream(body)
        assert direct is not None
        buf = memoryview(bytearray(65536))
        got = b"".join(bytes(buf[:n]) for n in iter(lambda: read_into(body, buf, direct), 0))
    finally:
        body.close()
    assert got == payload[:100_000]


def test_an_encoded_body_is_left_to_urllib3() -> None:
    class Raw:
        _fp = http.client.HTTPResponse(socket.socket())
        headers = {"content-encoding": "gzip"}

    class Body:
        _raw_stream = Raw()

    assert direct_stream(Body()) is None


def test_a_body_cut_short_of_its_length_is_a_connection_error() -> None:
    """http.client's IncompleteRead is not an OSError: it is raised as ConnectionError, which
    the retry loop treats as transient like any cut connection."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcde")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    http_conn = http.client.HTTPConnection("127.0.0.1", server.getsockname()[1], timeout=10)
    try:
        http_conn.request("GET", "/")
        resp = http_conn.getresponse()
        buf = memoryview(bytearray(64))
        assert read_into(None, buf, resp) == 5
        with pytest.raises(ConnectionError, match="ended early"):
            read_into(None, buf, resp)
    finally:
        http_conn.close()
        server.close()
        t.join(timeout=10)


class ReadOnlyBody:
    """A response body of an older botocore: ``read`` but no ``readinto``."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, n: int) -> bytes:
        out, self.data = self.data[:n], self.data[n:]
        return out


def test_read_into_takes_a_body_without_readinto() -> None:
    buf = memoryview(bytearray(4))
    body = ReadOnlyBody(b"abcdefghij")
    got = [bytes(buf[:n]) for n in iter(lambda: read_into(body, buf, None), 0)]
    assert got == [b"abcd", b"efgh", b"ij"]
