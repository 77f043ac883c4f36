"""Planned stops: the agent's warning ahead of a job's time limit and its requeue once the
job saved (hang.limits), and the training side's flag (checkpoint.interrupt)."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint import interrupt
from slurm_resilience.checkpoint.interrupt import stop_text
from slurm_resilience.config import Config
from slurm_resilience.config.schema import NodeSection
from slurm_resilience.hang import jobrecord
from slurm_resilience.hang.limits import (
    LimitWatch,
    end_time,
    merge_comment,
    planned_count,
)
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import JobInfo
from slurm_resilience.testing import FakeClock

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="job records are root-owned")
UID = os.getuid()
NODE = "node1"


class FakeAdapter:
    """Slurm as the service sees it: one job, and the calls made."""

    def __init__(self, job: JobInfo):
        self.job = job
        self.calls: list[tuple[str, Any]] = []
        self.events_path = ""
        self.modes = {"debug": "REQUEUE"}  # partition -> PreemptMode
        self.version = (22, 5)

    def slurm_version(self) -> tuple[int, int]:
        return self.version

    def preempt_mode(self, partition: str) -> str:
        return self.modes[partition]

    def show_job(self, job_id: int) -> JobInfo:
        return self.job

    def requeue(self, job_id: int, cause: str = "hang") -> None:
        self.calls.append(("requeue", cause))

    def set_admin_comment(self, job_id: int, text: str) -> None:
        self.calls.append(("comment", text))

    def show_config(self) -> dict[str, str]:
        return {"PreemptMode": "REQUEUE"}


def job(state: str = "RUNNING", end: str = "2030-01-01T00:01:00", requeue: bool = True,
        admin: str = "", restarts: int = 0) -> JobInfo:
    return JobInfo(job_id=7, name="t", user="u", uid=UID, state=state, requeue=requeue,
                   admin_comment=admin, restarts=restarts, raw={"EndTime": end})


def service(tmp_path: Path, j: JobInfo, clock: FakeClock, kills: list[tuple[int, int]]
            ) -> tuple[LimitWatch, FakeAdapter]:
    cfg = replace(Config(), node=replace(Config().node, run_dir=str(tmp_path / "run")))
    assert isinstance(cfg.node, NodeSection)
    jobrecord.write(P.records_dir(cfg.node.run_dir, NODE),
                    jobrecord.JobRecord(7, UID, os.getgid(), "u", 0.0, (NODE,)))
    adapter = FakeAdapter(j)
    watch = LimitWatch(cfg, NODE, adapter, clock=clock,  # type: ignore[arg-type]
                       kill=lambda pid, sig: kills.append((pid, sig)))
    return watch, adapter


def test_an_armed_rank_is_warned_once_lead_seconds_before_the_end(tmp_path: Path) -> None:
    end = end_time(job())
    assert end is not None
    clock, kills = FakeClock(wall=end - 200.0), []
    watch, _ = service(tmp_path, job(), clock, kills)
    me = Peer(os.getpid(), UID, os.getgid())
    assert watch.handle_arm({"job_id": 7, "signal": "USR1"}, me) == {"lead_s": 180.0}
    watch.tick()
    assert kills == []
    clock.advance(21.0)  # 179 s before the end
    watch.tick()
    watch.tick()
    assert kills == [(os.getpid(), signal.SIGUSR1)]


def test_arming_someone_elses_job_or_a_bad_signal_is_refused(tmp_path: Path) -> None:
    watch, _ = service(tmp_path, job(), FakeClock(wall=0.0), [])
    with pytest.raises(RequestError, match="no job 7 of uid 4242"):
        watch.handle_arm({"job_id": 7}, Peer(os.getpid(), 4242, 4242))
    with pytest.raises(RequestError, match="one of USR1, USR2, URG"):
        watch.handle_arm({"job_id": 7, "signal": "KILL"}, Peer(os.getpid(), UID, 0))


def test_a_stop_ahead_of_the_limit_requeues_the_job_and_notes_it(tmp_path: Path) -> None:
    watch, adapter = service(tmp_path, job(admin="[sr-hang n=1 ckpt=5 restart=0] x"),
                             FakeClock(wall=0.0), [])
    answer = watch.handle_stopped({"job_id": 7, "step": 4812, "cause": "time_limit",
                                   "requeue": True, "seconds_left": 120.2},
                                  Peer(os.getpid(), UID, 0))
    assert answer == {"requeued": True, "text": "time limit in 120 s: saved step 4,812, "
                                                "requeued", "why": ""}
    assert adapter.calls[0] == ("requeue", "time_limit")
    comment = adapter.calls[1][1]
    assert comment.startswith("[sr-planned n=1 restart=0] time limit in 120 s")
    assert "[sr-hang n=1 ckpt=5 restart=0]" in comment


def test_a_stop_is_kept_for_goodput_by_run_for_an_hour(tmp_path: Path) -> None:
    """goodput reads the runs that stopped on purpose from here: the attempt the rank sent,
    or Slurm's Restarts from an older client; kept past the job's end, for an hour."""
    clock = FakeClock(wall=0.0)
    watch, _ = service(tmp_path, job(restarts=3), clock, [])
    me = Peer(os.getpid(), UID, 0)
    stop = {"job_id": 7, "step": 9, "cause": "time_limit", "requeue": True}
    watch.handle_stopped(stop, me)
    assert dict(watch.stopped_runs()) == {7: 3}
    watch.handle_stopped({**stop, "run": 2003}, me)
    assert dict(watch.stopped_runs()) == {7: 2003}
    watch.handle_stopped({**stop, "run": True}, me)  # not a number: Restarts
    assert dict(watch.stopped_runs()) == {7: 3}
    clock.advance(3599.0)
    watch.tick()
    assert dict(watch.stopped_runs()) == {7: 3}
    clock.advance(2.0)
    watch.tick()
    assert dict(watch.stopped_runs()) == {}


def test_a_preempted_job_is_not_requeued_by_us_and_a_done_one_neither(tmp_path: Path) -> None:
    watch, adapter = service(tmp_path, job(), FakeClock(wall=0.0), [])
    me = Peer(os.getpid(), UID, 0)
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"}, me)
    assert answer["text"] == "preempted: saved step 9" and not answer["requeued"]
    assert [c for c, _ in adapter.calls] == ["comment"]
    adapter.job = job(state="COMPLETED")
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "time_limit",
                                   "requeue": True}, me)
    assert answer["why"] == "the job is COMPLETED" and not answer["requeued"]


def test_planned_count_and_comment_keep_others_text() -> None:
    out = merge_comment("SR: [sr-fault n=1 restart=0] node fault on n1: x | site", 2, 3,
                        stop_text("time_limit", 10, None, True))
    assert out == ("[sr-planned n=2 restart=3] time limit: saved step 10, requeued | "
                   "[sr-fault n=1 restart=0] node fault on n1: x | site")
    assert planned_count(out) == (2, 3)
    assert planned_count("") == (0, -1)


def test_end_time_from_text_and_json() -> None:
    assert end_time(job(end="Unknown")) is None
    j = replace(job(), raw={"end_time": {"set": True, "infinite": False, "number": 1826994366}})
    assert end_time(j) == 1826994366.0
    assert end_time(replace(job(), raw={"end_time": {"infinite": True}})) is None


def test_the_signal_only_sets_a_flag_and_sigterm_means_preemption() -> None:
    interrupt.reset()
    previous = signal.signal(signal.SIGUSR1, interrupt._on_signal)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert interrupt.requested() == interrupt.TIME_LIMIT
        interrupt._on_signal(signal.SIGTERM, None)
        assert interrupt.requested() == interrupt.PREEMPT
        interrupt._on_signal(signal.SIGUSR1, None)  # a later warning doesn't lower it
        assert interrupt.requested() == interrupt.PREEMPT
    finally:
        signal.signal(signal.SIGUSR1, previous)
        interrupt.reset()


def test_stop_saves_the_step_and_the_next_run_resumes_from_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One rank, no agent: warned, the loop saves the step it is at and says it could not
    be requeued; a new manager resumes from exactly that step."""
    import torch

    from slurm_resilience.checkpoint import CheckpointManager

    interrupt.reset()
    mgr = CheckpointManager(tmp_path)
    w = torch.nn.Linear(3, 3)
    assert mgr.stop_requested(1) is None
    interrupt._on_signal(signal.SIGUSR1, None)
    assert mgr.stop_requested(3, every=2) is None  # agreed only at multiples of every
    why = mgr.stop_requested(4, every=2)
    assert why == interrupt.Stop("time_limit", None)
    text = mgr.stop(4, why, model=w)
    assert text == ("time limit: saved step 4; not requeued: no node agent for this run "
                    "(resubmit with the same URI to resume)")
    assert f"slurm-resilience: {text}" in capsys.readouterr().err
    mgr.close()
    interrupt.reset()
    loaded = CheckpointManager(tmp_path).load_latest(model=torch.nn.Linear(3, 3))
    assert loaded is not None and loaded.step == 4


