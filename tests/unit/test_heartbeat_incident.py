"""Unit tests of hang handling v2: evidence-only drains, suspects and their verification,
budgets, root-side checkpoint facts, retried and persisted incidents, reports by socket."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.config import Config
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.config.schema import NodeSection
from slurm_resilience.hang import (
    actions,
    ckptfacts,
    incident,
    policy,
    rendezvous,
    socketapi,
    takeouts,
)
from slurm_resilience.hang import blame as B
from slurm_resilience.hang.actions import Step, StepKind
from slurm_resilience.hang.incidentrecords import (
    Action,
    NodeCall,
    NodeVerdict,
    Piece,
    PieceError,
    ReportDoc,
    piece_from_bytes,
    piece_to_bytes,
)
from slurm_resilience.hang.store import ClaimBasis, IncidentStore, Progress
from slurm_resilience.hang.suspect import Check, SuspectWatch, Verification
from slurm_resilience.hang.watcher import HangWatcher
from slurm_resilience.proc import CommandError, CommandTimeout, Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import NodeInfo
from slurm_resilience.testing import FakeClock

HB = HeartbeatSection(step_timeout_s=1.0, warmup_timeout_s=1.0, warmup_steps=0,
                      min_timeout_s=0.5, budget_per_hour=2, budget_per_user_per_hour=1)
NOW = 1_800_000_000.0


def _cfg(tmp_path: Path, **hb: object) -> Config:
    return Config(node=NodeSection(state_dir=str(tmp_path / "state"),
                                   run_dir=str(tmp_path / "run")),
                  heartbeat=replace(HB, **hb))


class SlurmStandIn:
    """Answers scontrol like slurmctld for one job and one node; can be 'down' for a number
    of calls (each raising a timeout, as when slurmctld is stopped); records every argv."""

    def __init__(self, *, restarts: int = 0, down_calls: int = 0, node_reason: str = "",
                 alloc: int = 0, completing: bool = False,
                 on_node: Sequence[str] = ("42",), steps: Sequence[str] = ("42.0|node1",)):
        self.restarts, self.down_calls = restarts, down_calls
        self.node_reason, self.alloc = node_reason, alloc
        self.completing = completing
        # squeue: the jobs on node1 (%A) and job 42's steps (%i|%N)
        self.on_node, self.steps = list(on_node), list(steps)
        self.state = "RUNNING"
        self.node_comment = ""
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        if self.down_calls > 0:
            self.down_calls -= 1
            raise CommandTimeout(argv, "timed out: Unable to contact slurm controller")
        if list(argv[1:]) == ["--version"]:  # the adapter reads 22.05's text form
            return Completed(tuple(argv), 0, "slurm 22.05.8\n", "", 0.0)
        self.calls.append(list(argv))
        out = ""
        if argv[0].endswith("squeue"):
            out = "\n".join(self.steps if "--steps" in argv else self.on_node)
        elif argv[1:3] == ["show", "job"]:
            out = (f"JobId=42 JobName=t UserId=alice(1000) JobState={self.state} "
                   f"Restarts={self.restarts} BatchHost=node1 NodeList=node1 NumNodes=1 "
                   "Requeue=1 AdminComment=(null)")
        elif argv[1:3] == ["show", "node"]:
            flag = ("+COMPLETING" if self.completing else "") + (
                "+DRAIN" if self.node_reason else "")
            reason = f"{self.node_reason} [root@2026-11-23T10:00:00]" if self.node_reason \
                else "(null)"
            out = (f"NodeName=node1 State=IDLE{flag} CPUTot=2 CPUAlloc={self.alloc} "
                   f"Reason={reason}")
            if self.node_comment:  # scontrol prints it after the reason, only when set
                out += f" Comment={self.node_comment}"
        elif argv[1] == "requeue":
            self.restarts += 1
        elif argv[1:3] == ["update", "NodeName=node1"]:
            if argv[3] == "State=RESUME":
                self.node_reason = ""
            elif argv[3].startswith("Comment="):
                self.node_comment = argv[3].removeprefix("Comment=")
            else:
                self.node_reason = argv[4].removeprefix("Reason=")
        return Completed(tuple(argv), 0, out, "", 0.0)


class ResizedJobSlurm(SlurmStandIn):
    """Refuses every update of the job's AdminComment as Slurm does for a job it resized
    after a lost node (without accounting, for the job's life)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.comment_refusals = 0

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        if argv[1:3] == ["update", "JobId=42"] and argv[3].startswith("AdminComment="):
            self.comment_refusals += 1
            message = ("Job update not available right now, the DB index is being set, try "
                       "again in a bit for job 42")
            raise CommandError(argv, "exit 1", Completed(tuple(argv), 1, "", message, 0.0))
        return super().run(argv, timeout=timeout, check=check, input_text=input_text, env=env)


def _node(name: str, reason: str) -> NodeInfo:
    return NodeInfo(name, "IDLE", frozenset({"DRAIN"}), reason)


# -- pure policy -------------------------------------------------------------------------------


def test_heuristic_blame_makes_a_suspect_and_health_findings_a_drain() -> None:
    """"Stalled first" only makes the node a suspect; an Xid on a node drains it for the Xid."""
    obs = [B.RankObservation(0, "n1", 11, 100.0), B.RankObservation(1, "n2", 10, 100.0)]
    empty = policy.Budget(0, {}, frozenset())
    calls, note = policy.node_calls(42, "alice", B.blame(42, obs, {}), self_reported=False,
                                    now=NOW, budget=empty, cfg=HB)
    assert [(c.node, c.verdict) for c in calls] == [("n2", NodeVerdict.SUSPECT)] and not note
    assert calls[0].reason.startswith("suspect hang job 42 user alice at ")
    assert "rank 1 stalled first (lowest step)" in calls[0].reason
    xid = B.blame(42, obs, {"n1": ["PCI 0000:01:00 XID 79 (fallen off the bus) at 10:00"]})
    calls, _ = policy.node_calls(42, "alice", xid, self_reported=False, now=NOW, budget=empty,
                                 cfg=HB)
    assert [(c.node, c.verdict) for c in calls] == [("n1", NodeVerdict.DRAIN)]
    assert "XID 79" in calls[0].reason


def test_our_reasons_carry_user_and_time_and_count_against_the_budget() -> None:
    """The budget counts nodes out of service with our hang reasons of the last hour, per user."""
    reason = "SR: " + policy.suspect_reason(7, "bob", NOW - 60, "rank 0 stalled first")
    parsed = policy.parse_reason(reason)
    assert parsed == policy.HangReason(True, 7, "bob", NOW - 60)
    old = "SR: " + policy.drain_reason(8, "eve", NOW - 7200, "x")
    nodes = [_node("a", reason), _node("b", old),
             _node("c", "SR: health: gpu3 missing"), _node("d", "admin: maintenance")]
    used = policy.budget_used(nodes, "SR:", NOW)
    assert (used.total, dict(used.by_user), used.nodes) == (1, {"bob": 1}, frozenset({"a"}))


def test_past_the_budget_nodes_are_reported_not_taken_out() -> None:
    """With the user's hourly budget spent, a suspect is spared and the note says why."""
    obs = [B.RankObservation(0, "n1", 11, 100.0), B.RankObservation(1, "n2", 10, 100.0)]
    used = policy.Budget(1, {"alice": 1}, frozenset({"n9"}))
    calls, note = policy.node_calls(42, "alice", B.blame(42, obs, {}), self_reported=False,
                                    now=NOW, budget=used, cfg=HB)
    assert [c.verdict for c in calls] == [NodeVerdict.SPARE]
    assert note == ("hang budget spent for user alice (1 of 1 suspect take-outs per hour by "
                    "their jobs): n2 reported, not taken out of service")


def test_evidence_drains_are_never_held_by_the_budget() -> None:
    """Two accounts spent the whole cluster-wide budget with suspects; a third user's hang
    with an Xid on its node still drains it, and nothing about it is counted or recorded."""
    cfg = replace(HB, budget_per_hour=4, budget_per_user_per_hour=2)
    spent = policy.Budget(4, {"mallory": 2, "eve": 2}, frozenset())
    obs = [B.RankObservation(0, "n1", 11, 100.0), B.RankObservation(1, "n2", 10, 100.0)]
    blamed = B.blame(42, obs, {"n3": ["gpu3: XID 79 (GPU fell off the bus)"]})
    assert blamed.rule == "health"
    calls, note = policy.node_calls(42, "carol", blamed, self_reported=False, now=NOW,
                                    budget=spent, cfg=cfg)
    assert [(c.node, c.verdict) for c in calls] == [("n3", NodeVerdict.DRAIN)] and note == ""
    d = policy.decide(42, run=0, user="carol", requeue_allowed=True, admin_comment="",
                      ckpt_step=5, mode="act", cfg=cfg, calls=calls, budget_note=note)
    kinds = [s.kind for s in policy.plan(42, d, "", drain=True)]
    assert kinds[0] is StepKind.DRAIN and StepKind.RECORD not in kinds
    out = [NodeInfo("n3", "IDLE", frozenset({"DRAIN"}), "SR: " + calls[0].reason)]
    assert policy.budget_used(out, "SR:", NOW).total == 0


def test_suspects_are_limited_per_user_first_and_the_refusal_names_the_spenders() -> None:
    """One user's jobs spend only that user's share; once two accounts spent the cluster-wide
    cap, a third user's suspect is reported (the note names the spenders and counts) and
    still avoided by the requeued job, since its owner spent nothing."""
    cfg = replace(HB, budget_per_hour=4, budget_per_user_per_hour=2)
    obs = [B.RankObservation(0, "n1", 11, 100.0), B.RankObservation(1, "n2", 10, 100.0)]
    blamed = B.blame(42, obs, {})
    half = policy.Budget(2, {"mallory": 2}, frozenset())
    calls, note = policy.node_calls(42, "mallory", blamed, self_reported=False, now=NOW,
                                    budget=half, cfg=cfg)
    assert [c.verdict for c in calls] == [NodeVerdict.SPARE]
    assert note.startswith("hang budget spent for user mallory (2 of 2 suspect take-outs")
    calls, note = policy.node_calls(42, "carol", blamed, self_reported=False, now=NOW,
                                    budget=half, cfg=cfg)
    assert [c.verdict for c in calls] == [NodeVerdict.SUSPECT] and note == ""
    spent = policy.Budget(4, {"mallory": 2, "eve": 2}, frozenset())
    calls, note = policy.node_calls(42, "carol", blamed, self_reported=False, now=NOW,
                                    budget=spent, cfg=cfg)
    assert [c.verdict for c in calls] == [NodeVerdict.SPARE]
    assert note == ("hang budget spent cluster-wide (4 of 4 suspect take-outs per hour, by "
                    "eve 2, mallory 2; 0 of 2 for user carol): n2 reported, not taken out of "
                    "service; the requeued job avoids it")
    d = policy.decide(42, run=0, user="carol", requeue_allowed=True, admin_comment="",
                      ckpt_step=5, mode="act", cfg=cfg, calls=calls, budget_note=note)
    assert d.action is Action.REQUEUE and d.exclude == ("n2",)
    assert StepKind.DRAIN not in [s.kind for s in policy.plan(42, d, "", drain=True)]


def test_a_node_held_back_by_the_budget_is_not_excluded_from_the_job() -> None:
    """A suspect the budget kept in service is not taken out, so the requeued job is not
    kept away from it either (plain requeue, no ExcNodeList)."""
    obs = [B.RankObservation(0, "n1", 11, 100.0), B.RankObservation(1, "n2", 10, 100.0)]
    used = policy.Budget(1, {"alice": 1}, frozenset({"n9"}))
    calls, note = policy.node_calls(42, "alice", B.blame(42, obs, {}), self_reported=False,
                                    now=NOW, budget=used, cfg=HB)
    d = policy.decide(42, run=0, user="alice", requeue_allowed=True, admin_comment="",
                      ckpt_step=5, mode="act", cfg=HB, calls=calls, budget_note=note)
    assert d.action is Action.REQUEUE and d.exclude == ()
    assert [s.kind for s in policy.plan(42, d, "", drain=True)] == [StepKind.COMMENT,
                                                                    StepKind.REQUEUE]
    off = replace(HB, suspect_drain=False)
    calls, _ = policy.node_calls(42, "alice", B.blame(42, obs, {}), self_reported=False,
                                 now=NOW, budget=policy.Budget(0, {}, frozenset()), cfg=off)
    d = policy.decide(42, run=0, user="alice", requeue_allowed=True, admin_comment="",
                      ckpt_step=5, mode="act", cfg=off, calls=calls, budget_note="")
    assert d.exclude == ("n2",)  # the site's choice: kept in service, avoided by the job


def test_a_node_the_job_asked_for_by_name_is_never_excluded() -> None:
    """A job submitted with -w naming its suspect is requeued without the exclusion (it
    could never start again) and the decision says so."""
    call = NodeCall("n2", NodeVerdict.SUSPECT, "suspect ...")
    d = policy.decide(42, run=0, user="alice", requeue_allowed=True, admin_comment="",
                      ckpt_step=5, mode="act", cfg=HB, calls=[call], budget_note="",
                      required=("n1", "n2"))
    assert d.action is Action.REQUEUE and d.exclude == ()
    assert "the job asked for n2 by name: requeued without excluding it" in d.reason
    assert StepKind.EXCLUDE not in [s.kind for s in policy.plan(42, d, "", drain=True)]


def _up(name: str, comment: str) -> NodeInfo:
    return NodeInfo(name, "IDLE", frozenset(), "", comment=comment)


def test_take_outs_count_for_an_hour_also_after_the_node_is_back() -> None:
    """The budgets count take-outs of the last hour: a suspect drained and resumed within
    the hour still counts (its Comment keeps the record), per user and cluster-wide; older
    ones don't; a node out now whose record is also in its Comment counts once."""
    bob = policy.parse_reason(policy.suspect_reason(7, "bob", NOW - 600, "rank 0 stalled first"))
    assert bob is not None
    comment = takeouts.merge_comment("", takeouts.TakeOut.of(bob))
    reason = "SR: " + policy.suspect_reason(7, "bob", NOW - 600, "rank 0 stalled first")
    nodes = [
        _up("a", comment),  # drained for bob's job 10 minutes ago, verified, resumed
        _up("b", f"[sr-out alice/8/{int(NOW - 1800)} alice/9/{int(NOW - 7200)}] rack 4"),
        _up("c", "admin: new PSU"),
        NodeInfo("d", "IDLE", frozenset({"DRAIN"}), reason, comment=comment),  # out now
    ]
    used = policy.budget_used(nodes, "SR:", NOW)
    assert (used.total, dict(used.by_user), used.nodes) == (3, {"bob": 2, "alice": 1},
                                                            frozenset({"d"}))
    later = policy.budget_used(nodes, "SR:", NOW + 2000)  # alice's is over an hour old now
    assert (later.total, dict(later.by_user)) == (2, {"bob": 2})


def test_a_user_cycling_suspect_drains_is_stopped_by_the_budget() -> None:
    """Alice's suspect was verified and resumed; her next hang within the hour finds her
    budget (1 per user) spent, though no node is out of service now."""
    old = policy.parse_reason(policy.suspect_reason(41, "alice", NOW - 300, "rank 1 ..."))
    assert old is not None
    nodes = [_up("n2", takeouts.merge_comment("", takeouts.TakeOut.of(old)))]
    obs = [B.RankObservation(0, "n1", 11, 100.0), B.RankObservation(1, "n2", 10, 100.0)]
    calls, note = policy.node_calls(42, "alice", B.blame(42, obs, {}), self_reported=False,
                                    now=NOW, budget=policy.budget_used(nodes, "SR:", NOW),
                                    cfg=HB)
    assert [c.verdict for c in calls] == [NodeVerdict.SPARE]
    assert "for user alice (1 of 1 suspect take-outs" in note


def test_the_take_out_record_is_bounded_and_keeps_the_operators_text() -> None:
    """Merging prunes entries older than an hour before the new one, keeps at most
    MAX_ENTRIES, is idempotent, and leaves an operator's own text in the Comment."""
    first = takeouts.TakeOut("alice", 1, int(NOW - 4000))
    text = takeouts.merge_comment("rack 4, PSU swapped", first)
    assert text == f"[sr-out alice/1/{int(NOW - 4000)}] rack 4, PSU swapped"
    now = takeouts.TakeOut("bob", 2, int(NOW))
    text = takeouts.merge_comment(text, now)
    assert takeouts.parse_comment(text) == [now] and text.endswith("] rack 4, PSU swapped")
    assert takeouts.merge_comment(text, now) == text
    for i in range(100):
        text = takeouts.merge_comment(text, takeouts.TakeOut("eve", 100 + i, int(NOW) + i))
    assert len(takeouts.parse_comment(text)) == takeouts.MAX_ENTRIES
    assert takeouts.parse_comment("[sr-out ../x/1 bob/2/3 alice/nan/4]") == [
        takeouts.TakeOut("bob", 2, 3)]


def test_a_take_out_is_recorded_only_for_a_drain_slurm_shows(tmp_path: Path) -> None:
    """The record step writes the node's Comment through the adapter only when the node is
    out with this incident's reason; a refusal is reported, an unreachable Slurm retried."""
    reason = policy.suspect_reason(42, "alice", NOW, "rank 1 stalled first")
    slurm = SlurmStandIn()
    adapter = SlurmAdapter(runner=slurm)
    assert "not out for this incident" in actions.record_takeout(adapter, "node1", reason)
    adapter.drain("node1", reason)
    assert actions.record_takeout(adapter, "node1", reason).startswith("recorded")
    assert takeouts.parse_comment(slurm.node_comment) == [takeouts.TakeOut("alice", 42,
                                                                           int(NOW))]
    assert ["scontrol", "update", "NodeName=node1",
            f"Comment={slurm.node_comment}"] in [c[-4:] for c in slurm.calls]
    refusing = SlurmStandIn(node_reason="SR: " + reason)
    refusing.run = _refuse_comment(refusing, "Invalid node state specified")  # type: ignore[method-assign]
    note = actions.record_takeout(SlurmAdapter(runner=refusing), "node1", reason)
    assert note.startswith("couldn't record the take-out of node1")
    away = SlurmStandIn(node_reason="SR: " + reason)
    away.run = _refuse_comment(away, "Unable to contact slurm controller")  # type: ignore[method-assign]
    with pytest.raises(SlurmError):
        actions.record_takeout(SlurmAdapter(runner=away), "node1", reason)


def test_a_take_out_record_replaced_by_another_writer_is_merged_again() -> None:
    """No compare-and-set in scontrol: another incident's agent (or an operator) may write
    the same node's Comment between our read and write. The record is read back, merged
    again, and says so when it never sticks."""
    reason = policy.suspect_reason(42, "alice", NOW, "rank 1 stalled first")
    theirs = takeouts.TakeOut("bob", 7, int(NOW) - 60)
    for overwrites, recorded in ((1, True), (actions.RECORD_TRIES, False)):
        slurm = SlurmStandIn(node_reason="SR: " + reason)
        real, left = slurm.run, [overwrites]

        def run(argv: Sequence[str], real=real, left=left, slurm=slurm,  # type: ignore[no-untyped-def]
                **kw: object) -> Completed:
            done = real(argv, **kw)  # type: ignore[arg-type]
            if any(a.startswith("Comment=") for a in argv) and left[0] > 0:
                # The other writer read before our write and writes after it.
                left[0] -= 1
                slurm.node_comment = takeouts.merge_comment("ops: fan swap", theirs)
            return done

        slurm.run = run  # type: ignore[method-assign]
        note = actions.record_takeout(SlurmAdapter(runner=slurm), "node1", reason)
        ours = takeouts.TakeOut("alice", 42, int(NOW))
        if recorded:
            assert note.startswith("recorded"), note
            assert set(takeouts.parse_comment(slurm.node_comment)) == {ours, theirs}
            assert "ops: fan swap" in slurm.node_comment  # the operator's text is kept
        else:
            assert "replaced by another writer after each of 3 writes" in note, note
            assert ours not in takeouts.parse_comment(slurm.node_comment)


def _refuse_comment(slurm: SlurmStandIn, message: str) -> object:
    real = slurm.run

    def run(argv: Sequence[str], **kw: object) -> Completed:
        if any(a.startswith("Comment=") for a in argv):
            raise CommandError(argv, "exit 1", Completed(tuple(argv), 1, "", message, 0.0))
        return real(argv, **kw)  # type: ignore[arg-type]

    return run


def test_no_requeue_job_is_left_or_cancelled_and_never_drains() -> None:
    """A --no-requeue job is left running (or cancelled, per policy); its suspect is spared."""
    call = NodeCall("n2", NodeVerdict.SUSPECT, "suspect ...")
    for pol, action, kinds in (("leave", Action.LEAVE, []), ("cancel", Action.CANCEL, ["cancel"])):
        cfg = replace(HB, no_requeue_policy=pol)
        d = policy.decide(42, run=0, user="alice", requeue_allowed=False, admin_comment="",
                          ckpt_step=-1, mode="act", cfg=cfg, calls=[call], budget_note="")
        assert d.action is action and [c.verdict for c in d.nodes] == [NodeVerdict.SPARE]
        steps = policy.plan(42, d, "", drain=True)
        assert [s.kind.value for s in steps] == kinds


def test_requeue_with_a_suspect_holds_excludes_then_releases() -> None:
    """A requeued job avoids its suspect: drain, ledger, requeue held, exclude, release."""
    call = NodeCall("n2", NodeVerdict.SUSPECT, "suspect ...")
    d = policy.decide(42, run=0, user="alice", requeue_allowed=True, admin_comment="",
                      ckpt_step=5, mode="act", cfg=HB, calls=[call], budget_note="")
    assert d.action is Action.REQUEUE and d.exclude == ("n2",)
    assert [s.kind for s in policy.plan(42, d, "", drain=True)] == [
        StepKind.DRAIN, StepKind.RECORD, StepKind.COMMENT, StepKind.REQUEUE_HOLD, StepKind.EXCLUDE,
        StepKind.RELEASE]


def test_checkpoint_progress_comes_from_the_root_journal(tmp_path: Path) -> None:
    """The guard's step is the checkpoint journal's newest committed step; none: -1."""
    cfg = _cfg(tmp_path)
    assert ckptfacts.committed_step(cfg, "node1", 42).step == -1
    journal = tmp_path / "state" / "ckpt-journal"
    journal.mkdir(parents=True, mode=0o700)
    (journal / "job-42.json").write_text(json.dumps({"job_id": 42, "steps": {
        "5": {"state": "committed"}, "10": {"state": "pending"}, "15": {"state": "rejected"}}}))
    assert ckptfacts.committed_step(cfg, "node1", 42).step == 10


def test_a_piece_may_speak_only_for_its_sender() -> None:
    """A received piece naming another node, or malformed, is refused; a good one round-trips."""
    piece = Piece("n2", "timeout", NOW, (), (B.RankObservation(1, "n2", 10, NOW, None, 0.1),),
                  ("XID 79",), {})
    assert piece_from_bytes(piece_to_bytes(piece), "n2") == piece
    with pytest.raises(PieceError, match="from n3 speaks for n2"):
        piece_from_bytes(piece_to_bytes(piece), "n3")
    with pytest.raises(PieceError):
        piece_from_bytes(b'{"node": "n2", "ranks": 5}', "n2")


def test_dir_rendezvous_implements_the_protocol(tmp_path: Path) -> None:
    """DirRendezvous publishes, announces to another node, and gathers root-owned pieces."""
    a = rendezvous.DirRendezvous(str(tmp_path / "rdv"), "n1", started=0)
    b: rendezvous.Rendezvous = rendezvous.DirRendezvous(str(tmp_path / "rdv"), "n2", started=0)
    b.publish(42, 0, "n1", ["n1", "n2"], b'{"x": 1}')
    assert a.announced() == [(42, 0, "n2")] and a.announced() == []
    assert a.gather(42, 0, ["n1", "n2"], time.monotonic() + 1) == {"n2": b'{"x": 1}'}


# -- acting: retries, persistence --------------------------------------------------------------


def _runner_cfg(tmp_path: Path, **hb: object) -> tuple[Config, FakeClock]:
    return _cfg(tmp_path, **hb), FakeClock(real=True)


def _watcher(cfg: Config, slurm: SlurmStandIn, clock: FakeClock) -> HangWatcher:
    return HangWatcher(cfg, "node1", SlurmAdapter(runner=slurm), clock=clock,
                       sleep=clock.sleep, config_path="",
                       rendezvous=rendezvous.NoRendezvous())


def test_an_incident_claimed_before_a_restart_is_finished_once(tmp_path: Path) -> None:
    """A restarted agent resumes a half-done plan (requeue once); a third life does nothing."""
    cfg, clock = _runner_cfg(tmp_path)
    slurm = SlurmStandIn()
    store = IncidentStore(str(tmp_path / "state" / "heartbeat" / "acted"))
    assert store.claim(42, 0, clock.time() + 60)
    store.save(Progress(42, 0, "acting", (Step(StepKind.COMMENT, text="c"),
                                          Step(StepKind.REQUEUE)), 1, clock.time() + 60))
    first = _watcher(cfg, slurm, clock)
    first.wait()
    assert [c[1] for c in slurm.calls if c[1] in ("requeue", "update")] == ["requeue"]
    second = _watcher(cfg, slurm, clock)
    second.wait()
    assert [c[1] for c in slurm.calls].count("requeue") == 1
    assert (42, 0) in second.store.seen


def test_a_claim_without_a_plan_is_decided_again_after_a_restart(tmp_path: Path) -> None:
    """The agent died between claim and plan: the next start decides again from the claim
    (the suspect drained, the job requeued, once); a third life does nothing more."""
    cfg, clock = _runner_cfg(tmp_path)
    slurm = SlurmStandIn()
    store = IncidentStore(str(tmp_path / "state" / "heartbeat" / "acted"))
    stalled = B.Blame((("node1", "hang job 42: rank 1 stalled first"),), (1,), "lowest step",
                      "rank 1 on node1 stalled first (lowest step)")
    assert store.claim(42, 0, clock.time() + 60, ClaimBasis("act", False, stalled))
    _watcher(cfg, slurm, clock).wait()
    assert [c[1] for c in slurm.calls].count("requeuehold") == 1
    assert slurm.node_reason.startswith("SR: suspect hang job 42 user alice")
    done = store.load(42, 0)
    assert done is not None and done.state == "done" and len(done.plan) == 6
    report = incident.read_report(str(tmp_path / "state" / "incidents"),
                                  "hang-job42-run0-node1.json")
    assert report["decision"]["action"] == "requeue"
    assert report["actions"][0] == "(decided again after an agent restart)"
    assert "requeued and held job 42" in report["actions"]
    calls = len(slurm.calls)
    _watcher(cfg, slurm, clock).wait()
    assert len(slurm.calls) == calls


def test_a_claim_without_a_plan_past_its_deadline_is_dropped_and_says_so(
        tmp_path: Path) -> None:
    """Past the incident's deadline a plan-less claim is given up without a Slurm call."""
    cfg, clock = _runner_cfg(tmp_path)
    slurm = SlurmStandIn()
    store = IncidentStore(str(tmp_path / "state" / "heartbeat" / "acted"))
    none = B.Blame((), (), "none", "no node can be blamed")
    assert store.claim(42, 0, clock.time() - 1, ClaimBasis("act", False, none))
    _watcher(cfg, slurm, clock).wait()
    assert slurm.calls == [] and store.load(42, 0).state == "gave-up"  # type: ignore[union-attr]


def test_a_requeue_already_done_before_a_crash_is_not_repeated(tmp_path: Path) -> None:
    """If the job's Restarts already moved past the run, the resumed requeue step does nothing."""
    cfg, clock = _runner_cfg(tmp_path)
    slurm = SlurmStandIn(restarts=1)
    store = IncidentStore(str(tmp_path / "state" / "heartbeat" / "acted"))
    store.claim(42, 0, clock.time() + 60)
    store.save(Progress(42, 0, "acting", (Step(StepKind.REQUEUE),), 0, clock.time() + 60))
    _watcher(cfg, slurm, clock).wait()
    assert not [c for c in slurm.calls if c[1] == "requeue"]
    assert store.load(42, 0) == Progress(42, 0, "done", (Step(StepKind.REQUEUE),), 1,
                                         store.load(42, 0).deadline)  # type: ignore[union-attr]


def test_slurm_errors_are_retried_with_backoff_until_the_deadline(tmp_path: Path) -> None:
    """Slurm down for a while: the step is retried with growing waits and done once; down past
    the deadline: the incident gives up and says so."""
    cfg, clock = _runner_cfg(tmp_path)
    store = IncidentStore(str(tmp_path / "acted"))
    slurm = SlurmStandIn(down_calls=6)
    w = _watcher(cfg, slurm, clock)
    before = clock.offset
    plan = (Step(StepKind.REQUEUE),)
    store.claim(42, 0, clock.time() + 60)
    w.runner.store = store
    w.runner.resume(Progress(42, 0, "acting", plan, 0, clock.time() + 60))
    assert [c[1] for c in slurm.calls].count("requeue") == 1
    assert clock.offset - before == pytest.approx(0.5 + 1 + 2 + 4 + 8 + 8)
    slurm = SlurmStandIn(down_calls=10**6)
    w = _watcher(cfg, slurm, clock)
    w.runner.store = store
    store.claim(43, 0, clock.time() + 30)
    w.runner.resume(Progress(43, 0, "acting", plan, 0, clock.time() + 30))
    assert store.load(43, 0).state == "gave-up"  # type: ignore[union-attr]
    assert slurm.calls == []


def test_the_handled_set_is_bounded() -> None:
    """The in-memory set of handled runs keeps only the newest max_handled."""
    store = IncidentStore("/nonexistent", max_handled=16)
    for job in range(100):
        assert store.remember((job, 0))
    assert len(store.seen) == 16 and not store.remember((99, 0)) and store.remember((0, 0))


# -- suspects ----------------------------------------------------------------------------------


def _verifier(*checks: Check) -> object:
    return lambda cfg, node: Verification(checks, 0.1)


def _suspect_watch(tmp_path: Path, slurm: SlurmStandIn, *checks: Check,
                   **hb: object) -> SuspectWatch:
    return SuspectWatch(_cfg(tmp_path, **hb), "node1", SlurmAdapter(runner=slurm),
                        FakeClock(real=True), str(tmp_path / "hb"),
                        _verifier(*checks))  # type: ignore[arg-type]


SUSPECT = "SR: " + policy.suspect_reason(42, "alice", time.time(), "rank 1 stalled first")


def test_a_comment_slurm_refuses_for_a_resized_job_does_not_stop_the_recovery() -> None:
    """After a lost node, Slurm refuses updates of the resized job ("the DB index is being
    set"). The plan's comment is then given up after RESIZED_WAIT_S, said, and the requeue
    still happens; before, the incident retried it until its deadline and the hung job was
    neither relaunched nor requeued. Other failures of the comment still hold the plan."""
    slurm = ResizedJobSlurm()
    clock = actions.Clocked(FakeClock(wall=0.0))
    plan = [Step(StepKind.COMMENT, text="[sr-hang n=1 ckpt=10 restart=0] hang"),
            Step(StepKind.REQUEUE)]
    done, complete = actions.execute(SlurmAdapter(runner=slurm), 42, 0, plan, 0,
                                     deadline=90.0, clock=clock, progress=lambda i: None)
    assert complete and slurm.restarts == 1, done
    assert "DB index is being set" in done[0] and "went on without it" in done[0]
    assert done[1] == "requeued job 42"
    assert actions.RESIZED_WAIT_S <= clock.now() < 90.0
    away = SlurmStandIn(down_calls=1000)
    done, complete = actions.execute(SlurmAdapter(runner=away), 42, 0, plan, 0,
                                     deadline=90.0, clock=actions.Clocked(FakeClock(wall=0.0)),
                                     progress=lambda i: None)
    assert not complete and "gave up at the incident's deadline" in done[0]


def test_a_suspect_that_passes_verification_returns_to_service(tmp_path: Path) -> None:
    """The node's own agent verifies its suspect drain and resumes the node when all pass."""
    slurm = SlurmStandIn(node_reason=SUSPECT)
    watch = _suspect_watch(tmp_path, slurm, Check("health gate", True, "ok"),
                           Check("loopback test", True, "ok"))
    watch.tick()
    watch.close(10)
    assert slurm.node_reason == "" and watch.last["outcome"] == "returned to service"


def test_the_agent_keeps_since_when_its_node_is_in_our_drain(tmp_path: Path) -> None:
    """Each look at the node records the first time it was seen in our drain (kept while a
    health-check pass sets its reason again, as the drained-too-long alert needs) and
    forgets it once the node is back."""
    from slurm_resilience import events

    slurm = SlurmStandIn(node_reason="SR: health: gpu3 XID 79")
    watch = _suspect_watch(tmp_path, slurm)
    watch.adapter.events_path = str(tmp_path / events.FILENAME)
    watch.poll()
    first = events.read(watch.adapter.events_path)["out"]
    assert list(first) == ["node1"] and first["node1"]["cause"] == "health"
    slurm.node_reason = "SR: health: gpu3 XID 79 (+1 more)"
    watch.clock.sleep(3600)  # type: ignore[attr-defined]
    watch.poll()
    assert events.read(watch.adapter.events_path)["out"] == first
    slurm.node_reason = ""
    watch.poll()
    assert events.read(watch.adapter.events_path)["out"] == {}
    slurm.node_reason = "someone else's maintenance"
    watch.poll()
    assert events.read(watch.adapter.events_path)["out"] == {}


def test_a_suspect_failing_verification_is_drained_naming_the_check(tmp_path: Path) -> None:
    """A failed loopback test drains the node with the check, measured against expected."""
    slurm = SlurmStandIn(node_reason=SUSPECT)
    watch = _suspect_watch(tmp_path, slurm, Check("health gate", True, "ok"), Check(
        "loopback test", False, "nccl allreduce 0.002 GB/s < 0.01 (2xcpu, 1MiB)"))
    watch.tick()
    watch.close(10)
    assert slurm.node_reason.startswith("SR: hang job 42 user alice at ")
    assert "verification failed: loopback test: nccl allreduce 0.002 GB/s < 0.01" \
        in slurm.node_reason


def test_a_suspect_is_verified_only_after_the_job_left(tmp_path: Path) -> None:
    """While CPUs are still allocated on the node, nothing is verified yet."""
    slurm = SlurmStandIn(node_reason=SUSPECT, alloc=2)
    watch = _suspect_watch(tmp_path, slurm, Check("health gate", True, "ok"))
    assert watch.poll() == "suspect still allocated" and slurm.node_reason == SUSPECT


def test_a_suspect_its_job_holds_but_runs_nothing_on_is_verified_and_returned(
        tmp_path: Path) -> None:
    """A relaunch under ``launch`` took the node out of the step; the job keeps it in its
    allocation (CPUs allocated) but runs no step there, and no other job is on it: the node
    is verified at once and returned, to come back to the job as a spare. A step of the job
    on it (the batch script's included), or another job, keeps it waiting; its extern step
    does not."""
    ok = Check("health gate", True, "ok")
    for on_node, steps in ((["42"], ["42.0|node1"]), (["42", "77"], ["42.1|node2"]),
                           (["42"], ["42.batch|node1", "42.1|node2"])):
        slurm = SlurmStandIn(node_reason=SUSPECT, alloc=2, on_node=on_node, steps=steps)
        watch = _suspect_watch(tmp_path, slurm, ok)
        assert watch.poll() == "suspect still allocated" and slurm.node_reason == SUSPECT
    slurm = SlurmStandIn(node_reason=SUSPECT, alloc=2, on_node=["42"],
                         steps=["42.extern|node[1-3]", "42.1|node[2-3]"])
    watch = _suspect_watch(tmp_path, slurm, ok)
    assert watch.poll() == "returned to service" and slurm.node_reason == ""
    squeue = [c for c in slurm.calls if c[0].endswith("squeue")]
    assert [c[1:] for c in squeue] == [
        ["--nodelist=node1", "--noheader", "--format=%A"],
        ["--steps", "--jobs=42", "--noheader", "--format=%i|%N"]]


def test_a_held_suspect_that_fails_is_drained_only_once_its_job_has_left(
        tmp_path: Path) -> None:
    """A failure while the job still holds the node drains nothing (a step the user started
    there could have caused it): the node stays a suspect, is verified again after
    HELD_RETRY_S and twice that while held, then not until the job has left, and is
    drained on a failure then."""
    from slurm_resilience.hang.suspect import HELD_RETRIES, HELD_RETRY_S

    ran: list[int] = []

    def failing(cfg: Config, node: str) -> Verification:
        ran.append(1)
        return Verification((Check("loopback test", False, "0.002 GB/s < 0.01"),), 0.1)

    slurm = SlurmStandIn(node_reason=SUSPECT, alloc=2, steps=["42.1|node2"])
    clock = FakeClock(real=True)
    watch = SuspectWatch(_cfg(tmp_path), "node1", SlurmAdapter(runner=slurm), clock,
                         str(tmp_path / "hb"), failing)
    assert HELD_RETRIES == 2
    assert watch.poll() == f"verification failed while held: again in {HELD_RETRY_S:.0f} s"
    assert slurm.node_reason == SUSPECT and ran == [1]
    assert watch.poll() == "suspect still allocated" and ran == [1]
    clock.advance(HELD_RETRY_S)
    assert watch.poll() == \
        f"verification failed while held: again in {2 * HELD_RETRY_S:.0f} s"
    clock.advance(2 * HELD_RETRY_S - 1)
    assert watch.poll() == "suspect still allocated" and ran == [1, 1]
    clock.advance(1)
    assert watch.poll() == "verification failed while held: again once the job has left"
    clock.advance(3600)
    assert watch.poll() == "suspect still allocated" and ran == [1, 1, 1]
    assert slurm.node_reason == SUSPECT
    slurm.alloc, slurm.on_node, slurm.steps = 0, [], []
    assert watch.poll().startswith("drained: ") and ran == [1, 1, 1, 1]
    assert "verification failed: loopback test: 0.002 GB/s < 0.01" in slurm.node_reason


def test_a_held_suspect_that_fails_once_returns_as_a_spare_when_it_passes_later(
        tmp_path: Path) -> None:
    """One failed verification while held (a transient cause) doesn't keep a good node out
    of its job until the job ends: it is verified again after HELD_RETRY_S and returned."""
    from slurm_resilience.hang.suspect import HELD_RETRY_S

    results = [False, True]

    def flaky(cfg: Config, node: str) -> Verification:
        ok = results.pop(0)
        return Verification((Check("loopback test", ok, "ok" if ok else "timed out"),), 0.1)

    slurm = SlurmStandIn(node_reason=SUSPECT, alloc=2, steps=["42.1|node2"])
    clock = FakeClock(real=True)
    watch = SuspectWatch(_cfg(tmp_path), "node1", SlurmAdapter(runner=slurm), clock,
                         str(tmp_path / "hb"), flaky)
    assert watch.poll().startswith("verification failed while held: again in ")
    clock.advance(HELD_RETRY_S)
    assert watch.poll() == "returned to service" and slurm.node_reason == "" and not results


def test_a_suspect_is_not_verified_while_the_requeued_job_is_completing(
        tmp_path: Path) -> None:
    """A requeued job frees its CPUs at once, but its processes stay until KillWait
    (IDLE+COMPLETING+DRAIN): the node is verified only once they are gone."""
    slurm = SlurmStandIn(node_reason=SUSPECT, completing=True)
    watch = _suspect_watch(tmp_path, slurm, Check("health gate", True, "ok"))
    assert watch.poll() == "suspect still allocated" and slurm.node_reason == SUSPECT
    slurm.completing = False
    watch.poll()
    assert slurm.node_reason == ""  # verified and returned


def _suspected_by(tmp_path: Path, users: Sequence[tuple[int, str]], deep: Verification,
                  ) -> tuple[SlurmStandIn, SuspectWatch, list[int]]:
    """Each job's suspicion verified in turn (all checks pass), with ``deep`` as the deeper
    verification; returns the last stand-in, the watch and how often ``deep`` ran."""
    from slurm_resilience import events

    ran: list[int] = []

    def deeper(cfg: Config, node: str) -> Verification:
        ran.append(1)
        return deep

    ok = Check("health gate", True, "ok")
    for job, user in users:
        reason = "SR: " + policy.suspect_reason(job, user, time.time(), "rank 1 stalled first")
        slurm = SlurmStandIn(node_reason=reason)
        watch = SuspectWatch(_cfg(tmp_path, suspect_threshold=3), "node1",
                             SlurmAdapter(runner=slurm), FakeClock(real=True), str(tmp_path / "hb"),
                             _verifier(ok), deeper)  # type: ignore[arg-type]
        watch.adapter.events_path = str(tmp_path / events.FILENAME)
        watch.tick()
        watch.close(10)
    return slurm, watch, ran


def test_a_node_suspected_by_many_users_jobs_that_passes_deeper_checks_returns(
        tmp_path: Path) -> None:
    """Jobs of 3 users suspected the node (user-code sleeps can do that): the third
    suspicion runs the deeper verification, and when it is clean too the node returns to
    service, reported (record for status, counted event, metric), not drained."""
    from slurm_resilience import events
    from slurm_resilience.hang import status

    clean = Verification((Check("active diagnostics", True, "memtest ok"),
                          Check("longer loopback test", True, "0.76 GB/s")), 2.0)
    slurm, watch, ran = _suspected_by(tmp_path, ((40, "ann"), (41, "ben"), (42, "cid")), clean)
    assert slurm.node_reason == "" and watch.last["outcome"] == "returned to service"
    assert ran == [1] and watch.recent_users() == 3
    assert events.read(watch.adapter.events_path)["counters"]["suspicion|cleared"] == 1
    row = status.suspicion(str(tmp_path / "hb"), watch.cfg.heartbeat, time.time())
    assert row["users"] == 3 and row["jobs"] == ["40(ann)", "41(ben)", "42(cid)"]
    assert row["last_deep"] is not None and row["last_deep"]["passed"]
    text = status.render({"mode": "act", "suspicion": row})
    assert "suspicion of this node: jobs of 3 users within 24h" in text
    assert "passed: returned to service; active diagnostics: memtest ok" in text


def test_a_failed_deeper_verification_drains_naming_the_check(tmp_path: Path) -> None:
    """Only a failed check drains a repeated suspect: the reason names the deeper check."""
    from slurm_resilience import events

    bad = Verification((Check("active diagnostics", False,
                              "gpu2 memory test: 12 bad pages (expected 0)"),), 2.0)
    slurm, watch, ran = _suspected_by(tmp_path, ((40, "ann"), (41, "ben"), (42, "cid")), bad)
    assert ran == [1] and slurm.node_reason.startswith("SR: hang job 42 user cid at ")
    assert ("deeper verification failed: active diagnostics: gpu2 memory test: 12 bad pages "
            "(expected 0)") in slurm.node_reason
    assert events.read(watch.adapter.events_path)["counters"]["suspicion|failed"] == 1


def test_one_users_many_suspicions_get_the_plain_verification_only(tmp_path: Path) -> None:
    """Jobs of one user (or two, below the threshold of 3) never call for the deeper
    verification; each suspect passing the plain one returns."""
    never = Verification((Check("deeper", False, "must not run"),), 0.0)
    slurm, watch, ran = _suspected_by(
        tmp_path, ((40, "mal"), (41, "mal"), (42, "eve"), (43, "mal")), never)
    assert ran == [] and slurm.node_reason == "" and watch.recent_users() == 2


def test_an_earlier_releases_suspicion_drain_is_verified_and_returned(tmp_path: Path) -> None:
    """A node an earlier release drained for suspicion adding up ("hang suspect of jobs ...")
    is a suspect now: verified, and returned when it passes."""
    at = policy.iso(time.time() - 60)
    slurm = SlurmStandIn(node_reason=f"SR: hang suspect of jobs 40(ann),41(ben),42(cid) user - "
                                     f"at {at}: suspected by 3 users' jobs within 24h")
    watch = _suspect_watch(tmp_path, slurm, Check("health gate", True, "ok"))
    assert watch.poll() == "returned to service" and slurm.node_reason == ""
    assert watch.history.load() == []  # it names no job: no suspicion added


def test_the_deeper_verification_waits_for_the_node_lock_and_says_when_nothing_runs(
        tmp_path: Path) -> None:
    """A busy node lock postpones the deeper verification (no evidence either way); with the
    diagnostics and the loopback test switched off it passes and says nothing more ran."""
    from slurm_resilience.hang.suspect import deep_verify
    from slurm_resilience.nccl import schedule

    cfg = _cfg(tmp_path, verify_loopback=False)
    cfg = replace(cfg, health=replace(cfg.health, diag=replace(cfg.health.diag, enabled=False)))
    (tmp_path / "run").mkdir()
    lock = schedule.NodeLock(str(tmp_path / "run" / schedule.LOCK_NAME))
    assert lock.try_acquire()
    try:
        busy = deep_verify(cfg, "node1")
    finally:
        lock.release()
    assert busy.retry and not busy.passed and "node lock busy" in busy.failure
    idle = deep_verify(cfg, "node1")
    assert idle.passed and "nothing more to run" in idle.checks[0].detail


# -- reports through the socket ----------------------------------------------------------------


def test_reports_are_fetched_by_their_owner_only(tmp_path: Path) -> None:
    """The job's owner (and root) get the report text; another uid is refused alike whether or
    not the job exists."""
    report = {"job_id": 42, "restart": 0, "user": "alice", "uid": 1000, "node": "node1",
              "mode": "act", "detected_at": NOW, "ranks": [], "evidence": {},
              "blame": {"explanation": "x"}, "decision": {"action": "requeue", "reason": "r"},
              "actions": []}
    incident.write_agent_copy(str(tmp_path), report)
    got = socketapi.fetch(str(tmp_path), "node1", {"job_id": 42}, Peer(1, 1000, 1000), 1 << 20)
    assert "job 42 run 0" in got["text"] and got["runs"] == [0]
    assert socketapi.fetch(str(tmp_path), "node1", {"job_id": "42"}, Peer(1, 0, 0), 100)[
        "truncated"]
    for job in (42, 43):
        with pytest.raises(RequestError, match=f"no hang report of job {job} for uid 1001"):
            socketapi.fetch(str(tmp_path), "node1", {"job_id": job}, Peer(1, 1001, 1001), 1 << 20)
    with pytest.raises(RequestError, match="must be a job id"):
        socketapi.fetch(str(tmp_path), "node1", {"job_id": "../x"}, Peer(1, 0, 0), 1 << 20)
    assert os.stat(tmp_path).st_uid == os.geteuid()


def test_status_lists_unusable_reports_by_name(tmp_path: Path) -> None:
    """``status`` lists each report; a file that isn't JSON, isn't an object, or lacks a
    report's identity is shown with its name and why, never left out silently."""
    from slurm_resilience.hang import status

    report: ReportDoc = {"job_id": 42, "restart": 1, "user": "alice", "uid": 1000,
                         "node": "node1", "mode": "act", "detected_at": NOW,
                         "decision": {"action": "requeue", "reason": "r"},
                         "blame": {"nodes": [], "ranks": [], "rule": "", "explanation": "x"}}
    incident.write_agent_copy(str(tmp_path), report)
    (tmp_path / "broken.json").write_text("{nope")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "old.json").write_text(json.dumps({"restart": 0, "node": "n", "mode": "act"}))
    rows = {r.get("file", r.get("job_id")): r for r in status.incidents(str(tmp_path))}
    assert rows[42] == {"job_id": 42, "run": 1, "node": "node1", "mode": "act",
                        "detected_at": NOW, "action": "requeue", "reason": "r", "blame": "x",
                        "files": []}
    assert str(rows["broken.json"]["error"]).startswith("couldn't read: Expecting")
    assert rows["list.json"]["error"] == "couldn't read: list.json is not a report"
    assert rows["old.json"]["error"] == "couldn't read: old.json: job_id None is not an integer"


