"""The result cache, the prolog decision, and the node lock hand-off with a real holder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_resilience.nccl import cache, schedule
from slurm_resilience.testing import FakeClock

NOW = 1_700_000_000.0


def fresh(entry: dict[str, object] | None, **kw: object) -> cache.Freshness:
    args: dict[str, object] = {"now": NOW, "validity_s": 3600.0, "boot": "b1",
                               "fingerprint": "fp"}
    args.update(kw)
    return cache.freshness(entry, **args)  # type: ignore[arg-type]


GOOD = {"verdict": "pass", "cached_at": NOW - 60, "boot_id": "b1", "fingerprint": "fp"}


def test_a_recent_pass_is_fresh() -> None:
    """A pass from a minute ago, this boot, same settings: fresh."""
    f = fresh(GOOD)
    assert f.fresh and f.why == "passed 60s ago" and f.age_s == 60


@pytest.mark.parametrize(("change", "why"), [
    ({"cached_at": NOW - 7200}, "last test 7200s ago > 3600s"),
    ({"verdict": "fail"}, "last result was fail"),
    ({"boot_id": "b0"}, "node rebooted since the last test"),
    ({"fingerprint": "other"}, "test settings changed since the last test"),
    ({"invalidated": "node returned to service"}, "invalidated: node returned to service"),
    ({"cached_at": NOW + 600}, "cached result is from the future (clock changed)"),
])
def test_stale_results_say_why(change: dict[str, object], why: str) -> None:
    """Each reason to re-test makes the result stale and says which."""
    f = fresh({**GOOD, **change})
    assert not f.fresh and f.why == why


def test_could_not_check_is_not_retried_on_every_job() -> None:
    """An 'unknown' result (no CUDA torch, no GPU) waits for the validity window too."""
    f = fresh({**GOOD, "verdict": "unknown"})
    assert f.fresh and f.why == "could not check 60s ago"
    assert not fresh({**GOOD, "verdict": "unknown", "cached_at": NOW - 7200}).fresh


def test_missing_and_corrupt_cache_are_stale(tmp_path: Path) -> None:
    """No file, or an unreadable one, means test again."""
    path = str(tmp_path / "nccl-result.json")
    assert cache.read(path) is None
    assert fresh(None).why == "no cached result"
    Path(path).write_text("{garbage")
    assert fresh(cache.read(path)).why == "cached result unreadable"


@pytest.mark.parametrize("doc", [
    {"verdict": "pass", "fingerprint": "fp", "cached_at": "yesterday"},
    {"verdict": "maybe", "fingerprint": "fp", "cached_at": NOW},
    {"verdict": "fail", "reasons": "one string", "cached_at": NOW},
    {"verdict": "pass", "fingerprint": "fp", "cached_at": True},
])
def test_cache_fields_of_the_wrong_type_read_as_corrupt(tmp_path: Path,
                                                        doc: dict[str, object]) -> None:
    """A field the hooks act on with the wrong JSON type makes the file unusable (test
    again), instead of crashing the prolog on float("yesterday")."""
    path = tmp_path / "nccl-result.json"
    path.write_text(json.dumps(doc))
    entry = cache.read(str(path))
    assert entry == {"corrupt": True}
    assert fresh(entry).why == "cached result unreadable"


def test_store_read_and_invalidate_round_trip(tmp_path: Path) -> None:
    """A stored result reads back with its time and boot; invalidate makes it stale."""
    path = str(tmp_path / "state" / "nccl-result.json")
    cache.store(path, {"verdict": "pass", "fingerprint": "fp"}, boot="b1", now=NOW - 5)
    entry = cache.read(path)
    assert entry is not None and fresh(entry).fresh
    assert cache.invalidate(path, "node returned to service")
    assert fresh(cache.read(path)).why == "invalidated: node returned to service"
    assert not cache.invalidate(str(tmp_path / "none.json"), "x")


def test_cache_is_never_read_through_a_symlink(tmp_path: Path) -> None:
    """A symlink planted at the cache path is refused, not followed: it reads as an unusable
    entry (stale, so the node is tested again), never as the pass it points to."""
    target = tmp_path / "elsewhere.json"
    target.write_text('{"verdict": "pass"}')
    link = tmp_path / "nccl-result.json"
    link.symlink_to(target)
    assert cache.read(str(link)) == {"corrupt": True}


def test_boot_id_is_read_from_the_kernel() -> None:
    """This machine has a boot id (the check the cache uses for reboots)."""
    assert len(cache.boot_id()) == 36


@pytest.mark.parametrize(("enabled", "is_fresh", "asks", "run"), [
    (True, True, False, False),
    (True, False, False, True),
    (True, True, True, True),
    (False, False, True, False),
])
def test_prolog_decision(enabled: bool, is_fresh: bool, asks: bool, run: bool) -> None:
    """Run only when enabled and (stale or asked); the whole-node check comes after."""
    d = schedule.decide_prolog(enabled=enabled, fresh=is_fresh, stale_why="why", asks=asks)
    assert d.run is run


def test_job_asks_through_env_or_spank_or_config() -> None:
    """SLURM_RESILIENCE_NCCL_TEST=1, its SPANK_ form, or prolog_always ask for the test."""
    assert schedule.job_asks({"SLURM_RESILIENCE_NCCL_TEST": "1"})
    assert schedule.job_asks({"SPANK_SLURM_RESILIENCE_NCCL_TEST": "yes"})
    assert not schedule.job_asks({"SLURM_RESILIENCE_NCCL_TEST": "0"})
    assert not schedule.job_asks({})
    assert schedule.job_asks({}, always=True)


def test_idle_due() -> None:
    """Idle verification re-tests stale results and ones older than its interval."""
    assert schedule.idle_due(fresh=False, age_s=5, interval_s=30)
    assert schedule.idle_due(fresh=True, age_s=31, interval_s=30)
    assert not schedule.idle_due(fresh=True, age_s=5, interval_s=30)


HOLDER = """
import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
def term(*_):
    time.sleep(float(sys.argv[2]))  # what stopping the ranks costs
    os.ftruncate(fd, 0); fcntl.flock(fd, fcntl.LOCK_UN); sys.exit(0)
