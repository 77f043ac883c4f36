"""Root-side staging dirs: created owned and 0700, walked and cleaned without following links."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.checkpoint.staging import (
    STALE,
    clean_tmp,
    create_job_dir,
    open_job_dir,
    open_owned_file,
    remove_job_dir,
    remove_stale,
)

UID, GID = 54321, 54321

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root-side code: chown needs root")


@pytest.fixture
def root(tmp_path: Path) -> str:
    r = tmp_path / "nvme"
    r.mkdir(mode=0o755)
    return str(r)


def test_job_dir_is_owned_by_user_mode_0700(root: str) -> None:
    """The prolog's dir belongs to the job's user with mode 0700."""
    d = create_job_dir(root, 42, UID, GID)
    st = os.lstat(d)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, GID, 0o700)


def test_job_dir_symlink_is_not_followed(root: str, tmp_path: Path) -> None:
    """A symlink where the job dir goes is set aside (never followed, never a drain), a real
    dir takes its place, and the link's target is untouched."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    os.symlink(victim, Path(root) / "job-42")
    d = create_job_dir(root, 42, UID, GID)
    assert not d.is_symlink() and os.lstat(d).st_uid == UID
    assert os.stat(victim).st_uid == 0 and stat.S_IMODE(os.stat(victim).st_mode) == 0o755
    (aside,) = os.listdir(Path(root) / STALE)
    assert os.path.islink(Path(root) / STALE / aside)


def test_reused_job_id_sets_another_users_leftover_aside(root: str) -> None:
    """A leftover job dir of another user (job IDs reused after a controller reset) is set
    aside in a root-only dir and removed later by the agent; the new job gets a fresh dir."""
    old = Path(root) / "job-9"
    old.mkdir()
    (old / "deep").mkdir()
    (old / "deep" / "f").write_bytes(b"old user's data")
    os.chown(old, UID + 1, GID + 1)
    d = create_job_dir(root, 9, UID, GID)
    assert os.lstat(d).st_uid == UID and os.listdir(d) == []
    stale = Path(root) / STALE
    assert stat.S_IMODE(os.lstat(stale).st_mode) == 0o700 and os.lstat(stale).st_uid == 0
    (aside,) = os.listdir(stale)
    assert os.lstat(stale / aside).st_uid == UID + 1
    assert remove_stale(root) == 1 and os.listdir(stale) == []


def test_symlinked_or_writable_root_is_refused(tmp_path: Path) -> None:
    """The staging root itself must be a real, root-owned, not world-writable directory."""
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    with pytest.raises(CheckpointError, match="symlink"):
        create_job_dir(str(tmp_path / "link"), 1, UID, GID)
    real.chmod(0o777)
    with pytest.raises(CheckpointError, match="group/world-writable"):
        create_job_dir(str(real), 1, UID, GID)


def test_open_owned_file_refuses_links_foreign_and_hardlinked_files(root: str) -> None:
    """Only regular, single-link files of the job's user can be opened for upload."""
    d = create_job_dir(root, 7, UID, GID)
    (d / "sub").mkdir()
    (d / "sub" / "ok").write_bytes(b"1")
    os.chown(d / "sub" / "ok", UID, GID)
    os.symlink("/etc/shadow", d / "sub" / "link")
    (d / "sub" / "rootfile").write_bytes(b"secret")
    outside = Path(root).parent / "outside"
    outside.write_bytes(b"someone else's data, hard-linked in")
    os.chown(outside, UID, GID)
    os.link(outside, d / "sub" / "hard")
    os.symlink("/etc", d / "etclink")
    with open_job_dir(root, 7) as jfd:
        os.close(open_owned_file(jfd, "sub/ok", UID))
        with pytest.raises(CheckpointError, match="symlink"):
            open_owned_file(jfd, "sub/link", UID)
        with pytest.raises(CheckpointError, match="owned by uid"):
            open_owned_file(jfd, "sub/rootfile", UID)
        with pytest.raises(CheckpointError, match="links 2"):
            open_owned_file(jfd, "sub/hard", UID)
        with pytest.raises(OSError):
            open_owned_file(jfd, "etclink/passwd", UID)


def test_cleanup_removes_links_not_their_targets(root: str, tmp_path: Path) -> None:
    """Cleaning removes crashed .tmp saves and planted links; the link targets survive."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    d = create_job_dir(root, 9, UID, GID)
    (d / "step-00000001" / "rank-00000.tmp").mkdir(parents=True)
    os.symlink(victim, d / "step-00000001" / "rank-00000.tmp" / "inner")
    os.symlink(victim, d / "step-00000001" / "evil")
    os.symlink("/etc", d / "etc")
    removed = clean_tmp(root, 9)
    assert sorted(removed) == ["etc", "step-00000001/evil", "step-00000001/rank-00000.tmp"]
    assert (victim / "precious").read_text() == "keep"
    os.symlink(victim, d / "step-00000001" / "again")
    assert remove_job_dir(root, 9) and not d.exists()
    assert (victim / "precious").read_text() == "keep" and os.path.isdir("/etc")