def test_a_cancelled_job_that_saved_is_not_counted_as_planned(tmp_path: Path) -> None:
    watch, adapter = service(tmp_path, job(state="CANCELLED"), FakeClock(wall=0.0), [])
    answer = watch.handle_stopped({"job_id": 7, "step": 1200, "cause": "preempt"},
                                  Peer(os.getpid(), UID, 0))
    assert answer == {"requeued": False, "text": "cancelled: saved step 1,200", "why": ""}
    assert adapter.calls == []


def test_a_job_preempted_under_requeue_that_saved_is_requeued_at_once(tmp_path: Path) -> None:
    """Ending within its grace time, a job would end by its exit code, not requeued."""
    j = replace(job(), raw={"EndTime": "Unknown", "PreemptTime": "2026-11-27T22:25:25"})
    watch, adapter = service(tmp_path, j, FakeClock(wall=0.0), [])
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"},
                                  Peer(os.getpid(), UID, 0))
    assert answer["text"] == "preempted: saved step 9, requeued" and answer["requeued"]
    assert adapter.calls[0] == ("requeue", "preempt")


def test_the_preempted_jobs_partition_decides_between_requeue_and_cancel(tmp_path: Path
                                                                         ) -> None:
    """The cluster says REQUEUE, partition spot says CANCEL: a job preempted in spot saved
    and ends (Slurm ends it); one in a REQUEUE partition under a CANCEL cluster is
    requeued."""
    preempted = {"EndTime": "Unknown", "PreemptTime": "2026-11-27T22:25:25"}
    j = replace(job(), partition="spot", raw=preempted)
    watch, adapter = service(tmp_path, j, FakeClock(wall=0.0), [])
    adapter.modes["spot"] = "CANCEL"
    me = Peer(os.getpid(), UID, 0)
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"}, me)
    assert answer == {"requeued": False, "why": "", "text": "preempted: saved step 9, the "
                      "job ends (PreemptMode=CANCEL)"}
    assert [c for c, _ in adapter.calls] == ["comment"]
    adapter.job = replace(j, partition="debug", restarts=1)
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"}, me)
    assert answer["requeued"] and adapter.calls[-2] == ("requeue", "preempt")


