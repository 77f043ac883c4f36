"""The local commit protocol: tmp dir, manifest with CRC32C, rename, never overwrite."""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c
import pytest

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    CommitMarker,
    Crc32c,
    Manifest,
    StepExists,
    begin_part,
    check_relpath,
    commit_part,
    committed_steps,
    read_manifest,
    verify_part,
    verify_step,
    write_commit_marker,
)


def _commit(job: Path, step: int, rank: int = 0, data: bytes = b"abc") -> Path:
    tmp = begin_part(job, step, rank)
    (tmp / "state.bin").write_bytes(data)
    commit_part(tmp, step, rank)
    return tmp.with_name(tmp.name.removesuffix(".tmp"))


def test_crc_matches_reference_for_writable_and_readonly_buffers() -> None:
    """Our streaming CRC32C equals google-crc32c's for bytes, bytearray and memoryview slices."""
    data = bytearray(os.urandom(100_000))
    for chunks in ([bytes(data)], [data[:10], memoryview(data)[10:]]):
        crc = Crc32c()
        for c in chunks:
            crc.update(c)
        assert crc.value == google_crc32c.value(bytes(data))


def test_commit_writes_manifest_renames_and_verifies(tmp_path: Path) -> None:
    """A committed part has a manifest with size and crc32c and loses its .tmp suffix."""
    part = _commit(tmp_path, 5, data=b"hello")
    assert part.name == "rank-00000" and not (part.parent / "rank-00000.tmp").exists()
    m = read_manifest(part)
    assert [(f.path, f.size, f.crc32c) for f in m.files] == [
        ("state.bin", 5, f"{google_crc32c.value(b'hello'):08x}")]
    assert verify_part(part, 5) == m


def test_step_without_marker_is_not_complete(tmp_path: Path) -> None:
    """Only a step with COMMIT.json counts; a crashed save (.tmp only) is ignored."""
    _commit(tmp_path, 5)
    tmp = begin_part(tmp_path, 10, 0)
    (tmp / "state.bin").write_bytes(b"partial")
    assert committed_steps(tmp_path) == []
    write_commit_marker(tmp_path, 5, 1)
    assert committed_steps(tmp_path) == [5]
    assert verify_step(tmp_path, 5).world_size == 1


def test_committed_step_is_never_overwritten(tmp_path: Path) -> None:
    """begin_part refuses a step/rank that is already committed."""
    _commit(tmp_path, 5)
    with pytest.raises(StepExists, match="never overwritten"):
        begin_part(tmp_path, 5, 0)


def test_corruption_is_detected(tmp_path: Path) -> None:
    """Flipping one byte of a committed file makes verification fail with actual vs expected."""
    part = _commit(tmp_path, 5, data=b"x" * 1000)
    with open(part / "state.bin", "r+b") as fh:
        fh.seek(500)
        fh.write(b"y")
    with pytest.raises(CheckpointError, match="expected size 1000"):
        verify_part(part)


def test_symlink_in_part_is_refused(tmp_path: Path) -> None:
    """A framework leaving a symlink in its directory cannot commit it."""
    tmp = begin_part(tmp_path, 1, 0)
    os.symlink("/etc/passwd", tmp / "evil")
    with pytest.raises(CheckpointError, match="symlink"):
        commit_part(tmp, 1, 0)


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a//b", "a/./b", ""])
def test_manifest_paths_must_be_plain(path: str) -> None:
    """Manifest paths with '..', absolute or empty parts are rejected."""
    with pytest.raises(CheckpointError, match="plain relative path"):
        check_relpath(path)


def test_manifest_and_marker_round_trip_and_reject_garbage() -> None:
    """Manifests and markers parse back; malformed ones are a clear error."""
    m = Manifest.from_json(b'{"format":1,"checksum":"crc32c","step":3,"rank":1,'
                           b'"files":[{"path":"a","size":1,"crc32c":"00000000"}]}')
    assert Manifest.from_json(m.to_json()) == m
    assert CommitMarker.from_json(CommitMarker(3, 2).to_json()) == CommitMarker(3, 2)
    with pytest.raises(CheckpointError, match="not a plain relative path"):
        Manifest.from_json(b'{"format":1,"checksum":"crc32c","files":[{"path":"../x"}]}')
    with pytest.raises(CheckpointError, match="not a valid commit marker"):
        CommitMarker.from_json(b"[]")
    assert COMMIT == "COMMIT.json"


def test_checksumming_writer_pipelines_large_writes_correctly(tmp_path: Path) -> None:
    """Large writes checksummed on the helper thread give the same CRC and bytes as inline."""
    from slurm_resilience.checkpoint.commit import ChecksummingWriter

    small, big = os.urandom(1000), bytearray(os.urandom(40 * 1024 * 1024 + 7))
    w = ChecksummingWriter(tmp_path / "f")
    w.write(small)
    w.write(memoryview(big))
    w.write(small)
    entry = w.close()
    data = (tmp_path / "f").read_bytes()
    assert data == small + bytes(big) + small
    assert (entry.size, entry.crc32c) == (len(data), f"{google_crc32c.value(data):08x}")


def test_block_checksums_verify_ranges_on_their_own(tmp_path: Path) -> None:
    """Per-block CRC32Cs in the manifest check a byte range without reading the whole file."""
    from slurm_resilience.checkpoint.blocks import bad_blocks, covering
    from slurm_resilience.checkpoint.commit import ChecksummingWriter, FileEntry

    data = bytes(range(256)) * 4099  # not a multiple of the block size
    w = ChecksummingWriter(tmp_path / "f")
    for i in range(0, len(data), 1000):
        w.write(data[i:i + 1000])
    entry = w.close()
    from slurm_resilience.checkpoint.blocks import BLOCK_SIZE

    assert len(entry.blocks) == -(-entry.size // BLOCK_SIZE)
    assert Manifest.from_json(Manifest(1, 0, (entry,)).to_json()).files == (entry,)
    # Recompute with a small block size through commit's re-read path and damage one block.
    from slurm_resilience.checkpoint.blocks import file_checksums

    fd = os.open(tmp_path / "f", os.O_RDWR)
    try:
        size, crc, blocks = file_checksums(fd, 4096)
        assert (size, crc) == (entry.size, entry.crc32c) and len(blocks) == -(-size // 4096)
        small = FileEntry(entry.path, size, crc, blocks, 4096)
        os.pwrite(fd, b"\xff", 5000)
        assert bad_blocks(fd, size, small.blocks, covering(4000, 2000, size, 4096), 4096) == [1]
        assert bad_blocks(fd, size, small.blocks, covering(0, 4096, size, 4096), 4096) == []
    finally:
        os.close(fd)
    with pytest.raises(CheckpointError, match="block checksums"):
        Manifest.from_json(b'{"format":2,"checksum":"crc32c","step":1,"rank":0,"files":'
                           b'[{"path":"a","size":10,"crc32c":"0","block_size":4,'
                           b'"blocks":["0"]}]}')
