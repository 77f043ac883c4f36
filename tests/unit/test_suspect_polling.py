"""How often the agents of one incident ask slurmctld about their nodes (issue 22, item 5).

Every node of a hung job polls its own Slurm state after the incident, to find a suspect
drain of itself and verify it. Simulated here for a 1,024-node job on a hand-moved clock:
1,024 watches, one counting runner standing in for scontrol.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_resilience.config import Config
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.config.schema import NodeSection
from slurm_resilience.hang.suspect import SuspectWatch, backed_off, poll_interval
from slurm_resilience.proc import CommandTimeout, Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import Answer, FakeRunner, completed

NODES = 1024
WINDOW_S = 600.0
STEP_S = 0.5


class HandClock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return 1_800_000_000.0 + self.t


def _idle_node(argv: list[str]) -> Completed:
    return completed(f"NodeName={argv[3]} CPUAlloc=0 CPUTot=2 State=IDLE Partitions=debug\n")


def simulate(tmp_path: Path, calls_per_s: float, slurm_down: bool = False
             ) -> tuple[list[float], int]:
    """Times of the scontrol calls the 1,024 watches make in the window after the incident,
    and how many of them ran."""
    hb = replace(HeartbeatSection(), verify_calls_per_s=calls_per_s)
    cfg = Config(node=NodeSection(state_dir=str(tmp_path / "state"),
                                  run_dir=str(tmp_path / "run")), heartbeat=hb)
    answer: Answer = CommandTimeout(["scontrol"], "timed out") if slurm_down else _idle_node
    runner = FakeRunner({"scontrol": [answer]})
    clock = HandClock()
    adapter = SlurmAdapter(runner=runner)
    watches = []
    for i in range(NODES):
        w = SuspectWatch(cfg, f"n{i}", adapter, clock, str(tmp_path / "hb"),
                         rng=random.Random(i))
        # Agents that started long ago, each looking every verify_idle_poll_s.
        w.next_poll = w.rng.uniform(0.0, hb.verify_idle_poll_s)
        watches.append(w)
    for w in watches:
        w.incident_seen(NODES)
    times: list[float] = []
    while clock.t < WINDOW_S:
        for w in watches:
            if w.due():
                before = len(runner.calls)
                w.poll()
                times.extend([clock.t] * (len(runner.calls) - before))
        clock.t += STEP_S
    return times, len(runner.calls)


def test_a_1024_node_incident_polls_within_the_budget(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before: every node every verify_poll_s (10 s), about 100 calls a second for the whole
    window. Now: 1,024 nodes / verify_calls_per_s (10) = a look every 102 s per node, with
    jitter, so about 10 calls a second, and no second of the window far above that."""
    before, _ = simulate(tmp_path / "before", calls_per_s=1e4)  # the old fixed 10 s pace
    after, _ = simulate(tmp_path / "after", calls_per_s=10.0)
    rate_before, rate_after = len(before) / WINDOW_S, len(after) / WINDOW_S
    peak_after = max(Counter(int(t // 10) for t in after).values()) / 10
    with capsys.disabled():
        print(f"\n1,024-node incident, {WINDOW_S:.0f} s window: {len(before)} scontrol calls "
              f"({rate_before:.1f}/s) at a fixed 10 s; {len(after)} ({rate_after:.1f}/s, "
              f"busiest 10 s: {peak_after:.1f}/s) with verify_calls_per_s 10")
    assert rate_before > 90
    assert rate_after <= 10.0 * 1.25
    assert peak_after <= 10.0 * 1.5  # the first looks of all nodes are spread too


def test_a_failing_slurmctld_is_asked_less_and_less(tmp_path: Path) -> None:
    """Each failed look doubles the wait (up to verify_idle_poll_s): slurmctld, already in
    trouble, gets a fraction of the calls of a healthy window."""
    healthy, _ = simulate(tmp_path / "ok", calls_per_s=1e4)
    failing, _ = simulate(tmp_path / "down", calls_per_s=1e4, slurm_down=True)
    assert len(failing) < len(healthy) / 8


def test_small_jobs_keep_the_configured_pace() -> None:
    """A job of up to verify_calls_per_s * verify_poll_s nodes (100 by default) still polls
    every verify_poll_s: the sandbox's and most jobs' return to service is unchanged."""
    hb = HeartbeatSection()
    assert poll_interval(hb, 4) == hb.verify_poll_s
    assert poll_interval(hb, 100) == hb.verify_poll_s
    assert poll_interval(hb, 1024) == pytest.approx(102.4)
    assert backed_off(10.0, 0, 600.0) == 10.0
    assert [backed_off(10.0, n, 600.0) for n in (1, 2, 6, 40)] == [20.0, 40.0, 600.0, 600.0]
    assert backed_off(900.0, 3, 600.0) == 900.0
