"""Our S3 client against a real S3-protocol endpoint that honours conditional writes (moto)."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_resilience.checkpoint.commit import Crc32c
from slurm_resilience.uploader.s3 import S3

KEY = "run/step-00000001/COMMIT.json"


def _crc(body: bytes) -> str:
    crc = Crc32c()
    crc.update(body)
    return crc.hexdigest()


def test_commit_marker_is_written_with_if_none_match_where_the_endpoint_honours_it(
        s3: S3, events: Path) -> None:
    """The probe finds If-None-Match honoured (its second PUT gets 412) and says so in the
    log; the first marker PUT succeeds, the second is refused by the endpoint ('already
    there': False) and the first marker stays. The probe key is gone."""
    first, second = b'{"job": 1}', b'{"job": 2}'
    assert s3.put_if_absent("ckpt", KEY, first, _crc(first), prefix="run/") is True
    assert s3.put_if_absent("ckpt", KEY, second, _crc(second), prefix="run/") is False
    assert s3.get_bytes("ckpt", KEY) == first
    assert list(s3.list_keys("ckpt", "run/")) == [KEY]
    modes = [e.get("mode") for e in map(json.loads, events.read_text().splitlines())
             if "If-None-Match" in e["event"]]
    assert modes == ["conditional"], events.read_text()