def test_an_unreadable_or_qos_preempt_mode_requeues_nothing(tmp_path: Path) -> None:
    """Slurm ends or requeues the job by its own mode; we never guess REQUEUE."""
    j = replace(job(), partition="gone", raw={"EndTime": "Unknown",
                                              "PreemptTime": "2026-11-27T22:25:25"})
    watch, adapter = service(tmp_path, j, FakeClock(wall=0.0), [])

    def unreadable(partition: str) -> str:
        raise SlurmError("show partition", f"Partition {partition} not found")

    adapter.preempt_mode = unreadable  # type: ignore[method-assign]
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"},
                                  Peer(os.getpid(), UID, 0))
    assert answer["text"] == "preempted: saved step 9" and not answer["requeued"]
    # Under preempt/qos the job's QOS decides, which is not read: nothing requeued either.
    adapter.preempt_mode = lambda partition: "REQUEUE"  # type: ignore[method-assign]
    adapter.show_config = lambda: {"PreemptType": "preempt/qos",  # type: ignore[method-assign]
                                   "PreemptMode": "REQUEUE"}
    adapter.job = replace(j, restarts=1)
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"},
                                  Peer(os.getpid(), UID, 0))
    assert answer["text"] == "preempted: saved step 9" and not answer["requeued"]
    assert "requeue" not in [c for c, _ in adapter.calls]


