"""``stragglers.suspect_after_jobs``: a node named a straggler in that many different jobs, of
at least two different users, is drained once as a hang suspect (the reason the suspect
verifier acts on), within the hang handling's hourly budgets; fewer jobs, the same job
again, or one user's jobs drain nothing. Slurm is a stand-in ``scontrol`` that keeps the
nodes' state and reasons, behind the real adapter."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from agent_state import slot

from slurm_resilience import events
from slurm_resilience.config import Config, ConfigError, load_text
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.hang import detect, jobrecord, policy
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.hang.suspect import Check, SuspectWatch, Verification
from slurm_resilience.proc import Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.stragglers.record import Entry, StragglerRecord, suspicion
from slurm_resilience.stragglers.service import StragglerService, status_of
from slurm_resilience.stragglers.synthetic import steps
from slurm_resilience.testing import FakeClock, FakeRunner, completed

NODE = "n1"
NOW = 1_800_000_000.0
FAST = {"window_steps": 20, "min_steps": 10, "persist_evaluations": 3}


class Ctl:
    """``scontrol show node`` / ``update NodeName=`` over a dict of node -> (state, reason),
    and node Comments (kept across resume, as Slurm does)."""

    def __init__(self, nodes: dict[str, tuple[str, str]]):
        self.nodes = dict(nodes)
        self.comments: dict[str, str] = {}
        self.updates: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> Completed:
        args = list(argv[1:])
        if args[:2] == ["show", "node"]:
            names = [a for a in args[2:] if a != "-o"] or sorted(self.nodes)
            return completed("".join(
                f"NodeName={n} State={self.nodes[n][0]} CPUTot=2 CPUAlloc=0 "
                f"Reason={self.nodes[n][1] or '(null)'}"
                + (f" Comment={self.comments[n]}" if self.comments.get(n) else "") + "\n"
                for n in names if n in self.nodes))
        if args[:1] == ["update"]:
            self.updates.append(args)
            fields = dict(a.split("=", 1) for a in args[1:])
            name = fields["NodeName"]
            if fields.get("State") == "DRAIN":
                self.nodes[name] = ("IDLE+DRAIN", fields["Reason"])
            elif fields.get("State") == "RESUME":
                self.nodes[name] = ("IDLE", "")
            elif "Comment" in fields:
                self.comments[name] = fields["Comment"]
            return completed()
        raise AssertionError(f"unexpected scontrol call {argv}")

    @property
    def drains(self) -> list[str]:
        return [dict(a.split("=", 1) for a in u[1:])["Reason"] for u in self.updates
                if "State=DRAIN" in u]


def service(tmp_path: Path, ctl: Ctl, clock: FakeClock, *, need: int = 3,
            heartbeat: dict[str, Any] | None = None) -> StragglerService:
    cfg = load_text(Config, json.dumps({
        "node": {"state_dir": str(tmp_path / "state")},
        "stragglers": {**FAST, "suspect_after_jobs": need},
        "heartbeat": heartbeat or {}}), "test")
    adapter = SlurmAdapter(runner=FakeRunner({"scontrol": [ctl]}))
    return StragglerService(cfg, NODE, adapter, clock=clock)


def job_view(job_id: int, user: str, step: int, row: list[float], slow_rank: int | None
             ) -> JobView:
    slots = [slot(r, step, x * (1.3 if r == slow_rank else 1), job_id) for r, x in enumerate(row)]
    rec = jobrecord.JobRecord(job_id=job_id, uid=1000, gid=1000, user=user, started=0.0)
    return JobView(rec, slots, detect.judge(job_id, slots, 0.0, HeartbeatSection(),
                                            alive={s.rank: True for s in slots}))


def straggle(svc: StragglerService, job_id: int, user: str, slow_rank: int = 6) -> None:
    """A whole job on this node with one slow rank, then the job leaves; waits for any
    suspect drain it started."""
    for i, row in enumerate(steps(8, 40, job_id)):
        svc.steps.observe([job_view(job_id, user, i + 1, row, slow_rank)])
    svc.steps.observe([])
    if svc._suspecting is not None:
        svc._suspecting.join(60)
        assert not svc._suspecting.is_alive()


def recorded(svc: StragglerService) -> list[tuple[int, str, bool]]:
    return [(e.job_id, e.user, e.suspected) for e in svc.steps.record.load()]


def test_named_in_n_jobs_of_two_users_drains_once_as_a_verifiable_suspect(
        tmp_path: Path) -> None:
    ctl = Ctl({NODE: ("IDLE", ""), "n2": ("IDLE", "")})
    clock = FakeClock(wall=NOW)
    svc = service(tmp_path, ctl, clock)
    straggle(svc, 11, "alice")
    straggle(svc, 12, "bob")
    assert ctl.drains == []  # two jobs of three
    straggle(svc, 13, "alice")
    assert len(ctl.drains) == 1
    reason = ctl.drains[0]
    assert reason.startswith("SR: suspect hang job 13 user alice at ")
    assert "straggler in 3 jobs of 2 users" in reason and "(11,12,13)" in reason
    parsed = policy.parse_reason(reason)
    assert parsed is not None and parsed.suspect and parsed.job_id == 13
    assert recorded(svc) == [(11, "alice", True), (12, "bob", True), (13, "alice", True)]
    # Anyone may ask the agent for the record: it answers no job owners.
    recent = status_of(svc.snapshot())["recent"]
    assert [r["job_id"] for r in recent] == [11, 12, 13] and "user" not in recent[0]
    # Named again while drained (a job that was already running): no second drain.
    straggle(svc, 14, "carol")
    assert len(ctl.drains) == 1

    # The suspect verifier recognises the reason, verifies, and returns the node to service.
    passed = Verification((Check("health gate", True, "ok"),), 0.1)
    watch = SuspectWatch(svc.cfg, NODE, svc.adapter, clock, str(tmp_path / "verify"),
                         lambda cfg, node: passed)
    assert watch.poll() == "returned to service"
    assert ctl.nodes[NODE] == ("IDLE", "")
    # Back in service, the take-out still counts against alice's hourly budget.
    assert dict(policy.budget_used(svc.adapter.list_nodes(), "SR:", clock.time()).by_user) == {
        "alice": 1}

    # The jobs that drained it are counted: one more job does not drain it again ...
    straggle(svc, 15, "bob")
    assert len(ctl.drains) == 1
    # ... three fresh ones of two users do (14, 15, 16), once.
    straggle(svc, 16, "carol")
    assert len(ctl.drains) == 2 and "job 16 user carol" in ctl.drains[1]


def test_fewer_jobs_or_the_same_job_twice_drain_nothing(tmp_path: Path) -> None:
    ctl = Ctl({NODE: ("IDLE", "")})
    svc = service(tmp_path, ctl, FakeClock(wall=NOW))
    straggle(svc, 11, "alice")
    straggle(svc, 12, "bob")
    straggle(svc, 12, "bob", slow_rank=2)  # requeued: the same job id, named again
    straggle(svc, 11, "alice", slow_rank=3)
    assert [j for j, _, _ in recorded(svc)] == [12, 11]
    assert ctl.drains == [] and ctl.updates == []


def test_one_users_jobs_never_drain_a_node(tmp_path: Path) -> None:
    """A user can't take a node out with deliberately slow jobs: their jobs are their word."""
    ctl = Ctl({NODE: ("IDLE", "")})
    svc = service(tmp_path, ctl, FakeClock(wall=NOW), need=2)
    for job in (11, 12, 13, 14):
        straggle(svc, job, "mallory")
    assert len(recorded(svc)) == 4 and ctl.drains == []


