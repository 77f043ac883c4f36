"""Restores you can trust bit for bit: a flipped bit anywhere in what a local restore reads
(every block of a multi-block file, block edges, the short last block, ``.metadata``, the
manifests) is caught before the caller's tensors change; they keep every element."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import dcp_ranks as ranks
import pytest
import torch

from slurm_resilience.checkpoint.blocks import BLOCK_SIZE
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CorruptStep,
    read_manifest,
    step_name,
)
from slurm_resilience.checkpoint.dcp_verify import StepManifests, block_spans
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.ranges import ByteRange, LocalRanges

N = 300_000  # float32: 1,200,000 bytes, 4 whole 256 KiB blocks and a short fifth
DATA = "rank-00000/data.distcp"
META = "rank-00000/.metadata"


def _state(seed: int, n: int = N) -> dict[str, object]:
    """A model-like state: one multi-block tensor, a small one, and a plain value."""
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)},
            "step": seed}


def _copy(state: dict[str, object]) -> dict[str, object]:
    model = state["model"]
    assert isinstance(model, dict)
    return {"model": {k: v.clone() for k, v in model.items()}, "step": state["step"]}


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    """Every element and value equal (bit for bit: NaN-free random data)."""
    ma, mb = a["model"], b["model"]
    assert isinstance(ma, dict) and isinstance(mb, dict)
    return a["step"] == b["step"] and ma.keys() == mb.keys() and all(
        torch.equal(ma[k], mb[k]) for k in ma)


def _saved(job: Path, *steps: int, n: int = N) -> None:
    mgr = CheckpointManager(job)
    for s in steps:
        mgr.save(s, _state(s, n))
    mgr.close()


def _flip(path: Path, pos: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 1 << bit
    path.write_bytes(bytes(data))


def _edges(size: int) -> list[int]:
    """First and last byte of every block of a file of ``size`` bytes (the short one too)."""
    out = []
    for start in range(0, size, BLOCK_SIZE):
        out += [start, min(size, start + BLOCK_SIZE) - 1]
    return out


def _check_positions(job: Path, relpath: str, positions: list[int],
                     capsys: pytest.CaptureFixture[str]) -> None:
    """Each flip in step 2's ``relpath``: the restore falls back to step 1 (every element
    step 1's, no mix), and with step 1 gone a fresh start leaves the fresh state as it was."""
    target = job / step_name(2) / relpath
    for pos in positions:
        _flip(target, pos)
        state = _state(99)
        got = CheckpointManager(job).load_latest(state)
        assert got is not None and got.step == 1, (relpath, pos)
        assert _same(state, _state(1)), (relpath, pos)
        assert "committed step 2 does not verify" in capsys.readouterr().err
        (job / step_name(1)).rename(job / "aside")
        fresh = _state(99)
        before = _copy(fresh)
        assert CheckpointManager(job, allow_fresh_start=True).load_latest(fresh) is None
        assert _same(fresh, before), (relpath, pos)
        assert "STARTING FROM SCRATCH" in capsys.readouterr().err
        with pytest.raises(CheckpointError, match="does not verify"):
            CheckpointManager(job).load_latest(_state(99))
        (job / "aside").rename(job / step_name(1))
        _flip(target, pos)
    assert _same(_loaded(job), _state(2))  # unflipped, step 2 loads again


def _loaded(job: Path) -> dict[str, object]:
    state = _state(99)
    got = CheckpointManager(job).load_latest(state)
    assert got is not None and got.step == 2
    return state


