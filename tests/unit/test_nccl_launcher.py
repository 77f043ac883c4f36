"""The launcher with real gloo ranks: pass, wrong sum, hang killed at the timeout, crash."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from slurm_resilience.nccl import faults
from slurm_resilience.nccl.launcher import LaunchSpec, RankOutcome, classify, rank_env, run_once

SIZES = (4096, 65536)


def spec(tmp_path: Path, fault: faults.Fault | None = None, timeout_s: float = 60.0
         ) -> LaunchSpec:
    path = str(tmp_path / "fault.json")
    faults.write(path, fault)
    return LaunchSpec(ranks=2, backend="gloo", sizes=SIZES, timeout_s=timeout_s, warmup=1,
                      iters=3, fault_file=path)


def worker_pids(tmp_path: Path) -> list[int]:
    """Live rank processes of this test's launches (their fault file is in ``tmp_path``):
    ranks of other runs on the machine (a sandbox's idle verifier) are not counted."""
    mine = str(tmp_path).encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"slurm_resilience.nccl.worker" in cmd and mine in cmd:
                pids.append(int(entry))
    return pids


def test_healthy_ranks_pass_with_exact_sums_and_times(tmp_path: Path) -> None:
    """Two gloo ranks all_reduce every size, find the exact sum, and report a time."""
    attempt = run_once(spec(tmp_path))
    assert attempt.status == "ok", attempt.detail
    assert [r.label for r in attempt.ranks] == ["rank0", "rank1"]
    for r in attempt.ranks:
        assert r.returncode == 0
        results = r.report["results"]
        assert [x["size"] for x in results] == list(SIZES)
        assert all(x["mismatches"] == 0 and x["seconds"] > 0 for x in results)
    assert attempt.leftovers == () and worker_pids(tmp_path) == []


def test_wrong_sum_on_one_rank_is_named(tmp_path: Path) -> None:
    """An injected wrong element on rank 1 makes the attempt 'wrong' naming rank1 only."""
    attempt = run_once(spec(tmp_path, faults.Fault("wrong", 1)))
    assert attempt.status == "wrong"
    assert attempt.detail == "rank1"
    bad = attempt.ranks[1].report["results"][0]
    assert bad["mismatches"] == 1 and bad["first_bad_index"] == SIZES[0] // 4 // 2


def test_hang_is_killed_at_the_timeout_with_nothing_left(tmp_path: Path) -> None:
    """A rank that never enters the collective: both are killed at the hard timeout,
    the attempt says so, and no rank process survives."""
    attempt = run_once(spec(tmp_path, faults.Fault("hang", 0), timeout_s=4.0))
    # Killed by the launcher at its limit (SIGKILL), not ended by the ranks' own deadline.
    assert attempt.status == "timeout"
    assert attempt.detail == "timed out after 4s"
    assert attempt.leftovers == ()
    assert worker_pids(tmp_path) == []
    assert all(r.returncode == -9 for r in attempt.ranks)


def test_unreadable_fault_file_is_a_crash_not_a_silent_pass(tmp_path: Path) -> None:
    """A rank that fails (here: a corrupt fault file) makes the attempt 'crashed' with why."""
    s = spec(tmp_path)
    Path(s.fault_file).write_text("{not json")
    attempt = run_once(s)
    assert attempt.status == "crashed"
    assert "rank 0 exited 1 in fault" in attempt.detail
    assert "not valid JSON" in attempt.detail
    assert worker_pids(tmp_path) == []


def test_stop_event_aborts_the_attempt(tmp_path: Path) -> None:
    """Setting the stop event (a job arrived) kills the ranks promptly: status 'aborted'."""
    stop = threading.Event()
    timer = threading.Timer(1.0, stop.set)
    timer.start()
    attempt = run_once(spec(tmp_path, faults.Fault("hang", 0), timeout_s=30.0), stop)
    assert attempt.status == "aborted"  # not "timeout": the stop ended it, not the limit
    assert worker_pids(tmp_path) == []


def test_missing_interpreter_is_unavailable_not_a_node_fault(tmp_path: Path) -> None:
    """No torch in the ranks' interpreter is 'could not check' (unavailable)."""
    report = {"rank": 0, "error": "ModuleNotFoundError: No module named 'torch'",
              "phase": "import"}
    ranks = [RankOutcome(0, 1, report), RankOutcome(1, 1, {**report, "rank": 1})]
    status, detail = classify(ranks, False, 10)
    assert status == "unavailable" and "No module named 'torch'" in detail


def test_classify_prefers_wrong_over_timeout() -> None:
    """A rank that saw a wrong sum is named even if another then hung."""
    wrong = {"label": "gpu5", "results": [{"size": 8, "seconds": 1, "mismatches": 3}]}
    status, detail = classify([RankOutcome(5, -9, wrong), RankOutcome(0, -9, {})], True, 120)
    assert (status, detail) == ("wrong", "gpu5")
    assert classify([RankOutcome(0, -9, {})], True, 120) == ("timeout", "timed out after 120s")


@pytest.mark.parametrize("bad", ["{", "[]", '{"kind": "melt"}', '{"kind": "wrong", "rank": -1}'])
def test_fault_file_is_validated(tmp_path: Path, bad: str) -> None:
    """A malformed fault file is an error naming the file, never read as 'no fault'."""
    p = tmp_path / "f.json"
    p.write_text(bad)
    with pytest.raises(ValueError, match=str(p)):
        faults.read(str(p))


def test_ranks_get_an_allowlisted_environment() -> None:
    """Job-controlled SPANK_* values and stray variables never reach root's ranks; NCCL_*
    of the caller and the configured extra environment do; GPUs are numbered in PCI order."""
    env = rank_env({"PATH": "/bin", "SPANK_SLURM_RESILIENCE_X": "1", "LD_PRELOAD": "/x.so",
                    "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "3", "PYTHONPATH": "/tmp"},
                   {"NCCL_P2P_DISABLE": "1"})
    assert env == {"PATH": "/bin", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1",
                   "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_P2P_DISABLE": "1"}
    assert rank_env({}, {})["PATH"] == "/usr/sbin:/usr/bin:/sbin:/bin"