def test_a_busy_node_lock_postpones_verification_instead_of_draining(tmp_path: Path) -> None:
    """A loopback test that could not start (node lock busy) is no evidence: verify again later."""
    slurm = SlurmStandIn(node_reason=SUSPECT)
    watch = _suspect_watch(tmp_path, slurm, Check("health gate", True, "ok"),
                           Check("loopback test", False, "node lock busy", retry=True))
    watch.tick()
    watch.close(10)
    assert slurm.node_reason == SUSPECT and watch.last == {}


def test_stopping_the_agent_leaves_a_waiting_incident_for_the_next_start(tmp_path: Path) -> None:
    """close() ends an incident's wait on an absent slurmctld at once; its claimed plan stays
    'acting' for the next start to finish."""
    cfg, clock = _runner_cfg(tmp_path)
    store = IncidentStore(str(tmp_path / "state" / "heartbeat" / "acted"))
    store.claim(42, 0, clock.time() + 600)
    store.save(Progress(42, 0, "acting", (Step(StepKind.REQUEUE),), 0, clock.time() + 600))
    watcher = HangWatcher(cfg, "node1", SlurmAdapter(runner=SlurmStandIn(down_calls=10**6)),
                          clock=clock, config_path="", rendezvous=rendezvous.NoRendezvous())
    watcher.close()
    assert not any(t.is_alive() for t in watcher.threads.values())
    assert store.load(42, 0).state == "acting"  # type: ignore[union-attr]


