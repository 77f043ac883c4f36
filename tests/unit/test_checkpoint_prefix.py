"""Run URIs and the per-user allowed prefix."""

from __future__ import annotations

import pytest

from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.checkpoint.prefix import PrefixDenied, check_run_uri, parse_uri

TEMPLATE = "s3://ckpt/{user}/"


def test_uri_inside_prefix_is_accepted() -> None:
    """A run below s3://ckpt/alice/ is accepted and normalised."""
    run = check_run_uri("s3://ckpt/alice/llm-7b/", TEMPLATE, "alice")
    assert (run.bucket, run.key, str(run)) == ("ckpt", "alice/llm-7b", "s3://ckpt/alice/llm-7b")
    assert run.join("step-00000001", "COMMIT.json") == "alice/llm-7b/step-00000001/COMMIT.json"


@pytest.mark.parametrize("uri", [
    "s3://ckpt/bob/run", "s3://other/alice/run", "s3://ckpt/alice", "s3://ckpt/alicex/run",
    "s3://ckpt/alice-evil/run",
])
def test_uri_outside_prefix_is_denied(uri: str) -> None:
    """Another user's prefix, another bucket, the prefix itself or a look-alike are refused."""
    with pytest.raises(PrefixDenied, match="outside the prefix user alice may write to"):
        check_run_uri(uri, TEMPLATE, "alice")


@pytest.mark.parametrize("uri", ["s3://ckpt/alice/../bob/run", "s3://ckpt/alice/./r",
                                 "http://x/y", "s3://ckpt/alice/a b", "s3://Bad_Bucket/x",
                                 "s3://ckpt/alice/run\n", "s3://ckpt/alice/r\x1b[2J",
                                 "s3://ckpt\n/alice/run"])
def test_malformed_uris_are_rejected(uri: str) -> None:
    """Traversal segments, odd or control characters (a trailing newline too, which the
    SPANK plugin refuses) and non-s3 schemes are rejected before any check."""
    with pytest.raises(CheckpointError):
        parse_uri(uri)
    with pytest.raises(CheckpointError):
        check_run_uri(uri, TEMPLATE, "alice")


def test_no_prefix_configured_means_no_s3() -> None:
    """An empty allowed_prefix refuses every URI with a message naming the setting."""
    with pytest.raises(PrefixDenied, match="allowed_prefix is empty"):
        check_run_uri("s3://ckpt/alice/run", "", "alice")
