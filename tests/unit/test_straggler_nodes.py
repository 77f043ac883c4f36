"""Straggler nodes judged across a job's nodes (pure): each node's summary (the median of its
ranks' windows) judged by the job's judge with the rank-level math and persistence rule.

Bound (defaults: window 100 steps per rank, min_steps 50, persist_evaluations 10; one
judgement per interval in which a node made progress): with 10 steps per interval, a node
30% slower from the start is named at the 14th judgement (5 intervals to fill min_steps, then
10 consecutive slow judgements), and normal jitter names none over 300 judgements.
"""

from __future__ import annotations

import base64
import statistics
import time
import zlib
from collections import deque

from slurm_resilience.config.metrics import StragglerSection
from slurm_resilience.stragglers.detect import Summary, judge_summaries
from slurm_resilience.stragglers.nodes import (
    JobJudge,
    NodeSummary,
    Verdict,
    judge_of,
    parse_summary,
    parse_verdict,
)
from slurm_resilience.stragglers.synthetic import JitterModel, steps
from slurm_resilience.transport.tree import Tree
from slurm_resilience.transport.wire import Kind, Message

CFG = StragglerSection()
INTERVAL_S = 30.0


def simulate(seed: int, *, nodes: int = 16, ranks: int = 8, evaluations: int = 300,
             steps_per_eval: int = 10, slow: int | None = None, slowdown: float = 0.3,
             model: JitterModel | None = None) -> tuple[int | None, set[str]]:
    """Judgement at which the slow node was first named, and every node ever named."""
    names = [f"n{i:02d}" for i in range(nodes)]
    windows = [[deque[float](maxlen=CFG.window_steps) for _ in range(ranks)]
               for _ in range(nodes)]
    judge = JobJudge(CFG)
    first: int | None = None
    ever: set[str] = set()
    rows = steps(nodes * ranks, evaluations * steps_per_eval, seed, model)
    step = 0
    for e in range(evaluations):
        for _ in range(steps_per_eval):
            row = next(rows)
            step += 1
            for m, t in enumerate(row):
                n, r = divmod(m, ranks)
                windows[n][r].append(t * (1 + slowdown if n == slow else 1))
        now = 1e9 + e * INTERVAL_S
        judge.receive(NodeSummary(names[n], statistics.median(t for w in windows[n] for t in w),
                                  max(len(w) for w in windows[n]), ranks, step, now)
                      for n in range(nodes))
        assert judge.evaluate(now, 3 * INTERVAL_S) is not None
        ever |= judge.named
        if first is None and slow is not None and names[slow] in judge.named:
            first = e + 1
    return first, ever


def test_a_node_30_percent_slower_is_named_after_the_persistence_streak_and_alone() -> None:
    for seed in range(5):
        first, ever = simulate(seed, evaluations=40, slow=5)
        assert first == 14, (seed, first)
        assert ever == {"n05"}, seed


def test_normal_jitter_names_no_node_over_300_judgements() -> None:
    for seed in range(3):
        assert simulate(100 + seed, slow=None)[1] == set(), seed
    assert simulate(200, slow=None, model=JitterModel(jitter=0.15))[1] == set()


def test_a_stuck_job_is_not_judged_again_and_stale_or_silent_nodes_drop_out() -> None:
    judge = JobJudge(CFG)
    summaries = [NodeSummary(f"n{i}", 1.3 if i == 0 else 1.0, 100, 8, 500, 1000.0)
                 for i in range(4)]
    judge.receive(summaries)
    assert judge.evaluate(1000.0, 90.0) == frozenset()
    assert judge.streak == {"n0": 1}
    # No node made progress: the same windows are not judged again.
    assert judge.evaluate(1030.0, 90.0) is None and judge.streak == {"n0": 1}
    # Summaries past the age limit are dropped; an older one arriving late changes nothing.
    judge.receive([NodeSummary("n1", 1.0, 100, 8, 600, 1100.0),
                   NodeSummary("n0", 9.0, 100, 8, 400, 900.0)])
    assert judge.evaluate(1100.0, 90.0) == frozenset()  # n1 alone is fresh: too few to judge
    assert set(judge.latest) == {"n1"} and judge.streak == {}