def test_the_cluster_wide_hang_budget_applies_and_the_jobs_stay_counted_for_later(
        tmp_path: Path) -> None:
    """Other users' suspect take-outs of the hour spend the cluster-wide budget (a drain on
    evidence does not); the straggler's jobs are counted only once it is drained."""
    hour_ago = policy.iso(NOW - 600)
    ctl = Ctl({NODE: ("IDLE", ""),
               "n2": ("IDLE+DRAIN", f"SR: suspect hang job 5 user x at {hour_ago}: w; verifying"),
               "n4": ("IDLE+DRAIN", f"SR: hang job 4 user x at {hour_ago}: rank 0 Xid 79"),
               "n3": ("IDLE+DRAIN", f"SR: suspect hang job 6 user y at {hour_ago}: z; verifying")})
    clock = FakeClock(wall=NOW)
    svc = service(tmp_path, ctl, clock, need=2, heartbeat={"budget_per_hour": 2})
    straggle(svc, 11, "alice")
    straggle(svc, 12, "bob")
    assert ctl.drains == []
    assert all(not s for _, _, s in recorded(svc))  # not counted: held back, not used
    clock.advance(3600)  # the others' drains are older than the hour now
    straggle(svc, 13, "carol")
    assert len(ctl.drains) == 1 and "job 13 user carol" in ctl.drains[0]


