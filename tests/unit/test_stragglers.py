"""Straggler naming: a slowed node is named within a stated bound, normal jobs name none,
and the agent's step watch keeps a per-node record that shows recurrence across jobs.

Bound (defaults: window 100, min_steps 50, persist_evaluations 10): a node 20% slower from
the start of a job with 5% jitter is named by step 60 (min_steps + persist - 1 = 59); one
slowed from step 100 on is named within 120 steps of it (more than half its window must be
slow before its median moves, then 10 judgements). Measured false-positive rate:
benchmarks/bench_stragglers.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agent_state import Stragglers, Watcher, slot, view

from slurm_resilience.config.metrics import StragglerSection
from slurm_resilience.stragglers.detect import Tracker, judge
from slurm_resilience.stragglers.jobsteps import StepWatch, quantile
from slurm_resilience.stragglers.record import StragglerRecord
from slurm_resilience.stragglers.synthetic import JitterModel, steps
from slurm_resilience.testing import FakeClock

CFG = StragglerSection()
SEEDS = range(25)


def first_named(seed: int, *, slow: int | None, slowdown: float = 0.2, slow_from: int = 0,
                members: int = 8, count: int = 300, model: JitterModel | None = None
                ) -> tuple[int | None, set[int]]:
    t: Tracker[int] = Tracker(CFG)
    first, ever = None, set()
    for i, row in enumerate(steps(members, count, seed, model or JitterModel(), slow_member=slow,
                                  slowdown=slowdown, slow_from=slow_from)):
        for m, x in enumerate(row):
            t.add(m, x)
        t.evaluate()
        ever |= t.named
        if first is None and slow in t.named:
            first = i + 1
    return first, ever


def test_a_slowed_node_is_named_within_the_bound_and_alone() -> None:
    for seed in SEEDS:
        first, ever = first_named(seed, slow=3)
        assert first is not None and first <= 60, (seed, first)
        assert ever == {3}, seed


def test_a_node_slowed_mid_job_is_named_within_120_steps() -> None:
    for seed in SEEDS:
        first, ever = first_named(seed, slow=5, slow_from=100)
        assert first is not None and 100 < first <= 220, (seed, first)
        assert ever == {5}


def test_normal_jobs_name_no_straggler_over_300_steps() -> None:
    for seed in SEEDS:
        assert first_named(1000 + seed, slow=None)[1] == set(), seed


def test_heavier_jitter_still_names_nobody() -> None:
    for seed in range(10):
        assert first_named(seed, slow=None, model=JitterModel(jitter=0.15))[1] == set()


def test_a_short_burst_on_one_node_is_not_a_straggler() -> None:
    t: Tracker[int] = Tracker(CFG)
    for i, row in enumerate(steps(8, 300, 7)):
        for m, x in enumerate(row):
            t.add(m, x * (10 if m == 2 and 120 <= i < 140 else 1))
        t.evaluate()
        assert not t.named


def test_two_members_name_nobody_and_too_few_steps_are_not_judged() -> None:
    assert judge({0: [1.0] * 60, 1: [2.0] * 60}, CFG).slow == frozenset()
    assert judge({0: [1.0] * 10, 1: [1.0] * 10, 2: [5.0] * 10}, CFG).slow == frozenset()
    j = judge({0: [1.0] * 60, 1: [1.0] * 60, 2: [1.01] * 60, 3: [2.0] * 60}, CFG)
    assert j.slow == {3} and j.reference_s == 1.005


def test_below_min_slowdown_is_not_named_even_when_far_outside_the_spread() -> None:
    windows = {m: [1.0] * 60 for m in range(7)} | {7: [1.08] * 60}
    assert judge(windows, CFG).slow == frozenset()
    assert judge(windows, dataclasses.replace(CFG, min_slowdown=0.02)).slow == {7}


# -- the agent's step watch ---------------------------------------------------------------

def run_job(watch: StepWatch, job_id: int, slow_rank: int | None, count: int = 200) -> None:
    for i, row in enumerate(steps(8, count, job_id)):
        watch.observe([view(job_id, [slot(r, i + 1, x * (1.3 if r == slow_rank else 1), job_id)
                                     for r, x in enumerate(row)])])


def test_step_watch_names_ranks_keeps_a_record_across_jobs_and_forgets_ended_jobs(
        tmp_path: Path) -> None:
    clock = FakeClock(wall=1_000_000.0)
    named: list[tuple[int, int]] = []
    record = StragglerRecord(str(tmp_path / "stragglers.json"))
    watch = StepWatch(lambda: CFG, "n1", record, clock,
                      lambda job, kept: named.append((job, len(kept))))
    run_job(watch, 11, slow_rank=None)
    assert [s.straggler_ranks for s in watch.snapshot()] == [()]
    assert named == [] and watch.recent_jobs() == []
    snap = watch.snapshot()[0]
    assert snap.ranks == 8 and snap.samples == 8 * CFG.window_steps
    assert 0.9 < snap.p50_s < 1.1 and snap.p95_s > snap.p50_s
    run_job(watch, 12, slow_rank=6)
    assert [s.straggler_ranks for s in watch.snapshot() if s.job_id == 12] == [(6,)]
    assert named == [(12, 1)]
    watch.observe([])  # both jobs ended: their state goes, the record stays
    assert watch.snapshot() == []
    clock.advance(3600)
    again = StepWatch(lambda: CFG, "n1", StragglerRecord(record.path), clock,
                      lambda job, kept: named.append((job, len(kept))))
    run_job(again, 13, slow_rank=2)
    assert named[-1] == (13, 2)  # recurring: the second job on this node
    assert [e.job_id for e in again.recent_jobs()] == [12, 13]
    clock.advance(CFG.record_window_s - 1800)
    assert [e.job_id for e in again.recent_jobs()] == [13]


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) == 0.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 101)], 0.95) == 95.0


def test_status_lists_the_jobs_this_node_straggled_in(tmp_path: Path) -> None:
    from slurm_resilience.config import Config, load_text
    from slurm_resilience.statuscli import render_stragglers, stragglers
    from slurm_resilience.stragglers.record import FILENAME, JUDGED_FILENAME, Entry

    cfg = load_text(Config, f"node: {{state_dir: '{tmp_path}/{{node}}'}}\n", "t")
    record = StragglerRecord(str(tmp_path / "n1" / FILENAME))
    record.add(Entry(100.0, 5, (2,), 0.25, "ann"), 100.0, CFG.record_window_s)
    record.add(Entry(200.0, 6, (3, 4), 0.4, "ben"), 200.0, CFG.record_window_s)
    rows = stragglers(cfg, "n1", 300.0)
    assert [r["job_id"] for r in rows] == [5, 6]
    text = render_stragglers("n1", rows, CFG.record_window_s)
    assert "(2 jobs): recurring (jobs of 2 users)" in text
    assert "job 6: ranks [3, 4] +40% slower" in text
    assert stragglers(cfg, "n2", 300.0) == []
    # The job's judge named the whole node in job 6 too: still 2 jobs, one more line; and
    # the nodes a judge named are listed on the judge.
    record.add(Entry(250.0, 6, (), 0.3, "ben", node="n1"), 250.0, CFG.record_window_s)
    judged = StragglerRecord(str(tmp_path / "n1" / JUDGED_FILENAME))
    judged.add(Entry(260.0, 9, (), 0.35, node="n7"), 260.0, CFG.record_window_s)
    text = render_stragglers("n1", stragglers(cfg, "n1", 300.0), CFG.record_window_s,
                             stragglers(cfg, "n1", 300.0, judged=True))
    assert "(2 jobs): recurring (jobs of 2 users)" in text
    assert "job 6: the whole node +30% slower than the job's other nodes" in text
    assert "job 9: n7 +35%" in text


def test_one_users_slow_jobs_never_name_the_node_a_straggler(tmp_path: Path) -> None:
    """Jobs of one user slow on a node (their ranks sleeping in user code) are listed as
    that user's jobs, never as a recurring straggler node: not in `status`, not in
    `status --cluster`, and no suspect; a second user's slow job does name it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from slurm_resilience.config import Config, load_text
    from slurm_resilience.metrics import cluster
    from slurm_resilience.metrics.collector import AgentCollector, AgentSources
    from slurm_resilience.statuscli import render_stragglers, stragglers
    from slurm_resilience.stragglers.record import FILENAME, Entry, recurring, suspicion

    cfg = load_text(Config, f"node: {{state_dir: '{tmp_path}/{{node}}'}}\n", "t")
    record = StragglerRecord(str(tmp_path / "n1" / FILENAME))
    for job in (5, 6, 7):
        kept = record.add(Entry(100.0 + job, job, (1,), 0.5, "mallory"), 200.0,
                          CFG.record_window_s)
    assert not recurring(kept) and suspicion(kept, 2) == []

    def shown() -> tuple[str, cluster.ClusterView]:
        text = render_stragglers("n1", stragglers(cfg, "n1", 300.0), CFG.record_window_s)
        watch = StepWatch(lambda: CFG, "n1", record, FakeClock(wall=300.0))
        reg = CollectorRegistry(auto_describe=False)
        reg.register(AgentCollector(AgentSources(node="n1", events_path="", nccl_path="",
                                                 watcher=Watcher(),
                                                 stragglers=Stragglers(watch))))
        scrape = cluster.Scrape("n1", "http://x/n1", cluster.parse(generate_latest(reg).decode()))
        return text, cluster.assemble([], [], [scrape], "SR:", CFG)

    text, seen = shown()
    assert "(3 jobs): all one user's jobs, so not named a straggler node" in text
    assert "recurring" not in text and seen.recurring_stragglers == []
    kept = record.add(Entry(250.0, 8, (0,), 0.4, "ann"), 260.0, CFG.record_window_s)
    assert recurring(kept)
    text, seen = shown()
    assert "(4 jobs): recurring (jobs of 2 users)" in text
    assert seen.recurring_stragglers == [cluster.Recurring("n1", 4, 2)]
