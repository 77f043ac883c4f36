"""Pure pieces of the restore path: retries with an injected clock, range merging and
batching, fetch request checks, block expansion, and the status lines."""

from __future__ import annotations

import json

import pytest

from slurm_resilience.checkpoint.agent_ranges import BATCH_BYTES, batches
from slurm_resilience.checkpoint.blocks import BLOCK_SIZE
from slurm_resilience.checkpoint.commit import CheckpointError, FileEntry
from slurm_resilience.checkpoint.ranges import ByteRange, merge_ranges
from slurm_resilience.testing import FakeClock
from slurm_resilience.uploader.cli import format_status
from slurm_resilience.uploader.fetch import (
    FetchError,
    _File,
    _needed_blocks,
    _StepFiles,
    parse_ranges,
)
from slurm_resilience.uploader.s3 import TransientS3Error
from slurm_resilience.uploader.stagein import StageinFailed, StageinPolicy, retrying


def test_transient_errors_are_retried_until_they_stop() -> None:
    """A transient S3 error is retried with growing backoff and the answer is returned."""
    clock, calls = FakeClock(), []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise TransientS3Error("503 SlowDown")
        return "listing"

    assert retrying("list", flaky, StageinPolicy(retry_s=60), clock) == "listing"
    assert clock.slept == [0.5, 1.0, 2.0]


def test_transient_errors_past_the_window_fail_naming_the_cause() -> None:
    """When S3 stays unreachable past stagein_retry_s, the error names what and why."""
    clock = FakeClock()

    def down() -> None:
        raise TransientS3Error("connection refused")

    with pytest.raises(StageinFailed, match=r"couldn't list s3://b/r: S3 unreachable .* for "
                                            r"10s \(checkpoint.stagein_retry_s\): connection"):
        retrying("list s3://b/r", down, StageinPolicy(retry_s=10), clock)
    assert 10 <= clock.now <= 10.5


def test_ranges_merge_where_they_touch_and_batches_stay_small() -> None:
    """Touching or overlapping ranges of one file merge; batches stay below the size limit."""
    rs = [ByteRange("rank-00001/a", 10, 5), ByteRange("rank-00001/a", 0, 10),
          ByteRange("rank-00001/a", 12, 10), ByteRange("rank-00000/a", 0, 1),
          ByteRange("rank-00001/a", 30, 0)]
    assert merge_ranges(rs) == [ByteRange("rank-00000/a", 0, 1), ByteRange("rank-00001/a", 0, 22)]
    many = [ByteRange(f"rank-{i % 7:05d}/data-{i}.distcp", i, 1) for i in range(5000)]
    out = list(batches(many))
    assert sum(len(b) for b in out) == 5000
    assert all(len(json.dumps(b)) <= BATCH_BYTES and len(b) <= 1024 for b in out)


def test_fetch_request_ranges_are_checked() -> None:
    """Mis-shaped ranges, escaping paths and booleans are refused with a clear error."""
    assert parse_ranges([["rank-00000/x", 0, 5]]) == [ByteRange("rank-00000/x", 0, 5)]
    for bad in ("x", [["a", 0]], [["a", True, 1]], [[1, 0, 1]], [["a", 0, "5"]]):
        with pytest.raises(FetchError, match="fetch: range"):
            parse_ranges(bad)
    with pytest.raises(CheckpointError, match="not a plain relative path"):
        parse_ranges([["rank-00000/../../etc/passwd", 0, 1]])


def test_ranges_widen_to_whole_blocks_and_unknown_files_are_refused() -> None:
    """A range becomes the manifest blocks that cover it; files not in a manifest and
    ranges past the end fail naming the step."""
    size = 2 * BLOCK_SIZE + 100
    entry = FileEntry("data.distcp", size, "00000000", ("a", "b", "c"))
    sf = _StepFiles("s3", {"rank-00002/data.distcp": _File("rank-00002/data.distcp", entry)})
    got = _needed_blocks(7, sf, [ByteRange("rank-00002/data.distcp", BLOCK_SIZE - 1, 2),
                                 ByteRange("rank-00002/data.distcp", size - 1, 1)])
    assert got == {"rank-00002/data.distcp": {0, 1, 2}}
    with pytest.raises(FetchError, match=r"step 7: rank-00003/data\.distcp: not in its rank"):
        _needed_blocks(7, sf, [ByteRange("rank-00003/data.distcp", 0, 1)])
    with pytest.raises(FetchError, match=r"step 7: rank-00002/data\.distcp: range"):
        _needed_blocks(7, sf, [ByteRange("rank-00002/data.distcp", size, 1)])


def test_status_lines_show_fallbacks_and_errors() -> None:
    """`ckpt status` prints the step taken, every step passed over, and a failure's cause."""
    done = {"stagein": "done", "step": 5, "source": "s3", "mode": "metadata",
            "fallbacks": [{"step": 10, "reason": "crc mismatch"}], "pending": [],
            "fetch": {"requests": 1, "fetched_bytes": 4096, "fetched_blocks": 1,
                      "local_blocks": 2}}
    assert format_status(3, "n1", done) == [
        "job 3 on n1: stage-in done: step 5 from s3 (metadata)",
        "  passed over step 10: crc mismatch",
        "  fetched 4,096 bytes in 1 blocks; 2 blocks verified in place"]
    failed = {"stagein": "failed", "step": None, "error": "S3 unreachable", "pending": [4]}
    assert format_status(3, "n1", failed) == ["job 3 on n1: stage-in failed: S3 unreachable",
                                              "  uploads pending: steps [4]"]
