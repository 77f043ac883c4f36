"""Restores from S3 you can trust bit for bit: a flipped bit in any block of a step's data in
S3 (block edges, the short last block), in a manifest or in ``.metadata`` is caught by
the agent's fetch, by stage-in or by ``ckpt verify``, and the caller's tensors keep every
element (real torch, a real S3-protocol endpoint: moto)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from moto_s3 import upload_step

from slurm_resilience.checkpoint.blocks import BLOCK_SIZE
from slurm_resilience.checkpoint.commit import (
    MANIFEST,
    CheckpointError,
    CorruptStep,
    read_manifest,
    step_name,
)
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.prefix import parse_uri
from slurm_resilience.checkpoint.ranges import ByteRange
from slurm_resilience.checkpoint.staging import create_job_dir, open_job_dir, set_aside_step
from slurm_resilience.uploader.fetch import FetchJob, FetchSettings, RangeFetcher
from slurm_resilience.uploader.pullverify import verify_remote
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.stagein import StageinPolicy, stage_in

N = 300_000  # float32: 4 whole 256 KiB blocks and a short fifth
URI = "s3://ckpt/run"
DATA = "rank-00000/data.distcp"


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(N, generator=g), "b": torch.randn(7, generator=g)}}


def _tensors(state: dict[str, object]) -> list[torch.Tensor]:
    model = state["model"]
    assert isinstance(model, dict)
    return [model[k] for k in sorted(model)]


class InProcessFetch:
    """The agent's fetch (``ckpt.fetch``) called in this process instead of over its socket."""

    def __init__(self, fetcher: RangeFetcher, job: FetchJob) -> None:
        self.fetcher, self.job = fetcher, job

    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        self.fetcher.fetch(self.job, step, list(ranges))


def _saved(tmp_path: Path, s3: S3) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    mgr = CheckpointManager(src)
    mgr.save(2, _state(2))
    mgr.close()
    upload_step(s3, "run", src / step_name(2))
    return src / step_name(2)


def _key(rel: str) -> str:
    return f"run/{step_name(2)}/{rel}"


def _put_flipped(s3: S3, rel: str, original: bytes, pos: int, bit: int = 0) -> None:
    data = bytearray(original)
    data[pos] ^= 1 << bit
    s3.client.put_object(Bucket="ckpt", Key=_key(rel), Body=bytes(data))


def _restore(tmp_path: Path, s3: S3, n: int) -> tuple[object, list[torch.Tensor], list[str]]:
    """A fresh node: stage-in, then load_latest (allow_fresh_start) through the agent's
    fetch; what it returned, the caller's tensors, and the steps stage-in passed over."""
    root = tmp_path / f"nvme-{n}"
    root.mkdir(mode=0o755)
    job = create_job_dir(str(root), 7, os.getuid(), os.getgid())
    uri = parse_uri(URI)
    with open_job_dir(str(root), 7) as jfd:
        res = stage_in(s3, uri, jfd, os.getuid(), os.getgid(), StageinPolicy(retry_s=0),
                       set_aside=lambda s, why: set_aside_step(str(root), 7, jfd,
                                                               step_name(s), why))
    passed = [f.reason for f in res.fallbacks]
    if res.step is None:
        return None, [], passed
    fetcher = RangeFetcher(FetchSettings(retry_s=0), lambda: s3, StageinPolicy(retry_s=0))
    try:
        source = InProcessFetch(fetcher, FetchJob(7, os.getuid(), os.getgid(), str(root), uri))
        state = _state(99)
        got = CheckpointManager(job, ranges=source, allow_fresh_start=True).load_latest(state)
        return got, _tensors(state), passed
    finally:
        fetcher.close()


def _edges(size: int) -> list[int]:
    return [p for start in range(0, size, BLOCK_SIZE)
            for p in (start, min(size, start + BLOCK_SIZE) - 1)]


