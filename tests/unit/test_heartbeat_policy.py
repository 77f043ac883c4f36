"""Unit tests of hang blame and the requeue policy (pure functions)."""

from __future__ import annotations

from dataclasses import replace

from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.hang import blame as B
from slurm_resilience.hang import requeue as R

WAITING = '''Process 4242: python train.py
Python v3.11.2 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2050)
    wrapper (torch/distributed/c10d_logger.py:79)
    train_step (train.py:40)
    main (train.py:90)
'''
SLEEPING = '''Process 4243: python train.py
Python v3.11.2 (/usr/bin/python3.11)

Thread 4243 (idle): "MainThread"
    hang (train.py:60)
    main (train.py:88)
Thread 4250 (idle): "Thread-1"
    wait (torch/distributed/elastic/x.py:10)
'''


def _obs(rank: int, node: str, step: int = 10, t: float = 100.0,
         coll: bool | None = None) -> B.RankObservation:
    return B.RankObservation(rank, node, step, t, coll, 0.1)


def test_stack_classification() -> None:
    """A main thread inside torch.distributed is waiting; a sleeping one is not; none is unknown."""
    assert B.in_collective(WAITING) is True
    assert B.in_collective(SLEEPING) is False
    assert B.in_collective("") is None


def test_health_findings_blame_their_node() -> None:
    """A node with a fresh Xid is drained for it, whatever the ranks show."""
    b = B.blame(1234, [_obs(0, "n1"), _obs(1, "n2")], {"n2": ["gpu5 XID 79 at 03:12"], "n1": []})
    assert b.drains == (("n2", "hang job 1234: gpu5 XID 79 at 03:12"),)
    assert b.rule == "health"


def test_rank_behind_the_others_stalled_first() -> None:
    """The rank whose last step is lower than every other's is blamed with its node."""
    b = B.blame(1234, [_obs(0, "n1", 11), _obs(1, "n1", 11), _obs(12, "n2", 10)], {})
    assert b.drains == (("n2", "hang job 1234: rank 12 stalled first"),)
    assert b.ranks == (12,)


def test_rank_not_in_collective_stalled_first() -> None:
    """At the same step, the rank not waiting in a collective while others wait is blamed."""
    obs = [_obs(0, "n1", coll=True), _obs(1, "n2", coll=False)]
    b = B.blame(7, obs, {})
    assert b.node == "n2" and b.rule == "not waiting in a collective"


def test_clearly_earliest_rank_stalled_first() -> None:
    """Without steps or stacks to go on, a rank silent well before the others is blamed."""
    b = B.blame(7, [_obs(0, "n1", t=100.0), _obs(1, "n2", t=110.0)], {})
    assert b.node == "n1"


def test_no_node_blamed_when_nothing_distinguishes_ranks() -> None:
    """Same step, same stacks, same time: nothing is drained and the report says why."""
    b = B.blame(7, [_obs(0, "n1", coll=True), _obs(1, "n2", coll=True)], {})
    assert b.drains == () and "no node can be blamed" in b.explanation


def test_first_stalled_ranks_on_two_nodes_blame_none() -> None:
    """Stalled-first ranks spread over nodes drain nothing."""
    b = B.blame(7, [_obs(0, "n1", 9), _obs(1, "n2", 9), _obs(2, "n3", 10)], {})
    assert b.drains == () and b.ranks == (0, 1) and "no single node" in b.explanation


CFG = HeartbeatSection(max_requeues=2)


def test_first_hang_requeues_and_records_ledger() -> None:
    """A first hang requeues; the ledger token carries count, checkpoint and run."""
    d = R.decide(5, restarts=0, admin_comment="", ckpt_step=10, mode="act", cfg=CFG)
    assert d.action == "requeue" and d.ledger == R.Ledger(1, 10, 0)
    assert R.parse_ledger(R.merge_comment("", d.ledger, d.reason)) == d.ledger


