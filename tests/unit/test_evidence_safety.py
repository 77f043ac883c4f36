"""Root's evidence capture against hostile jobs: job-named paths are opened only when they are
the user's own files, and the evidence deadline holds with many slots and a slow py-spy."""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import as_user, start_sleeper

from slurm_resilience import safefs
from slurm_resilience.hang import evidence
from slurm_resilience.heartbeat.slot import SlotView
from slurm_resilience.heartbeat.writer import process_start_ticks
from slurm_resilience.testing import FakeClock

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks need root")

IN_OPEN = 0x20
_libc = ctypes.CDLL(None, use_errno=True)


class OpenWatch:
    """Kernel-reported opens (inotify IN_OPEN) of anything in the watched directories: an
    O_PATH look at a file is not an open, reading, writing or a driver's open() is."""

    def __init__(self, *dirs: Path):
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        for d in dirs:
            assert _libc.inotify_add_watch(self.fd, str(d).encode(), IN_OPEN) >= 0

    def opened(self) -> int:
        """How many opens were seen since the last call."""
        count = 0
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return count
            off = 0
            while off < len(data):
                count += 1
                off += 16 + int.from_bytes(data[off + 12:off + 16], "little")

    def close(self) -> None:
        os.close(self.fd)


def _as_user(user: str, code: str, *args: str) -> None:
    """Run Python ``code`` as ``user`` (what a hostile job would do on the node)."""
    pw = pwd.getpwnam(user)
    subprocess.run(["/usr/bin/python3", "-c", code, *args],
                   **as_user(pw.pw_uid), check=True, timeout=30)


@pytest.fixture
def arena(test_users: tuple[str, ...]) -> Iterator[tuple[Path, Path, int]]:
    """``(user's 0755 home-like dir, a 0700 root dir, uid)``, under a traversable temp dir."""
    base = Path(tempfile.mkdtemp(prefix="sr-jobpath-", dir="/tmp"))
    base.chmod(0o755)
    pw = pwd.getpwnam(test_users[0])
    mine = base / "mine"
    mine.mkdir(mode=0o755)
    os.chown(mine, pw.pw_uid, pw.pw_gid)
    secret = base / "rootonly"
    secret.mkdir(mode=0o700)
    (secret / "dev0").write_bytes(b"root's secret")
    os.mknod(secret / "fifo0", 0o600 | stat.S_IFIFO)
    yield mine, secret, pw.pw_uid
    shutil.rmtree(base)


HOSTILE = """
import os, sys
mine, secret = sys.argv[1], sys.argv[2]
os.mkfifo(f"{mine}/fifo0")
os.symlink(f"{secret}/dev0", f"{mine}/link0")
os.symlink(secret, f"{mine}/linkdir")
with open(f"{mine}/good0", "wb") as fh:
    fh.write(b"trace bytes")
"""