def test_from_2405_slurm_requeues_a_preempted_job_that_saved_not_us(tmp_path: Path) -> None:
    """24.05+ requeues a job ending in its grace time itself, and a requeue of ours would
    leave the preemption set (the next run's end requeued again): we only note it."""
    j = replace(job(), raw={"EndTime": "Unknown", "PreemptTime": "2026-11-27T22:25:25"})
    watch, adapter = service(tmp_path, j, FakeClock(wall=0.0), [])
    adapter.version = (24, 11)
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"},
                                  Peer(os.getpid(), UID, 0))
    assert answer["text"] == "preempted: saved step 9, requeued" and answer["requeued"]
    assert [c for c, _ in adapter.calls] == ["comment"]


def test_a_save_at_the_limits_own_sigterm_is_requeued_as_a_time_limit(tmp_path: Path
                                                                        ) -> None:
    """No warning came in time (a step slower than the lead, no arm): the ranks took
    Slurm's SIGTERM at the limit for a preemption and saved in KillWait. Slurm ended the job
    TIMEOUT, which --requeue does not restart, so the agent requeues it, as a planned stop
    at the limit. A warned rank whose report comes after the kill is requeued too."""
    me = Peer(os.getpid(), UID, 0)
    for state, reason in (("COMPLETING", "TimeLimit"), ("TIMEOUT", "None")):
        j = replace(job(state=state), reason=reason)
        watch, adapter = service(tmp_path, j, FakeClock(wall=0.0), [])
        answer = watch.handle_stopped({"job_id": 7, "step": 64, "cause": "preempt"}, me)
        assert answer == {"requeued": True, "why": "",
                          "text": "time limit reached: saved step 64, requeued"}
        assert adapter.calls[0] == ("requeue", "time_limit")
        assert adapter.calls[1][1].startswith("[sr-planned n=1 restart=0] time limit reached")
        answer = watch.handle_stopped({"job_id": 7, "step": 64, "cause": "time_limit",
                                       "requeue": True, "seconds_left": 3.0}, me)
        assert answer["requeued"], answer


def test_a_cancelled_or_preempted_job_near_its_end_is_not_taken_for_a_time_limit(
        tmp_path: Path) -> None:
    """scancel sets the end time to now as well: only Slurm's TIMEOUT (or its TimeLimit
    reason) says the limit ended the job; a preempted one keeps its own path."""
    me = Peer(os.getpid(), UID, 0)
    cancelled = job(state="COMPLETING", end="1970-01-01T00:00:00")
    watch, adapter = service(tmp_path, cancelled, FakeClock(wall=0.0), [])
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"}, me)
    assert not answer["requeued"] and answer["text"] == "preempted: saved step 9"
    assert "requeue" not in [c for c, _ in adapter.calls]
    both = replace(job(), reason="TimeLimit", raw={"EndTime": "Unknown",
                                                   "PreemptTime": "2026-11-27T22:25:25"})
    watch, adapter = service(tmp_path, both, FakeClock(wall=0.0), [])
    adapter.version = (24, 11)
    answer = watch.handle_stopped({"job_id": 7, "step": 9, "cause": "preempt"}, me)
    assert answer["text"] == "preempted: saved step 9, requeued"
    assert "requeue" not in [c for c, _ in adapter.calls]


def test_an_end_time_slurm_did_not_give_is_read_again_soon(tmp_path: Path) -> None:
    """A failed read leaves the job without a warning until the next one: retried in two
    seconds, not at the half-minute refresh."""
    end = end_time(job())
    assert end is not None
    clock, kills = FakeClock(wall=end - 100.0), []
    watch, adapter = service(tmp_path, job(), clock, kills)
    real = adapter.show_job
    calls: list[float] = []

    def flaky(job_id: int) -> JobInfo:
        calls.append(clock.time())
        if len(calls) == 1:
            raise SlurmError("show job", "Socket timed out on send/recv operation")
        return real(job_id)

    adapter.show_job = flaky  # type: ignore[method-assign]
    watch.handle_arm({"job_id": 7, "signal": "USR1"}, Peer(os.getpid(), UID, os.getgid()))
    watch.tick()
    clock.advance(1.0)
    watch.tick()
    assert len(calls) == 1
    clock.advance(1.0)
    watch.tick()
    assert len(calls) == 2 and kills == [(os.getpid(), signal.SIGUSR1)]