def test_same_run_is_handled_once() -> None:
    """A ledger naming the current run means another handler already acted: skip."""
    comment = R.Ledger(1, 10, 3).token()
    assert R.decide(5, restarts=3, admin_comment=comment, ckpt_step=12, mode="act",
                    cfg=CFG).action == "skip"


def test_cap_reached_holds() -> None:
    """Once the requeue count reaches the cap, the next hang holds the job with a reason."""
    comment = R.Ledger(2, 10, 1).token()
    d = R.decide(5, restarts=2, admin_comment=comment, ckpt_step=20, mode="act", cfg=CFG)
    assert d.action == "hold" and "cap 2" in d.reason


def test_no_checkpoint_progress_holds() -> None:
    """A hang after a requeue with no newer checkpoint holds the job instead of looping."""
    comment = R.Ledger(1, 10, 0).token()
    d = R.decide(5, restarts=1, admin_comment=comment, ckpt_step=10, mode="act", cfg=CFG)
    assert d.action == "hold" and "did not advance" in d.reason
    d2 = R.decide(5, restarts=1, admin_comment=comment, ckpt_step=12, mode="act", cfg=CFG)
    assert d2.action == "requeue"
    off = replace(CFG, require_checkpoint_progress=False)
    assert R.decide(5, restarts=1, admin_comment=comment, ckpt_step=10, mode="act",
                    cfg=off).action == "requeue"


def test_observe_mode_only_reports() -> None:
    """In observe mode (cluster or job opt-out) the decision is to report, never to act."""
    assert R.decide(5, restarts=0, admin_comment="", ckpt_step=1, mode="observe",
                    cfg=CFG).action == "report"


def test_merge_comment_keeps_others_text() -> None:
    """Our token replaces the previous one; an operator's own text stays."""
    old = "SR: [sr-hang n=1 ckpt=3 restart=0] hang job 5: requeue 1 of 2 | ticket INC-7"
    new = R.merge_comment(old, R.Ledger(2, 5, 1), "hang job 5: requeue 2 of 2")
    assert new.count("[sr-hang") == 1 and "n=2" in new and "INC-7" in new


def test_status_lists_our_drains_and_held_hang_jobs() -> None:
    """status shows nodes drained with our prefix and jobs carrying a hang ledger, held or not."""
    from slurm_resilience.hang import status
    from slurm_resilience.slurm.parse import parse_job, parse_node

    nodes = [parse_node("NodeName=node2 State=IDLE+DRAIN CPUTot=2 CPUAlloc=0 "
                        "Reason=SR: hang job 7: rank 1 stalled first [root@2026-11-22T05:00:00]"),
             parse_node("NodeName=node3 State=IDLE+DRAIN CPUTot=2 CPUAlloc=0 "
                        "Reason=maintenance [bob@2026-11-22T05:00:00]"),
             parse_node("NodeName=node4 State=IDLE CPUTot=2 CPUAlloc=0 Reason=(null)")]
    drains = status.drains(nodes, "SR:")
    assert [(d["node"], d["hang"]) for d in drains] == [("node2", True)]
    held = parse_job("JobId=7 JobName=t UserId=alice(1001) JobState=PENDING Reason=JobHeldAdmin "
                     "Restarts=4 AdminComment=SR: [sr-hang n=3 ckpt=9 restart=3] hang job 7: "
                     "held after 3 hang requeues (cap 3)")
    plain = parse_job("JobId=8 JobName=t UserId=bob(1002) JobState=RUNNING Reason=None")
    jobs = status.hang_jobs([held, plain])
    assert len(jobs) == 1 and jobs[0]["held"] and jobs[0]["hang_requeues"] == 3
    text = status.render({"mode": "act", "drains": drains, "jobs": jobs, "incidents": [],
                          "errors": []})
    assert "HELD" in text and "held after 3 hang requeues" in text and "node2" in text