def test_job_named_paths_open_only_the_users_own_regular_files(
        arena: tuple[Path, Path, int], test_users: tuple[str, ...]) -> None:
    """A FIFO, a device node, a symlink to a root file, a path through a symlinked dir and a
    path in a 0700 root dir are all refused without being opened, with one message; the
    user's own regular file is read."""
    mine, secret, uid = arena
    _as_user(test_users[0], HOSTILE, str(mine), str(secret))
    # A user can't mknod; root puts a device node (like a watchdog) in the user's dir.
    os.mknod(mine / "dev0", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.chown(mine / "dev0", uid, -1)
    (mine / "roots0").write_bytes(b"root-owned file in the user's dir")
    watch = OpenWatch(mine, secret)
    try:
        messages = set()
        for path in (mine / "fifo0", mine / "dev0", mine / "link0", mine / "linkdir" / "dev0",
                     secret / "dev0", secret / "fifo0", secret / "absent", mine / "absent",
                     mine / "roots0", Path(f"{mine}/../rootonly/dev0"), Path("relative0")):
            with pytest.raises(safefs.JobPathRefused) as info:
                safefs.read_job_file(str(path), uid, max_bytes=1 << 20)
            messages.add(str(info.value))
        assert watch.opened() == 0
        assert len(messages) == 1 and str(secret) not in messages.pop()
        data, _ = safefs.read_job_file(str(mine / "good0"), uid, max_bytes=1 << 20)
        assert data == b"trace bytes" and watch.opened() == 1
    finally:
        watch.close()


def test_flight_recorder_dump_in_a_root_dir_is_never_opened(
        arena: tuple[Path, Path, int], test_users: tuple[str, ...]) -> None:
    """TORCH_NCCL_DEBUG_INFO_TEMP_FILE pointing into a 0700 root dir: the recorder is triggered
    through the user's FIFO, the dump is never opened, and the error says nothing about it."""
    mine, secret, uid = arena
    _as_user(test_users[0], "import os, sys; os.mkfifo(sys.argv[1])", str(mine / "pipe0.pipe"))
    pw = pwd.getpwnam(test_users[0])
    env = {"PATH": "/usr/bin:/bin", evidence.NCCL_PIPE_ENV: f"{mine}/pipe",
           evidence.NCCL_FILE_ENV: f"{secret}/dev"}
    job = start_sleeper(env, **as_user(pw.pw_uid))
    # PyTorch's side of the pipe, open before the trigger (a FIFO without a reader refuses
    # a non-blocking writer).
    reader = os.open(mine / "pipe0.pipe", os.O_RDONLY | os.O_NONBLOCK)
    watch = OpenWatch(secret)
    ticks = Ticks()
    try:
        result = evidence.nccl_flight_recorder(job.pid, 0, uid, None, wait_s=3,
                                               clock=ticks, poll_s=0)
    finally:
        job.kill()
        job.wait()
        got = os.read(reader, 16)
        os.close(reader)
        opened = watch.opened()
        watch.close()
    assert got == b"1\n" and opened == 0
    assert result["error"].startswith(f"no dump in {secret}/dev0 within 3s")
    assert "Permission" not in result["error"] and "exist" not in result["error"]


SLOW_PY_SPY = """#!/bin/sh
# A py-spy stand-in that hangs (as py-spy does on a process stuck in the kernel); its own
# child keeps the output pipe open unless the whole process group is killed.
echo $$ >> "{pids}"
sleep 60
"""


def _slots(count: int) -> list[SlotView]:
    me, start = os.getpid(), process_start_ticks()
    return [SlotView(rank=r, world_size=count, local_rank=r, pid=me, pid_start=start, job_id=7,
                     restart_count=0, clock_offset=0.0, created=0.0, job_step_timeout_s=1.0,
                     flags=0, step=1, last_beat=0.0, beats=1, last_dt=0.0, ewma_dt=0.0,
                     min_dt=0.0, max_dt=0.0, ckpt_step=-1, section_start=0.0,
                     section_timeout_s=0.0, section="") for r in range(count)]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


class Ticks(FakeClock):
    """A clock a second later at each reading: a wait ends after a few polls, however
    busy the machine is."""

    def monotonic(self) -> float:
        now = super().monotonic()
        self.advance(1.0)
        return now


class CaptureClock(FakeClock):
    """The capture's clock, moved by the test: it reads 0 while the slow work starts, and
    ``at`` once ``ready()`` says all of it is running (or, so a broken capture can't hang the
    test, after 60 real seconds). Real waits inside are short polls, so the cut follows it."""

    def __init__(self, ready: Callable[[], bool], at: float):
        super().__init__()
        self.ready, self.at = ready, at
        self.moved = False
        self.give_up = time.monotonic() + 60

    def monotonic(self) -> float:
        if not self.moved and (self.ready() or time.monotonic() > self.give_up):
            self.moved = True
        return self.at if self.moved else 0.0


def test_evidence_of_256_slots_with_a_slow_py_spy_stops_at_its_deadline(tmp_path: Path) -> None:
    """256 ranks, a py-spy that never answers and Xid and health checks that never return:
    everything starts at once under one deadline (the configured bound on the capture's
    clock); at its cut (the deadline less the reap grace) every rank and both node checks
    are reported as timed out, the captures not started are cancelled, and every py-spy
    child started was killed and reaped."""
    bound = 20.0
    cut = bound - evidence.reap_grace(bound)
    pids = tmp_path / "pids"
    pids.touch()
    fake = tmp_path / "py-spy"
    fake.write_text(SLOW_PY_SPY.format(pids=pids))
    fake.chmod(0o755)
    given: dict[str, float] = {}
    release = threading.Event()

    def stuck(name: str) -> evidence.NodeCheck:
        def check(left: float) -> dict[str, object]:
            given[name] = left
            release.wait(60)
            return {"checked": True}
        return check

    clock = CaptureClock(lambda: len(pids.read_text().split()) >= 8 and len(given) == 2, cut)
    try:
        outcome = evidence.capture_ranks_bounded(
            _slots(256), os.getuid(), py_spy=str(fake), timeout=bound, workers=8, clock=clock,
            node_checks={"xids": stuck("xids"), "health": stuck("health")})
    finally:
        release.set()
    # One bound for all of it: the node checks began with the ranks, given the time to the
    # cut; the cut came at the first reading of the cut point, the grace after it ends at
    # the deadline.
    assert (outcome.started_at, outcome.deadline) == (0.0, bound)
    assert given == {"xids": cut, "health": cut}
    assert outcome.cut_at == cut and cut + evidence.reap_grace(bound) == outcome.deadline
    assert [e.rank for e in outcome.ranks] == list(range(256))
    assert outcome.timed_out == tuple(range(256))
    assert all(e.stack_error.startswith(evidence.TIMED_OUT) for e in outcome.ranks)
    assert outcome.node_timed_out == ("xids", "health")
    assert all(str(outcome.node[n]["error"]).startswith(evidence.TIMED_OUT)
               for n in ("xids", "health"))
    assert outcome.children_started == 8 and outcome.children_unreaped == ()
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 8 and all(_gone(p) for p in started)


def test_fast_captures_finish_and_are_not_marked_timed_out(tmp_path: Path) -> None:
    """A py-spy that answers at once and quick node checks: every rank's stack and both
    checks' results, no time-out, nothing cut."""
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho \"Thread 1: main (train.py:3)\"\n")
    fake.chmod(0o755)
    outcome = evidence.capture_ranks_bounded(
        _slots(16), os.getuid(), py_spy=str(fake), timeout=60.0, workers=4,
        node_checks={"xids": lambda left: {"checked": True, "findings": []}})
    assert outcome.timed_out == () and outcome.children_unreaped == ()
    assert outcome.cut_at is None and outcome.node_timed_out == ()
    assert outcome.node == {"xids": {"checked": True, "findings": []}}
    assert all("main (train.py:3)" in e.stack for e in outcome.ranks)