def test_the_per_user_hang_budget_applies(tmp_path: Path) -> None:
    recent = policy.iso(NOW - 60)
    ctl = Ctl({NODE: ("IDLE", ""),
               "n2": ("IDLE+DRAIN", f"SR: suspect hang job 7 user bob at {recent}: x; verifying")})
    svc = service(tmp_path, ctl, FakeClock(wall=NOW), need=2,
                  heartbeat={"budget_per_hour": 100, "budget_per_user_per_hour": 1})
    straggle(svc, 11, "alice")
    straggle(svc, 12, "bob")  # tips it, and bob's hourly budget is spent
    assert ctl.drains == []
    assert events.read(svc.events_path)["counters"]["budget|straggler"] == 1
    straggle(svc, 13, "carol")  # carol's is not
    assert len(ctl.drains) == 1 and "job 13 user carol" in ctl.drains[0]


@pytest.mark.parametrize("heartbeat", [{"drain": False}, {"suspect_drain": False},
                                       {"mode": "observe"}])
def test_no_drain_where_the_hang_handling_takes_no_suspect_out(
        tmp_path: Path, heartbeat: dict[str, Any]) -> None:
    ctl = Ctl({NODE: ("IDLE", "")})
    svc = service(tmp_path, ctl, FakeClock(wall=NOW), need=2, heartbeat=heartbeat)
    straggle(svc, 11, "alice")
    straggle(svc, 12, "bob")
    assert ctl.updates == []


def test_someone_elses_drain_is_left_alone(tmp_path: Path) -> None:
    ctl = Ctl({NODE: ("IDLE+DRAIN", "admin: replacing a fan")})
    svc = service(tmp_path, ctl, FakeClock(wall=NOW), need=2)
    straggle(svc, 11, "alice")
    straggle(svc, 12, "bob")
    assert ctl.updates == [] and ctl.nodes[NODE][1] == "admin: replacing a fan"


def test_suspicion_is_pure_and_counts_distinct_jobs_and_known_users() -> None:
    def e(job: int, user: str, suspected: bool = False) -> Entry:
        return Entry(0.0, job, (1,), 0.2, user, suspected)

    assert suspicion([e(1, "a"), e(2, "b")], 0) == []
    assert suspicion([e(1, "a"), e(2, "b")], 3) == []
    assert suspicion([e(1, "a"), e(2, "a"), e(3, "a")], 3) == []
    assert suspicion([e(1, "a"), e(2, ""), e(3, "")], 3) == []  # unknown owners aren't users
    assert [x.job_id for x in suspicion([e(1, "a", True), e(2, "a"), e(3, "b")], 2)] == [2, 3]
    assert suspicion([e(1, "a", True), e(2, "b", True), e(3, "b")], 2) == []


def test_a_record_from_before_users_were_kept_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "stragglers.json"
    path.write_text(json.dumps([{"at": 1.0, "job_id": 5, "ranks": [2], "slowdown": 0.25}]))
    assert StragglerRecord(str(path)).load() == [Entry(1.0, 5, (2,), 0.25, "", False)]


def test_one_job_is_refused_as_a_threshold() -> None:
    with pytest.raises(ConfigError, match=re.escape("suspect_after_jobs=1")):
        load_text(Config, json.dumps({"stragglers": {"suspect_after_jobs": 1}}), "test")