if sys.argv[2] != "never":
    signal.signal(signal.SIGTERM, term)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("held", flush=True)
time.sleep(60)
"""


def start_holder(lock: str, stop_cost: str, ours: bool = True) -> subprocess.Popen[str]:
    # The extra argument marks it as ours (schedule only signals our own tests).
    mark = "slurm_resilience.nccl.test-holder" if ours else "someone-else"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, lock, stop_cost, mark],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_free_lock_is_taken_at_once(tmp_path: Path) -> None:
    """No verification running: no hand-off, the lock is ours."""
    lock = schedule.NodeLock(str(tmp_path / "run" / "nccl.lock"))
    h = schedule.take_over(lock, 2.0)
    assert not h.held and h.locked and lock.fd is not None
    assert schedule.holder_pid(lock.path) == os.getpid()
    lock.release()
    assert schedule.holder_pid(lock.path) is None


def test_job_takes_the_node_back_from_idle_verification(tmp_path: Path) -> None:
    """A holder that stops on SIGTERM hands the lock over in about its stop cost."""
    path = str(tmp_path / "nccl.lock")
    holder = start_holder(path, "0.2")
    lock = schedule.NodeLock(path)
    # A generous limit (a loaded machine delayed a 0.2 s stop past 5 s): "not forced" says
    # the SIGTERM hand-off stopped it; how fast is benchmarks' business.
    h = schedule.take_over(lock, 60.0)
    assert h.held and h.locked and not h.forced and h.holder == holder.pid
    assert holder.wait(60) == 0
    lock.release()


def test_a_verifier_that_does_not_stop_is_killed_after_the_handoff_timeout(tmp_path: Path
                                                                           ) -> None:
    """A holder ignoring SIGTERM delays the job by the hand-off timeout, then is killed."""
    path = str(tmp_path / "nccl.lock")
    holder = start_holder(path, "never")
    lock = schedule.NodeLock(path)
    h = schedule.take_over(lock, 0.5)
    assert h.held and h.forced
    assert holder.wait(5) == -signal.SIGKILL
    assert lock.fd is not None
    lock.release()


def test_a_foreign_holder_is_never_signalled(tmp_path: Path) -> None:
    """A pid in the lock file that is not ours is left alone (no kill by pid reuse)."""
    path = str(tmp_path / "nccl.lock")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        Path(path).write_text(f"{sleeper.pid}\n")
        lock = schedule.NodeLock(path)
        h = schedule.take_over(lock, 0.2)  # lock file not flocked: taken at once
        assert not h.held
        lock.release()
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_lock_is_exclusive(tmp_path: Path) -> None:
    """A second holder is refused while the first holds it."""
    a = schedule.NodeLock(str(tmp_path / "l"))
    b = schedule.NodeLock(str(tmp_path / "l"))
    assert a.try_acquire()
    assert not b.try_acquire()
    a.release()
    assert b.try_acquire()
    b.release()


def test_waiting_for_the_lock_gives_up_at_its_deadline(tmp_path: Path) -> None:
    """acquire() polls a held lock until its timeout on the lock's clock, then refuses."""
    clock = FakeClock()
    a = schedule.NodeLock(str(tmp_path / "l"))
    b = schedule.NodeLock(str(tmp_path / "l"), clock=clock)
    assert a.try_acquire()
    assert not b.acquire(0.1, poll_s=0.03)
    assert clock.now >= 0.1 and clock.slept == [0.03] * 4
    a.release()
    assert b.acquire(0.1) and clock.slept == [0.03] * 4
    b.release()


def test_a_holder_that_is_not_ours_is_neither_signalled_nor_waited_for(tmp_path: Path) -> None:
    """Someone else's process holding the lock: the job goes on at once, without the lock
    (so the prolog runs no test), and that process is left alone."""
    path = str(tmp_path / "nccl.lock")
    holder = start_holder(path, "0", ours=False)
    clock = FakeClock()
    try:
        lock = schedule.NodeLock(path, clock=clock)
        h = schedule.take_over(lock, 5.0)
        assert h.held and not h.locked and lock.fd is None
        assert h.seconds == 0.0 and clock.slept == []  # not the 5 s hand-off wait
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
