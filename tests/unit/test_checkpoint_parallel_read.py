"""The restore's parallel read: every piece lands where a serial read puts it, whatever the
split into read tasks; it starts only after the whole step verified (a flipped bit in
any block leaves the caller's tensors as they were); a read that fails raises and no
read thread runs on after the load returns."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from slurm_resilience.checkpoint import dcp_reader
from slurm_resilience.checkpoint.blocks import BLOCK_SIZE
from slurm_resilience.checkpoint.commit import CheckpointError, step_name
from slurm_resilience.checkpoint.dcp_reader import ParallelReads, StagingReader
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.ranges import ByteRange, LocalRanges

DATA = "rank-00000/data.distcp"


def _state(seed: int) -> dict[str, object]:
    """Several tensors of several dtypes and sizes (one spans 5 blocks, one is empty),
    a transposed view (read through a buffer) and plain values (read as bytes)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(300_000, generator=g),
        "half": torch.randn(1000, 37, generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1 << 40, (5000,), generator=g, dtype=torch.int64),
        "empty": torch.zeros(0),
        "view": torch.randn(64, 48, generator=g).t(),
        "opt": {"lr": 1e-3 * seed, "betas": (0.9, 0.99), "name": f"run-{seed}"},
        "step": seed,
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _snapshot(state: dict[str, object]) -> dict[str, object]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _saved(job: Path, *steps: int) -> None:
    mgr = CheckpointManager(job)
    for s in steps:
        mgr.save(s, _state(s))
    mgr.close()


def _no_read_threads() -> bool:
    return not any(t.name.startswith("ckpt-read") for t in threading.enumerate())


@pytest.mark.parametrize(("threads", "chunk", "limit"), [
    (1, None, None),  # one thread, the default task size
    (4, 1000, None),  # many small tasks, runs split off any alignment
    (3, 4096, 1),  # buffered pieces finished one at a time
    (8, 1 << 20, 0),
])
def test_any_split_into_read_tasks_loads_what_was_saved(
        tmp_path: Path, threads: int, chunk: int | None, limit: int | None) -> None:
    _saved(tmp_path, 3)
    dest = _state(99)
    view = dest["view"]
    reader = StagingReader(tmp_path, 3, threads=threads, read_chunk=chunk, staging_limit=limit)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert _same(dest, _state(3))
    assert dest["view"] is view  # the strided destination filled in place, through a buffer
    data = (tmp_path / step_name(3) / DATA).stat().st_size
    assert reader.bytes_read == data
    assert _no_read_threads()


@pytest.mark.parametrize("pos", [0, BLOCK_SIZE - 1, BLOCK_SIZE, 2 * BLOCK_SIZE + 7,
                                 3 * BLOCK_SIZE, 4 * BLOCK_SIZE + 1, -1])
def test_a_flip_in_any_block_loads_nothing_into_the_tensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pos: int) -> None:
    """With reads split into many small parallel tasks, a flipped bit in any block (first,
    inner, last and short tail) fails the load before any byte reaches the tensors."""
    monkeypatch.setattr(dcp_reader, "READ_CHUNK", 4096)
    _saved(tmp_path, 2)
    target = tmp_path / step_name(2) / DATA
    data = bytearray(target.read_bytes())
    assert len(data) > 5 * BLOCK_SIZE
    data[pos] ^= 0x10
    target.write_bytes(bytes(data))
    fresh = _state(99)
    before = _snapshot(fresh)
    assert CheckpointManager(tmp_path, allow_fresh_start=True).load_latest(fresh) is None
    assert _same(fresh, before)
    assert _no_read_threads()


class TruncatingRanges(LocalRanges):
    """Verifies the step, then loses all but its first 64 KiB: reads fail mid-load."""

    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        super().ensure(step, ranges)
        os.truncate(self.job_dir / step_name(step) / DATA, 65536)


def test_a_read_that_fails_raises_and_no_read_runs_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp_reader, "READ_CHUNK", 8192)
    _saved(tmp_path, 2)
    mgr = CheckpointManager(tmp_path, ranges=TruncatingRanges(tmp_path), allow_fresh_start=True)
    with pytest.raises(CheckpointError, match=r"couldn't load committed step 2: .*ends at byte "
                                              r".*holds part of the step"):
        mgr.load_latest(_state(99))
    assert _no_read_threads()


def test_parallel_reads_fill_each_view_and_name_a_short_file(tmp_path: Path) -> None:
    """ParallelReads alone: runs split and packed into batches land at their offsets;
    waiting on a batch past the file's end raises naming the file and the byte, and
    close() cancels what has not started."""
    payload = os.urandom(100_000)
    (tmp_path / "f").write_bytes(payload)
    reads = ParallelReads(7, tmp_path, threads=3, chunk=3000)
    bufs = [bytearray(n) for n in (10, 0, 25_000, 1, 4000)]
    offsets = [0, 5, 99_000 - 25_000, 99_999, 12_345]
    seqs = [reads.add("f", memoryview(b), off) for b, off in zip(bufs, offsets, strict=True)]
    assert seqs[1] == -1 and seqs[0] == 0  # nothing to read for an empty view
    reads.wait(max(seqs))
    for b, off in zip(bufs, offsets, strict=True):
        assert bytes(b) == payload[off:off + len(b)]
    assert reads.bytes_read == sum(map(len, bufs))
    far = bytearray(5000)
    seq = reads.add("f", memoryview(far), 98_000)
    with pytest.raises(CheckpointError, match=r"step 7: f ends at byte 100000, the restore "
                                              r"needs 101000"):
        reads.wait(seq)
    reads.close()
    assert _no_read_threads()
    other = ParallelReads(7, tmp_path, threads=1, chunk=10)
    with pytest.raises(CheckpointError, match="step 7: couldn't open missing"):
        other.add("missing", memoryview(far), 0)
    other.close()