def test_whole_node_namings_take_the_same_suspect_path_once_per_job(tmp_path: Path) -> None:
    """The job's judging agent named this whole node (no slow rank among its own): the
    verdict is recorded beside rank namings, a job named both ways counts once, and three
    jobs of two users drain the node through the same suspect path."""
    from slurm_resilience import events
    from slurm_resilience.stragglers.nodes import Verdict

    ctl = Ctl({NODE: ("IDLE", "")})
    svc = service(tmp_path, ctl, FakeClock(wall=NOW))

    def whole_node(job_id: int, user: str, slow_rank: int | None = None) -> None:
        rows = list(steps(8, 40, job_id))
        for i, row in enumerate(rows):
            svc.steps.observe([job_view(job_id, user, i + 1, row, slow_rank)])
        svc.steps.node_named(Verdict(job_id, NODE, "n0", 1.3, 1.0))
        svc.steps.node_named(Verdict(job_id, NODE, "n0", 1.4, 1.0))  # again: recorded once
        svc.steps.observe([])
        if svc._suspecting is not None:
            svc._suspecting.join(60)

    whole_node(21, "alice", slow_rank=6)  # its ranks and the whole node: one job
    whole_node(22, "bob")
    assert ctl.drains == []
    assert sorted({(e.job_id, e.node) for e in svc.steps.record.load()}) == [
        (21, ""), (21, NODE), (22, NODE)]
    whole_node(23, "alice")
    assert len(ctl.drains) == 1 and "straggler in 3 jobs of 2 users" in ctl.drains[0]
    counters = events.read(svc.events_path)["counters"]
    assert counters == {"straggler|step_time": 1, "straggler|node_step_time": 3}
    status = status_of(svc.snapshot())
    assert [(r["job_id"], r["whole_node"]) for r in status["recent"]] == [
        (21, False), (21, True), (22, True), (23, True)]


def test_observe_mode_records_the_suspect_drain_it_would_make(tmp_path: Path) -> None:
    """With `mode: observe` a node named in enough jobs takes the suspect path as usual and
    the drain is recorded as "would drain", never run."""
    from slurm_resilience.slurm import observed

    ctl = Ctl({NODE: ("IDLE", "")})
    cfg = load_text(Config, json.dumps({
        "mode": "observe", "node": {"state_dir": str(tmp_path / "state")},
        "stragglers": {**FAST, "suspect_after_jobs": 2}}), "test")
    adapter = SlurmAdapter(runner=FakeRunner({"scontrol": [ctl]}))
    adapter.events_path = str(tmp_path / "state" / "metrics-events.json")
    svc = StragglerService(cfg, NODE, adapter, clock=FakeClock(wall=NOW))
    straggle(svc, 11, "alice")
    straggle(svc, 12, "bob")
    assert ctl.updates == []
    (d,) = observed.read(str(tmp_path / "state" / observed.FILENAME))["decisions"]
    assert observed.line(d).startswith("would drain n1: SR: suspect hang job 12 user bob at ")


def test_the_stragglers_service_ticks_on_the_watchers_views_and_hands_out_snapshots(
        tmp_path: Path) -> None:
    """The agent's stragglers service reads the hang watcher's job views on its own tick
    (its live config too); what the metrics get is a frozen snapshot."""
    import dataclasses

    from agent_state import Watcher

    ctl = Ctl({NODE: ("IDLE", "")})
    cfg = load_text(Config, json.dumps({
        "node": {"state_dir": str(tmp_path / "state")}, "stragglers": FAST}), "test")
    watcher = Watcher()
    watcher.cfg = cfg  # type: ignore[attr-defined]
    svc = StragglerService(cfg, NODE, SlurmAdapter(runner=FakeRunner({"scontrol": [ctl]})),
                           watcher, clock=FakeClock(wall=NOW))
    for i, row in enumerate(steps(8, 40, 31)):
        watcher.jobs[31] = job_view(31, "alice", i + 1, row, 6)
        svc.tick()
    snap = svc.snapshot()
    (job,) = snap.jobs
    assert (job.job_id, job.ranks, job.straggler_ranks) == (31, 8, (6,))
    assert [(e.job_id, e.ranks) for e in snap.recent] == [(31, (6,))]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.jobs = ()  # type: ignore[misc]
    watcher.jobs.clear()
    svc.tick()
    assert svc.snapshot().jobs == () and snap.jobs[0].job_id == 31
    assert ctl.updates == []  # one job: no suspect
