"""The S3 endpoint probe stage-in makes before its first request (uploader/s3_reach.py)."""

from __future__ import annotations

import socket

from slurm_resilience.uploader.s3_reach import endpoint_address, refusing


def test_endpoint_addresses_with_and_without_a_port() -> None:
    assert endpoint_address("http://127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert endpoint_address("https://s3.example.org") == ("s3.example.org", 443)
    assert endpoint_address("http://minio.site/") == ("minio.site", 80)
    assert endpoint_address("") is None  # AWS's own endpoint: not probed
    assert endpoint_address("s3.example.org:9000") is None  # no scheme: not a URL we can use
    assert endpoint_address("http://host:notaport") is None


def test_a_port_nobody_listens_on_refuses_and_a_listening_one_does_not() -> None:
    with socket.socket() as listening, socket.socket() as bound:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        bound.bind(("127.0.0.1", 0))  # held, never listening: no one else can take it
        assert refusing(f"http://127.0.0.1:{listening.getsockname()[1]}", env={}) == ""
        assert refusing(f"http://127.0.0.1:{bound.getsockname()[1]}",
                        env={}) == "connection refused"


def test_no_probe_through_a_proxy_nor_for_awss_own_endpoint() -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))  # never listening: a direct connect would be refused
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        assert refusing(url, env={"HTTPS_PROXY": "http://proxy:3128"}) == ""
        assert refusing(url, env={"http_proxy": "http://proxy:3128"}) == ""
    assert refusing("", env={}) == ""
