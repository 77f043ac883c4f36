"""Tree removal that never follows a planted link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_resilience.safefs import remove_tree_at
from slurm_resilience.testing import FakeClock


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


def _deep_tree(base: Path, name: str, depth: int) -> None:
    """``depth`` nested dirs, a file at the bottom, made through fds (paths grow past PATH_MAX)."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    os.mkdir(name, dir_fd=fd)
    for _ in range(depth):
        nfd = os.open(name if fd != -1 else "d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
        name = "d"
        os.mkdir(name, dir_fd=fd)
    leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
    os.close(leaf)
    os.close(fd)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_deep_tree_is_removed_with_bounded_fds(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1,500-level tree goes without RecursionError, holding at most MAX_OPEN_DIRS levels."""
    from slurm_resilience import safefs as nofollow

    _deep_tree(tmp_path, "deep", 1500)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    baseline = _open_fds()
    peak = 0
    real_scandir = os.scandir

    def counting_scandir(arg: int) -> object:
        nonlocal peak
        peak = max(peak, _open_fds())
        return real_scandir(arg)

    monkeypatch.setattr(os, "scandir", counting_scandir)
    try:
        assert remove_tree_at(fd, "deep") == 1 + 1500 + 1  # the top, the nested dirs, the leaf
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert not (tmp_path / "deep").exists()
    assert peak - baseline <= 2 * nofollow.MAX_OPEN_DIRS + 2  # a dir fd and its listing


class _Ticks(FakeClock):
    """A clock read a second later each time the removal looks at it."""

    def monotonic(self) -> float:
        now = super().monotonic()
        self.advance(1.0)
        return now


def test_budget_leaves_the_rest_for_the_next_pass(tmp_path: Path) -> None:
    """A spent entry budget raises RemovalIncomplete; the next call finishes the job."""
    from slurm_resilience.safefs import RemovalBudget, RemovalIncomplete

    _deep_tree(tmp_path, "deep", 100)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(RemovalIncomplete, match="entry budget 40 spent") as info:
            remove_tree_at(fd, "deep", budget=RemovalBudget(max_entries=40))
        assert info.value.removed == 40
        assert (tmp_path / "deep").exists()
        with pytest.raises(RemovalIncomplete, match="time budget"):
            remove_tree_at(fd, "deep", budget=RemovalBudget(max_seconds=5, clock=_Ticks()))
        assert remove_tree_at(fd, "deep") > 0
    finally:
        os.close(fd)
    assert not (tmp_path / "deep").exists()