def test_a_flip_in_any_block_of_a_local_data_file_is_caught_and_loads_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bit flipped at the first or last byte of every 256 KiB block of a committed local
    step's data.distcp (blocks 1 and 3 included, and the short last block) fails the
    restore: it falls back to the older step or starts fresh, the caller's tensors
    untouched."""
    _saved(tmp_path, 1, 2)
    size = (tmp_path / step_name(2) / DATA).stat().st_size
    assert size > 4 * BLOCK_SIZE and size % BLOCK_SIZE
    _check_positions(tmp_path, DATA, [*_edges(size), 4 * BLOCK_SIZE + 1000], capsys)


def test_a_flip_in_metadata_is_caught_before_it_is_unpickled(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bit flipped in .metadata (first, middle and last byte) is a failed verification:
    fallback or fresh start, never an unpickling error or a half-loaded state."""
    _saved(tmp_path, 1, 2)
    size = (tmp_path / step_name(2) / META).stat().st_size
    _check_positions(tmp_path, META, [0, size // 2, size - 1], capsys)


def test_flips_in_a_manifest_are_caught_end_to_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Flips in rank 0's manifest (a block CRC32C, the file CRC32C, a size digit, the step,
    the save id) fail the restore the same way."""
    _saved(tmp_path, 1, 2)
    text = (tmp_path / step_name(2) / "rank-00000" / MANIFEST).read_text()
    m = read_manifest(tmp_path / step_name(2) / "rank-00000")
    data = next(f for f in m.files if f.path == "data.distcp")
    positions = [text.index(data.blocks[3]) + 2, text.index(data.crc32c) + 7,
                 text.index(f'"size": {data.size}') + 9, text.index('"step": 2') + 8,
                 text.index(m.save_id) + 20]
    _check_positions(tmp_path, f"rank-00000/{MANIFEST}", positions, capsys)


def _outcome(job: Path, files: list[tuple[str, int]]) -> object:
    """What a restore of the whole of ``files`` of step 2 sees: "caught", or what the
    manifest vouches for (sizes, CRC32Cs and block spans)."""
    try:
        LocalRanges(job).ensure(2, [ByteRange(rel, 0, size) for rel, size in files])
        m = StepManifests.open(job / step_name(2), 2)
        entries = [m.entry(rel) for rel, _ in files]
        return [(e.path, e.size, e.crc32c, block_spans(e)) for e in entries]
    except CorruptStep:
        return "caught"


def _vouches_the_same(got: object, want: object) -> bool:
    """The same files, sizes and CRC32Cs, each checked by its blocks or, where the flip
    hid the block list (read as a format-1 entry), whole against the file's CRC32C."""
    assert isinstance(got, list) and isinstance(want, list)
    return len(got) == len(want) and all(g[:3] == w[:3] and g[3] in (w[3], [(0, w[2], 0, w[1])])
                                         for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("name", [f"rank-00000/{MANIFEST}", COMMIT])
def test_every_flip_in_a_manifest_or_marker_is_caught_or_changes_nothing(
        tmp_path: Path, name: str) -> None:
    """A bit flipped anywhere in the manifest (or the commit marker) either fails
    verification or leaves every entry the restore uses exactly as it was: no flip makes
    a restore trust bytes its manifest does not vouch for."""
    _saved(tmp_path, 2, n=BLOCK_SIZE // 4 + 100)  # two blocks, the second short
    sdir = tmp_path / step_name(2)
    files = [(rel, (sdir / rel).stat().st_size) for rel in (DATA, META)]
    want = _outcome(tmp_path, files)
    assert want != "caught"
    target = sdir / name
    caught, raw = 0, target.read_bytes()
    for pos in range(len(raw)):
        # Each bit position across the bytes, and the case bit of letters (hex digits).
        for bit in {pos % 8, 5} if chr(raw[pos]).isalpha() else {pos % 8}:
            _flip(target, pos, bit)
            got = _outcome(tmp_path, files)
            _flip(target, pos, bit)
            assert got == "caught" or _vouches_the_same(got, want), (pos, bit)
            caught += got == "caught"
    assert caught > len(raw) * 0.9  # nearly all flips are caught, few merely harmless


def test_blocks_a_range_touches_only_in_part_are_verified(tmp_path: Path) -> None:
    """A reshard reads part of a block: LocalRanges checks that whole block (a flip in its
    unread bytes is caught) and leaves blocks no range touches alone."""
    _saved(tmp_path, 2)
    target = tmp_path / step_name(2) / DATA
    part = [ByteRange(DATA, 2 * BLOCK_SIZE + 100, 10)]
    LocalRanges(tmp_path).ensure(2, part)
    _flip(target, 2 * BLOCK_SIZE + 5000)
    with pytest.raises(CorruptStep, match=r"data\.distcp bytes 524288-786432 \(block 2\)"):
        LocalRanges(tmp_path).ensure(2, part)
    _flip(target, 2 * BLOCK_SIZE + 5000)
    _flip(target, 3 * BLOCK_SIZE)
    source = LocalRanges(tmp_path)
    source.ensure(2, part)
    assert source.blocks_checked == 1


def test_a_flip_read_by_another_rank_in_a_reshard_changes_no_rank_s_tensors(
        tmp_path: Path) -> None:
    """2 ranks save row shards and load column shards (every block read in part, by both
    ranks): a flip in rank 1's file falls back on every rank to step 1, element for
    element, and a fresh start leaves every rank's fresh shard untouched, though rank 0's
    own bytes verified."""
    assert ranks.run_ranks(ranks.reshard_flip, 2, tmp_path) == [0, 0]


class TruncatingRanges(LocalRanges):
    """Verifies the step, then loses the second half of its data: an I/O failure mid-read."""

    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        super().ensure(step, ranges)
        target = self.job_dir / step_name(step) / DATA
        os.truncate(target, target.stat().st_size // 2)


def test_a_failure_after_verification_never_starts_fresh_on_a_half_filled_state(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A load that fails once the verified bytes began to fill the state raises naming the
    step, even with allow_fresh_start: a fresh start (or a fallback) would train on a
    state that holds part of the step."""
    _saved(tmp_path, 1, 2)
    mgr = CheckpointManager(tmp_path, ranges=TruncatingRanges(tmp_path), allow_fresh_start=True)
    with pytest.raises(CheckpointError, match=r"couldn't load committed step 2: .*ends at byte "
                                              r".*holds part of the step"):
        mgr.load_latest(_state(99))
    assert "STARTING FROM SCRATCH" not in capsys.readouterr().err
