"""A job's run directory under hostile use: bounded by its own tmpfs, removed within the
epilog's budget (the rest set aside for the agent), and another user's leftover under a
reused job id set aside, never a drain. Root only: real mounts, real users."""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON_SYS, as_user, events_saying

from slurm_resilience.config import Config, load_text
from slurm_resilience.hang import jobfs, steps
from slurm_resilience.hang.stale import StaleSweeper
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.proc import CommandError
from slurm_resilience.sandbox import sweep
from slurm_resilience.testing import FakeClock

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root-side hooks, real mounts")


class Ticks(FakeClock):
    """A clock that moves one second each time it is read."""

    def monotonic(self) -> float:
        self.advance(1.0)
        return super().monotonic()


def _cfg(tmp_path: Path, *, tmpfs: bool, size: str = "1MiB", inodes: int = 64) -> Config:
    return load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state", f"  run_dir: {tmp_path}/run/{{node}}",
        "  job_tmpfs:", f"    enabled: {'true' if tmpfs else 'false'}", f"    size: {size}",
        f"    inodes: {inodes}"]) + "\n")


def _ctx(cfg: Config, kind: str, job: int, user: str) -> HookContext:
    pw = pwd.getpwnam(user)
    return HookContext(kind=kind, cfg=cfg, node="n1", env={}, job_id=job,  # type: ignore[arg-type]
                       uid=pw.pw_uid, gid=pw.pw_gid, user=user)


@pytest.fixture(autouse=True)
def _no_mount_left(tmp_path: Path) -> Iterator[None]:
    yield
    sweep.unmount_under(tmp_path)  # a failed test leaves no mount behind


# What a job writes, as its own user, through the directory fd it inherits: as many files as
# it can, then one file as big as it can. Stops at the first error (or a sane ceiling).
_FILL = """
import errno, json, os, sys
fd = int(sys.argv[1])
n, err = 0, None
try:
    while n < 100000:
        os.close(os.open(f"f{n}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        n += 1
except OSError as e:
    err = e.errno
for i in range(n):
    os.unlink(f"f{i}", dir_fd=fd)
size, big_err = 0, None
out = os.open("big", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd)
try:
    while size < 64 << 20:
        size += os.write(out, b"x" * 65536)
except OSError as e:
    big_err = e.errno
print(json.dumps({"files": n, "files_errno": err, "bytes": size, "bytes_errno": big_err}))
"""


def test_a_job_cannot_write_past_its_tmpfs_and_the_epilog_unmounts_it(
        tmp_path: Path, events: Path, test_users: tuple[str, ...]) -> None:
    """The prolog mounts a 1 MiB, 64-inode tmpfs owned by the job's user; that user, writing
    as hard as it can, hits ENOSPC at the caps. A second prolog of the same id (a requeue)
    detaches the first mount and sets it aside; the epilog detaches the tmpfs and removes
    the dir, leaving no mount behind."""
    user = test_users[0]
    cfg = _cfg(tmp_path, tmpfs=True)
    run = tmp_path / "run" / "n1"
    assert steps.prolog_run_dir(_ctx(cfg, "prolog", 61, user)) == []
    job = run / "job-61"
    assert sweep.mounts_under(tmp_path) == [str(job)]
    st = os.stat(job)
    assert (st.st_uid, st.st_mode & 0o777) == (pwd.getpwnam(user).pw_uid, 0o700)
    jfd = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    try:
        done = subprocess.run([PYTHON_SYS, "-I", "-c", _FILL, str(jfd)], **as_user(user),
                              pass_fds=(jfd,), capture_output=True, text=True, timeout=120,
                              check=True)
    finally:
        os.close(jfd)
    wrote = json.loads(done.stdout)
    assert wrote["files_errno"] == 28 and wrote["files"] < 64  # ENOSPC: out of inodes
    assert wrote["bytes_errno"] == 28 and wrote["bytes"] <= 1 << 20  # ENOSPC: out of size
    # A requeue of the same id: the earlier mount is detached and set aside, one mount left.
    assert steps.prolog_run_dir(_ctx(cfg, "prolog", 61, user)) == []
    assert sweep.mounts_under(tmp_path) == [str(job)]
    assert len(os.listdir(run / ".stale")) == 1
    assert steps.epilog_run_dir(_ctx(cfg, "epilog", 61, user)) == []
    assert sweep.mounts_under(tmp_path) == [] and not job.exists()


