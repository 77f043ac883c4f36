"""The node-fault requeue decision (health.faultrequeue): pure, on JobInfo records."""

from __future__ import annotations

import pytest

from slurm_resilience.health.faultrequeue import (
    FaultLedger,
    decide,
    exit_status,
    merge_comment,
    parse_ledger,
)
from slurm_resilience.slurm.parse import JobInfo


def job(state: str = "COMPLETING", requeue: bool = True, restarts: int = 0,
        admin: str = "") -> JobInfo:
    return JobInfo(job_id=7, name="train", user="u", uid=1000, state=state, requeue=requeue,
                   restarts=restarts, admin_comment=admin)


def test_a_requeueable_job_that_failed_is_requeued_and_counted() -> None:
    d = decide(job(), exit_code=3, cap=3)
    assert (d.action, d.ledger) == ("requeue", FaultLedger(1, 0))
    assert d.reason == "job 7: node-fault requeue 1 of 3"


@pytest.mark.parametrize(("kwargs", "code", "why"), [
    ({}, 0, "ended well"),
    ({}, None, "exit code is unknown"),
    ({"requeue": False}, 3, "not requeueable"),
    ({"state": "CANCELLED"}, 15, "ended CANCELLED"),
    ({"state": "TIMEOUT"}, 15, "ended TIMEOUT"),
    ({"admin": "[sr-fault n=3 restart=2]", "restarts": 3}, 3, "(cap 3)"),
])
def test_jobs_left_alone_say_why(kwargs: dict[str, object], code: int | None, why: str) -> None:
    d = decide(job(**kwargs), exit_code=code, cap=3)  # type: ignore[arg-type]
    assert d.action == "leave" and why in d.reason


def test_a_second_faulty_node_of_the_same_run_does_nothing() -> None:
    assert decide(job(admin="[sr-fault n=1 restart=0]"), exit_code=3, cap=3).action == "skip"
    assert decide(job(state="PENDING"), exit_code=3, cap=3).action == "skip"


def test_the_comment_keeps_the_hang_count_and_others_text() -> None:
    admin = "SR: [sr-hang n=1 ckpt=5 restart=0] hang job 7: requeue 1 of 3 | site note"
    out = merge_comment(admin, FaultLedger(1, 1), "node fault on node1: gpu0 XID 79")
    assert out.startswith("[sr-fault n=1 restart=1] node fault on node1: gpu0 XID 79 | ")
    assert "[sr-hang n=1 ckpt=5 restart=0]" in out and "site note" in out
    again = merge_comment("SR: " + out, FaultLedger(2, 2), "node fault on node2: x")
    assert again.count("sr-fault") == 1 and "node1" not in again
    assert parse_ledger(again) == FaultLedger(2, 2)


def test_exit_status_from_the_epilog_environment() -> None:
    assert exit_status("3:0") == 3
    assert exit_status("0:9") == 137
    assert exit_status("0:0") == 0
    assert exit_status("") is None and exit_status("x") is None


class _Slurm:
    """Records the requeue's calls; ``refusals`` are raised, in turn, by the AdminComment
    update (Slurm 22.05 answers so right after a requeue, while the job's new accounting
    record is set up)."""

    def __init__(self, *refusals: str):
        self.refusals = list(refusals)
        self.calls: list[str] = []

    def requeue_hold(self, job_id: int, *, cause: str, released: bool) -> None:
        self.calls.append("requeue_hold")

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self.calls.append("set_admin_comment")
        if self.refusals:
            from slurm_resilience.slurm.errors import SlurmError

            raise SlurmError("set admin comment", self.refusals.pop(0))

    def exclude_nodes(self, job_id: int, nodes: list[str]) -> tuple[str, ...]:
        self.calls.append("exclude_nodes")
        return tuple(nodes)

    def release(self, job_id: int) -> None:
        self.calls.append("release")


NOT_NOW = ("Job update not available right now, the DB index is being set, try again in a "
           "bit for job 7")


def test_a_requeued_job_is_recorded_excluded_and_released_once_slurm_lets_it() -> None:
    """Found by bench_recovery --fault node-loss: the AdminComment update right after the
    requeue was refused "try again in a bit", and the job stayed held. Now it is tried again
    (on the injected clock) and the job is released."""
    from slurm_resilience.health.faultrequeue import requeue_away
    from slurm_resilience.testing import FakeClock

    slurm, clock = _Slurm(NOT_NOW, NOT_NOW), FakeClock()
    done, what = requeue_away(slurm, job(), FaultLedger(1, 0), ["node2"],  # type: ignore[arg-type]
                              "node fault on node2", clock=clock)
    assert done, what
    assert slurm.calls == ["requeue_hold", *["set_admin_comment"] * 3, "exclude_nodes",
                           "release"]
    assert clock.monotonic() == 1.5  # two pauses: 0.5 s, then 1 s


def test_a_refusal_that_is_not_transient_leaves_the_job_held_and_says_so() -> None:
    from slurm_resilience.health.faultrequeue import requeue_away
    from slurm_resilience.testing import FakeClock

    slurm, clock = _Slurm("Access/permission denied"), FakeClock()
    done, what = requeue_away(slurm, job(), FaultLedger(1, 0), ["node2"],  # type: ignore[arg-type]
                              "node fault on node2", clock=clock)
    assert not done and "held" in what and "permission denied" in what
    assert slurm.calls == ["requeue_hold", "set_admin_comment"] and clock.monotonic() == 0.0