def test_markers_of_an_earlier_release_count_as_handled(tmp_path: Path) -> None:
    """An act marker holding only a time (earlier releases) is a finished incident."""
    store = IncidentStore(str(tmp_path / "acted"))
    (tmp_path / "acted").mkdir(mode=0o700)
    (tmp_path / "acted" / "7-0").write_text("1795000000.5")
    assert store.unfinished() == [] and (7, 0) in store.seen
    assert store.load(7, 0) == Progress(7, 0, "done") and not store.claim(7, 0, 0.0)


def test_a_report_escapes_what_the_user_controls() -> None:
    """A script path with an ANSI/OSC escape and a newline reaches the report as escaped
    text inside the indented stack: no raw escape byte, no line of its own."""
    from slurm_resilience.hang.incident import render_text

    evil = "/home/u/\x1b]0;owned\x07x\x1b[2J.py\nSR: fake line"
    text = render_text({
        "job_id": 7, "restart": 0, "node": "n1", "mode": "act", "user": "u\x1b[31m",
        "ranks": [{"rank": 0, "node": "n1", "state": "hung", "step": 3, "idle_s": 9.0,
                   "timeout_s": 5.0, "timeout_kind": "step", "section": "ck\npt"}],
        "evidence": {"n1": {"xids": {"checked": True, "findings": []},
                            "health": {"checked": True},
                            "ranks": [{"rank": 0, "pid": 5,
                                       "stack": f"Thread 1 (idle)\n    main ({evil}:3)\n"}]}},
    })
    assert "\x1b" not in text and "\x07" not in text
    assert not any(line.startswith("SR:") for line in text.splitlines())
    assert any(line.startswith("  SR: fake line") for line in text.splitlines())  # indented
    assert "\\x1b]0;owned\\x07" in text and "section ck\\npt" in text and "user u\\x1b[31m" in text
