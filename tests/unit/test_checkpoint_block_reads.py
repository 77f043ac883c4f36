"""block_reads: parallel reads of a checkpoint file with every block it covers checked."""

from __future__ import annotations

import itertools
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slurm_resilience.checkpoint import block_reads
from slurm_resilience.checkpoint.block_reads import BlockCheck, FileReads, Run
from slurm_resilience.checkpoint.blocks import file_checksums
from slurm_resilience.checkpoint.commit import CorruptStep, FileEntry

BS = 4096
SIZE = 5 * BS + 1000  # five whole blocks and a short tail


def _file(tmp_path: Path) -> tuple[Path, FileEntry]:
    data = random.Random(7).randbytes(SIZE)
    path = tmp_path / "data.distcp"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        size, crc, blocks = file_checksums(fd, BS)
    finally:
        os.close(fd)
    return path, FileEntry("data.distcp", size, crc, blocks, BS)


def _read(path: Path, entry: FileEntry, cuts: list[int]) -> tuple[bytearray, BlockCheck]:
    """Read the whole file as runs split at ``cuts`` into one buffer, with 3 threads."""
    out = bytearray(entry.size)
    view = memoryview(out)
    bounds = [0, *cuts, entry.size]
    runs = [Run(a, view[a:b]) for a, b in itertools.pairwise(bounds)]
    check = BlockCheck(9, "rank-00000/data.distcp", entry)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(3) as pool:
            assert FileReads(fd, 9, "rank-00000/data.distcp", check, pool).read(runs) == SIZE
        check.finish(fd)
    finally:
        os.close(fd)
    return out, check


CUTS = [100, BS - 1, BS, 2 * BS + 17, 4 * BS, 5 * BS + 3]


def test_every_block_is_checked_whatever_the_runs(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs cut inside and at block boundaries, in tasks smaller than the file: the bytes
    arrive intact and every block, the short tail included, is checked once."""
    monkeypatch.setattr(block_reads, "TASK_BYTES", 2 * BS)
    path, entry = _file(tmp_path)
    out, check = _read(path, entry, CUTS)
    assert bytes(out) == path.read_bytes()
    assert check.checked == set(range(6))


@pytest.mark.parametrize("at", sorted({0, 99, 100, BS - 1, BS, 2 * BS + 16, 2 * BS + 17,
                                       3 * BS + 5, 4 * BS - 1, 4 * BS, 5 * BS, SIZE - 1}))
def test_a_flipped_bit_in_any_block_is_caught(tmp_path: Path, at: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One bit flipped anywhere (block boundaries, run cuts, the tail) fails the read with a
    CorruptStep naming the block that holds it."""
    monkeypatch.setattr(block_reads, "TASK_BYTES", 2 * BS)
    path, entry = _file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(raw)
    with pytest.raises(CorruptStep, match=rf"\(block {at // BS}\)"):
        _read(path, entry, CUTS)


def test_a_piece_that_differs_from_its_verified_block_is_caught(tmp_path: Path) -> None:
    """A block read in pieces whose file changed between the piece's read and the block's
    check (the piece no longer matches the verified block) fails the read."""
    path, entry = _file(tmp_path)
    check = BlockCheck(9, "rank-00000/data.distcp", entry)
    stale = bytearray(path.read_bytes()[BS + 10:BS + 50])
    stale[0] ^= 1
    check.piece(BS + 10, memoryview(stale))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptStep, match=r"changed between two reads"):
            check.finish(fd)
    finally:
        os.close(fd)


def test_restore_into_every_kind_of_destination_in_small_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore whose destinations are a strided view, another dtype and plain tensors,
    with one item per batch of scratch buffers, loads every value and checks every block
    of the data file once."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load

    from slurm_resilience.checkpoint import dcp_reader
    from slurm_resilience.checkpoint.commit import read_manifest
    from slurm_resilience.checkpoint.manager import CheckpointManager

    monkeypatch.setattr(dcp_reader, "SCRATCH_BYTES", 1)
    monkeypatch.setattr(block_reads, "TASK_BYTES", 64 * 1024)
    a, b, c = torch.randn(300, 500), torch.randn(700, 3), torch.arange(5.0)
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"a": a, "b": b, "c": c, "meta": {"lr": 0.5}})
    mgr.close()
    strided, wide, plain = (torch.zeros(500, 300).t(), torch.zeros(700, 3, dtype=torch.float64),
                            torch.zeros(5))
    dest = {"a": strided, "b": wide, "c": plain, "meta": {"lr": 0.0}}
    reader = mgr.storage_reader(3)
    load(dest, storage_reader=reader, no_dist=True)
    assert torch.equal(strided, a) and torch.equal(plain, c) and torch.equal(wide, b.double())
    assert dest["meta"] == {"lr": 0.5}
    entry = next(f for f in read_manifest(tmp_path / "step-00000003" / "rank-00000").files
                 if f.path == "data.distcp")
    assert reader.blocks_verified == len(entry.blocks)
