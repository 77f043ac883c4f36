"""The sandbox's process handling and stand-in hardware, without Slurm: start failures
are SandboxErrors naming the daemon, `down` finds detached processes by their markers
(and never another sandbox's), and a reset never shows a health check a missing path."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_resilience.health.collectors import infiniband
from slurm_resilience.sandbox import daemons, hardware, sweep
from slurm_resilience.sandbox.errors import SandboxError

SLEEPER = "import time; time.sleep(600)"


def test_a_forking_daemon_that_fails_is_a_sandbox_error_naming_it(tmp_path: Path) -> None:
    """Was a RuntimeError (a traceback from `sandbox up`)."""
    log_file = tmp_path / "x.out"
    own_log = tmp_path / "x.log"
    own_log.write_text("line 1\nfatal: something is wrong\n")
    with pytest.raises(SandboxError) as caught:
        daemons.start_forking([sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"],
                              env={}, log_file=log_file, name="slurmd-node7", logs=[own_log])
    message = str(caught.value)
    assert message.startswith("sandbox: up: slurmd-node7 did not start: exit status 3")
    assert "bad" in message and "fatal: something is wrong" in message


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str] | None = None) -> Iterator[int]:
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_exec(*pids: int, timeout: float = 60.0) -> None:
    """Wait until each child has exec'd the sleeper (before that it shows our own argv
    and environment)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while os.fsencode(SLEEPER) not in Path(f"/proc/{pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, f"{pid} did not start"
            time.sleep(0.01)


def found_pids(state: Path) -> list[int]:
    found = sweep.find(state, lambda env: env.get("SR_TEST_SANDBOX") == str(state))
    return [f.proc.pid for f in found]


def test_find_matches_whole_paths_and_markers_never_a_sibling_sandbox(tmp_path: Path) -> None:
    state = tmp_path / "sbx1"
    sibling = tmp_path / "sbx10"
    argv_ours = [sys.executable, "-c", SLEEPER, f"--socket={state}/munge/socket"]
    argv_sibling = [sys.executable, "-c", SLEEPER, f"--socket={sibling}/munge/socket"]
    with started(argv_ours) as ours, started(argv_sibling) as theirs, \
            started([sys.executable, "-c", SLEEPER], {"SR_TEST_SANDBOX": str(state)}) as marked, \
            started([sys.executable, "-c", SLEEPER], {"SR_TEST_SANDBOX": str(sibling)}) as other:
        wait_exec(ours, theirs, marked, other)
        found = found_pids(state)
        assert ours in found and marked in found
        assert theirs not in found and other not in found
        assert os.getpid() not in found


def test_stop_kills_what_ignores_sigterm_and_its_children(tmp_path: Path) -> None:
    state = tmp_path / "sbx"
    parent = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session=True)\n"
              "time.sleep(600)\n")
    marker = {"SR_TEST_SANDBOX": str(state)}
    with started([sys.executable, "-c", parent], marker) as pid:
        wait_exec(pid)
        children: list[int] = []
        deadline = time.monotonic() + 60
        while not children:
            assert time.monotonic() < deadline, "the child was never started"
            children = [p.pid for p in sweep.processes().values() if p.ppid == pid]
            time.sleep(0.01)
        stopped, left = sweep.stop(state, lambda env: env.get("SR_TEST_SANDBOX") == str(state),
                                   grace=0.5)
        assert left == []
        assert {pid, *children} <= {f.proc.pid for f in stopped}
        assert sweep.read_proc(pid) is None and sweep.read_proc(children[0]) is None


def test_reset_swaps_the_hca_tree_so_a_reader_never_sees_a_missing_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: rmtree, then rebuild; a health check in between saw no HCA or no ports. Then: a
    reader whose path walk had entered the old tree before the swap found it half removed
    (an HCA with no ports, on a loaded CI host); the old tree is now set aside and removed
    only at a later reset, once older than RETIRED_KEEP_S."""
    hw = hardware.locate(tmp_path, "node1")
    hardware.reset_node(hw)
    counters = ("link_downed", "symbol_error")
    problems: list[str] = []
    done = threading.Event()
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not done.is_set() or reads < 20:
            snap = infiniband.collect_json(str(hw.sysfs), counters)
            reads += 1
            hcas = snap["hcas"]
            if snap["error"] or len(hcas) != hardware.HCAS:
                problems.append(f"{snap['error']} hcas={sorted(hcas)}")
            for name, entry in hcas.items():
                port = entry.get("ports", {}).get("1")
                if entry.get("error") or port is None or port.get("state") is None \
                        or None in port["counters"].values():
                    problems.append(f"{name}: {entry}")
            if problems:
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(15):
            hardware.reset_node(hw)
            if problems:
                break
    finally:
        done.set()
        thread.join(timeout=60)
    assert problems == []
    retired = f".{hw.sysfs.name}.retired-*"
    assert len(list(hw.sysfs.parent.glob(retired))) >= 2  # every swap's old tree, kept
    monkeypatch.setattr(hardware, "RETIRED_KEEP_S", 0.0)
    hardware.reset_node(hw)
    assert reads >= 20
    # Nothing else beside the tree: the older ones were removed, the one just set aside kept.
    left = sorted(p.name for p in hw.sysfs.parent.iterdir())
    assert len(left) == 2 and left[0].startswith(".infiniband.retired-") and \
        left[1] == "infiniband", left


def test_exchange_swaps_two_directories(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    hardware.exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b" / "x").read_text() == "a" and not (tmp_path / "a" / "x").exists()


def test_mounts_left_in_the_state_dir_are_detached_and_a_siblings_are_not(tmp_path: Path
                                                                          ) -> None:
    """A job killed before its epilog leaves its run-dir tmpfs mounted: down detaches every
    mount inside the state dir, nested ones first, and none of a sandbox beside it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")  # CI runs as root
    state, sibling = tmp_path / "sbx1", tmp_path / "sbx10"
    points = [state / "run" / "job 7", state / "run" / "job 7" / "inner", sibling / "run"]
    mounted: list[Path] = []
    try:
        for point in points:
            point.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "slurm-resilience",
                            str(point)], check=True)
            mounted.append(point)
        assert sweep.mounts_under(state) == [str(points[1]), str(points[0])]
        detached, failed = sweep.unmount_under(state)
        assert (detached, failed) == ([str(points[1]), str(points[0])], [])
        assert sweep.mounts_under(state) == []
        assert sweep.mounts_under(sibling) == [str(sibling / "run")]
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "--lazy", str(point)], check=False,
                           stderr=subprocess.DEVNULL)


def test_a_daemon_whose_pid_file_is_not_written_yet_has_not_exited(tmp_path: Path) -> None:
    """slurmd creates its pid file before it writes the pid: an empty (or missing) pid file
    means still starting, never "exited while starting"; a pid that is gone has exited."""
    pid_file = tmp_path / "slurmd-node2.pid"
    d = daemons.Daemon("slurmd-node2", "slurmd", pid_file, str(tmp_path))
    assert not daemons.exited(d)
    pid_file.write_text("")
    assert not daemons.exited(d)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    pid_file.write_text(f"{gone.pid}\n")
    assert daemons.exited(d)
    pid_file.write_text(f"{os.getpid()}\n")
    assert not daemons.exited(d)