def test_a_flip_in_any_block_in_s3_fails_the_fetch_and_loads_nothing(
        tmp_path: Path, s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    """A bit flipped at the first or last byte of every block of the step's data in S3 (the
    short last block too): the fetch refuses it, load_latest with allow_fresh_start starts
    fresh, and the caller's fresh tensors keep every element."""
    sdir = _saved(tmp_path, s3)
    original = (sdir / DATA).read_bytes()
    assert len(original) > 4 * BLOCK_SIZE and len(original) % BLOCK_SIZE
    fresh = _tensors(_state(99))
    got, tensors, _ = _restore(tmp_path, s3, 0)
    assert got is not None and all(torch.equal(a, b) for a, b in
                                   zip(tensors, _tensors(_state(2)), strict=True))
    for n, pos in enumerate(_edges(len(original)), start=1):
        _put_flipped(s3, DATA, original, pos)
        got, tensors, _ = _restore(tmp_path, s3, n)
        assert got is None, pos
        assert all(torch.equal(a, b) for a, b in zip(tensors, fresh, strict=True)), pos
        err = capsys.readouterr().err
        assert f"block {pos // BLOCK_SIZE}" in err and "STARTING FROM SCRATCH" in err, pos
    s3.client.put_object(Bucket="ckpt", Key=_key(DATA), Body=original)


def test_a_fetch_of_part_of_a_block_checks_the_whole_block(tmp_path: Path, s3: S3) -> None:
    """A reshard asks for a few bytes of block 2: the fetch verifies all of block 2, so a
    flip in its bytes the range does not cover is caught; block 3 is left alone."""
    sdir = _saved(tmp_path, s3)
    original = (sdir / DATA).read_bytes()
    part = [ByteRange(DATA, 2 * BLOCK_SIZE + 100, 10)]
    root = tmp_path / "nvme"
    root.mkdir(mode=0o755)
    create_job_dir(str(root), 7, os.getuid(), os.getgid())
    fetcher = RangeFetcher(FetchSettings(retry_s=0), lambda: s3, StageinPolicy(retry_s=0))
    job = FetchJob(7, os.getuid(), os.getgid(), str(root), parse_uri(URI))
    try:
        _put_flipped(s3, DATA, original, 3 * BLOCK_SIZE + 7)
        assert fetcher.fetch(job, 2, part)["fetched_blocks"] == 1
        _put_flipped(s3, DATA, original, 2 * BLOCK_SIZE + 5000)
        fetcher.forget(7)
        (root / "job-7" / step_name(2) / DATA).unlink()
        # The agent's answer carries the kind in its message (AgentRanges raises CorruptStep).
        with pytest.raises(CheckpointError, match=rf"{DATA} block 2 .*{CorruptStep.MARK}"):
            fetcher.fetch(job, 2, part)
    finally:
        fetcher.close()


def test_flips_in_s3_manifests_and_metadata_are_caught_by_stage_in_and_ckpt_verify(
        tmp_path: Path, s3: S3) -> None:
    """A bit flipped in the step's manifest (a block CRC32C, the file CRC32C, a size digit)
    or in .metadata (first, middle, last byte) in S3: stage-in passes the step over (no
    step to load, never wrong tensors) and ``ckpt verify`` reports it."""
    sdir = _saved(tmp_path, s3)
    rel_m = f"rank-00000/{MANIFEST}"
    text = (sdir / rel_m).read_text()
    m = read_manifest(sdir / "rank-00000")
    data = next(f for f in m.files if f.path == "data.distcp")
    meta_rel = "rank-00000/.metadata"
    meta = (sdir / meta_rel).read_bytes()
    flips = [(rel_m, text.index(data.blocks[1]) + 3), (rel_m, text.index(data.crc32c) + 1),
             (rel_m, text.index(f'"size": {data.size}') + 10),
             (meta_rel, 0), (meta_rel, len(meta) // 2), (meta_rel, len(meta) - 1)]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert verify_remote(s3, parse_uri(URI), 2, scratch) == []
    for n, (rel, pos) in enumerate(flips):
        original = (sdir / rel).read_bytes()
        _put_flipped(s3, rel, original, pos)
        got, _, passed = _restore(tmp_path, s3, n)
        assert got is None and len(passed) == 1, (rel, pos)
        try:
            problems = verify_remote(s3, parse_uri(URI), 2, scratch)
        except CheckpointError as exc:
            problems = [str(exc)]
        assert problems, (rel, pos)
        s3.client.put_object(Bucket="ckpt", Key=_key(rel), Body=original)


def test_ckpt_verify_reports_a_flip_in_any_block(tmp_path: Path, s3: S3) -> None:
    """``ckpt verify`` downloads every file whole: a flip at any block edge of the data
    (the short last block too) is reported, naming the file."""
    sdir = _saved(tmp_path, s3)
    original = (sdir / DATA).read_bytes()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for pos in _edges(len(original)):
        _put_flipped(s3, DATA, original, pos)
        problems = verify_remote(s3, parse_uri(URI), 2, scratch)
        assert len(problems) == 1 and problems[0].startswith(f"{DATA}: crc32c"), pos
    s3.client.put_object(Bucket="ckpt", Key=_key(DATA), Body=original)


def test_the_agent_checks_a_part_already_on_the_node_block_by_block(
        tmp_path: Path, s3: S3) -> None:
    """The node's own part of the step (saved here, also in S3) with a bit flipped at a
    block edge: the agent's fetch verifies it in place, fetches just that block again from
    S3, and the file ends byte for byte as saved; with the step only on this node the
    fetch refuses it as not verifying."""
    sdir = _saved(tmp_path, s3)
    original = (sdir / DATA).read_bytes()
    whole = [ByteRange(DATA, 0, len(original))]
    for n, pos in enumerate(_edges(len(original))):
        root = tmp_path / f"nvme-{n}"
        root.mkdir(mode=0o755)
        job_dir = create_job_dir(str(root), 7, os.getuid(), os.getgid())
        local = job_dir / step_name(2)
        shutil.copytree(sdir, local)
        data = bytearray(original)
        data[pos] ^= 0x10
        (local / DATA).write_bytes(bytes(data))
        for uri, ok in ((parse_uri(URI), True), (None, False)):
            # Retries of a transient S3 error (a loaded machine's slow moto) for up to 30 s;
            # a block that does not verify is no transient error and is never retried.
            fetcher = RangeFetcher(FetchSettings(retry_s=30), lambda: s3,
                                   StageinPolicy(retry_s=30))
            job = FetchJob(7, os.getuid(), os.getgid(), str(root), uri)
            try:
                if ok:
                    assert fetcher.fetch(job, 2, whole)["fetched_blocks"] == 1, pos
                    assert (local / DATA).read_bytes() == original, pos
                    (local / DATA).write_bytes(bytes(data))
                else:
                    with pytest.raises(CheckpointError, match=CorruptStep.MARK):
                        fetcher.fetch(job, 2, whole)
            finally:
                fetcher.close()