def test_a_mount_that_fails_gives_a_plain_dir_and_says_why(tmp_path: Path,
                                                          events: Path) -> None:
    """mount(8) failing (no CAP_SYS_ADMIN in a container, say) is no drain and no failed
    job: the job gets the plain dir it always had, and an error event names the cause."""

    class NoMount:
        def run(self, argv: list[str], **_: object) -> None:
            raise CommandError(argv, "mount: permission denied")

    cfg = _cfg(tmp_path, tmpfs=True)
    ctx = dataclasses.replace(_ctx(cfg, "prolog", 62, "root"), uid=54321, gid=54321)
    assert steps.prolog_run_dir(ctx, run=NoMount()) == []  # type: ignore[arg-type]
    job = tmp_path / "run" / "n1" / "job-62"
    st = os.lstat(job)
    assert (st.st_uid, st.st_mode & 0o777) == (54321, 0o700)
    assert st.st_dev == os.stat(job.parent).st_dev and sweep.mounts_under(tmp_path) == []
    said = events_saying(events, "couldn't mount a size-limited tmpfs")
    assert said and "permission denied" in str(said[0]["error"]) and said[0]["level"] == "error"


def test_epilog_hands_a_run_dir_too_big_for_its_budget_to_the_agent(tmp_path: Path,
                                                                   events: Path) -> None:
    """A plain run dir (tmpfs off) with more files than the epilog's share of its spare time
    allows (the clock runs a second per look): the rest is set aside under .stale/ at once,
    said, and the agent's sweeper removes it in bounded passes."""
    cfg = _cfg(tmp_path, tmpfs=False)
    ctx = dataclasses.replace(_ctx(cfg, "prolog", 63, "root"), uid=54321, gid=54321)
    assert steps.prolog_run_dir(ctx) == []
    run = tmp_path / "run" / "n1"
    for i in range(20):
        (run / "job-63" / f"d{i}").mkdir()
        for j in range(10):
            (run / "job-63" / f"d{i}" / f"f{j}").write_bytes(b"x")
    assert steps.epilog_run_dir(dataclasses.replace(ctx, kind="epilog"), clock=Ticks()) == []
    assert not (run / "job-63").exists() and not (run / "jobs" / "63.json").exists()
    assert len(os.listdir(run / ".stale")) == 1
    said = events_saying(events, "handed to the agent")
    assert said and "time budget" in str(said[0]["removal"])
    sweeper = StaleSweeper(cfg, "n1", max_entries=50)
    passes = 0
    while sweeper.pending():
        assert sweeper.sweep() <= 50  # each pass bounded, the rest waits for the next
        passes += 1
        assert passes < 20
    assert passes > 1 and os.listdir(run / ".stale") == []


def test_another_users_leftover_under_a_reused_job_id_is_set_aside_never_a_drain(
        tmp_path: Path, events: Path, test_users: tuple[str, ...]) -> None:
    """After a controller reset job id 64 comes back for another user, and the first user's
    dir (with a link to /etc planted in it) is still there: it is set aside whole under
    .stale/, nothing is followed, no problem is raised, and the new job gets its own dir."""
    first, second = test_users
    cfg = _cfg(tmp_path, tmpfs=False)
    run = tmp_path / "run" / "n1"
    assert steps.prolog_run_dir(_ctx(cfg, "prolog", 64, first)) == []
    (run / "job-64" / "slot-0").write_bytes(b"x" * 256)
    os.symlink("/etc", run / "job-64" / "etc")
    etc = os.stat("/etc")
    assert steps.prolog_run_dir(_ctx(cfg, "prolog", 64, second)) == []
    assert os.stat(run / "job-64").st_uid == pwd.getpwnam(second).pw_uid
    assert os.listdir(run / "job-64") == []
    (aside,) = os.listdir(run / ".stale")
    assert sorted(os.listdir(run / ".stale" / aside)) == ["etc", "slot-0"]
    said = events_saying(events, "set a leftover job run directory aside")
    assert said and said[0]["owner_uid"] == pwd.getpwnam(first).pw_uid
    StaleSweeper(cfg, "n1").sweep()
    assert os.listdir(run / ".stale") == [] and os.stat("/etc") == etc


def test_run_dir_budget_is_a_share_of_each_hooks_spare_time() -> None:
    """The removal's seconds come from what the hook's limit leaves over; with the staging
    dir's share, the epilog keeps a margin."""
    from slurm_resilience.config.budgets import (
        EPILOG_REMOVE_SHARE,
        RUN_DIR_REMOVE_SHARE,
        hook_waits,
        run_dir_remove_s,
    )

    cfg = load_text(Config, "checkpoint:\n  enabled: true\n")
    for key, limit in (("hooks.prolog_timeout_s", cfg.hooks.prolog_timeout_s),
                       ("hooks.epilog_timeout_s", cfg.hooks.epilog_timeout_s)):
        spare = limit - sum(w.seconds for w in hook_waits(cfg)[key])
        assert spare > 0 and run_dir_remove_s(cfg, key) == spare * RUN_DIR_REMOVE_SHARE
    assert EPILOG_REMOVE_SHARE + RUN_DIR_REMOVE_SHARE < 1
    assert jobfs.options(1, 2, 3, 4) == "size=3,nr_inodes=4,mode=0700,uid=1,gid=2,nosuid," \
                                        "nodev,noexec"
