"""Tree removal that never follows a planted link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_resilience.nofollow import remove_tree_at


def test_links_are_removed_not_followed(tmp_path: Path) -> None:
    """A symlink to a directory and one to a file inside the tree are unlinked; targets stay."""
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep.txt").write_text("precious")
    tree = tmp_path / "job" / "step-1"
    tree.mkdir(parents=True)
    (tree / "data.bin").write_bytes(b"x")
    (tree / "to-dir").symlink_to(canary)
    (tmp_path / "job" / "to-file").symlink_to(canary / "keep.txt")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_tree_at(fd, "job") == 5
    finally:
        os.close(fd)
    assert not (tmp_path / "job").exists()
    assert (canary / "keep.txt").read_text() == "precious"


def test_missing_entry(tmp_path: Path) -> None:
    """A missing entry raises unless missing_ok, which counts nothing."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError):
            remove_tree_at(fd, "none")
        assert remove_tree_at(fd, "none", missing_ok=True) == 0
    finally:
        os.close(fd)