def test_the_judge_and_the_cluster_view_share_one_judgement() -> None:
    medians = {"a": Summary(1.0, 60), "b": Summary(1.01, 60), "c": Summary(0.99, 60),
               "d": Summary(1.4, 60), "e": Summary(5.0, 10)}  # e: too few steps
    j = judge_summaries(medians, CFG)
    assert j.slow == {"d"} and "e" not in j.medians and j.reference_s == 1.005


def test_pieces_round_trip_and_malformed_ones_are_refused() -> None:
    s = NodeSummary("n1", 1.234567, 100, 8, 42, 1e9)
    assert parse_summary("n1", s.to_piece()) == s
    v = Verdict(7, "n3", "n0", 1.3, 1.0)
    assert parse_verdict(7, "n3", "n0", v.to_piece()) == v
    assert round(v.slowdown, 6) == 0.3
    for bad in (b"[]", b'{"m": -1, "n": 1, "r": 1, "s": 1, "t": 1}',
                b'{"m": 1, "n": true, "r": 1, "s": 1, "t": 1}', b'{"m": "NaN"}', b"{"):
        try:
            parse_summary("n1", bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    for bad in (b'{"m": 1.0, "ref": 1.0}', b'{"m": 1.0, "ref": 0}'):
        try:
            parse_verdict(7, "n3", "n0", bad)
        except ValueError:
            continue
        raise AssertionError(bad)
    assert judge_of(("b", "a", "c")) == "b"


def test_1024_nodes_fan_in_bytes_and_judge_time() -> None:
    """Cost on paper, measured by simulation: a 1,024-node job, fan-out 16 (the default).
    Each agent sends one message per interval (its subtree's latest summaries); this prints
    the bytes each agent receives per interval (the payload, and an estimate of the munge
    credential: zlib then base64), the messages at the judge, and the judge's time per
    judgement. No wall-clock assertion: the numbers are printed."""
    nodes = tuple(f"gpu{i:04d}" for i in range(1024))
    tree = Tree.of(judge_of(nodes), nodes, 16)
    summary = {n: NodeSummary(n, 1.0 + (i % 7) * 0.001 + (0.3 if n == "gpu0777" else 0.0),
                              100, 8, 5000, 1e9).to_piece() for i, n in enumerate(nodes)}
    payload_in: dict[str, int] = dict.fromkeys(nodes, 0)
    cred_in: dict[str, int] = dict.fromkeys(nodes, 0)
    msgs_in: dict[str, int] = dict.fromkeys(nodes, 0)
    for n in nodes[1:]:
        parent = tree.parent(n)
        assert parent is not None
        pieces = {m: summary[m] for m in tree.subtree(n)}
        payload = Message(Kind.STEPS, 1, 0, n, parent, tree.root, nodes, pieces).to_payload()
        payload_in[parent] += len(payload)
        cred_in[parent] += len(base64.b64encode(zlib.compress(payload))) + 128
        msgs_in[parent] += 1
    root = tree.root
    assert msgs_in[root] == 16 and max(msgs_in.values()) == 16
    judge = JobJudge(CFG)
    took = []
    for e in range(CFG.persist_evaluations):
        now = 1e9 + e * INTERVAL_S
        judge.receive(NodeSummary(n, parse_summary(n, summary[n]).median_s, 100, 8, 5000 + e,
                                  now) for n in nodes)
        t0 = time.perf_counter()
        judge.evaluate(now, 3 * INTERVAL_S)
        took.append(time.perf_counter() - t0)
    assert judge.named == {"gpu0777"}
    print(f"\n1024 nodes, fan-out 16, one interval: judge receives {msgs_in[root]} messages, "
          f"{payload_in[root] / 1024:.0f} KiB payload (~{cred_in[root] / 1024:.0f} KiB as "
          f"munge credentials); busiest agent {max(payload_in.values()) / 1024:.0f} KiB; "
          f"all agents {sum(payload_in.values()) / 1024:.0f} KiB payload "
          f"(~{sum(cred_in.values()) / 1024:.0f} KiB on the wire); one judgement of 1024 "
          f"summaries: median {statistics.median(took) * 1e3:.2f} ms")
