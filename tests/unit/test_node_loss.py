"""A launcher's step that ended non-zero: which step node Slurm shows lost (pure), the spare
that replaces it, the wait for Slurm's SlurmdTimeout and its bound (FakeClock), the agent's
answer (one batched ``scontrol show node``, the owner-only refusal, a decision acted on
once, the node-fault requeue away from the lost node) and the launcher's loop around it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_resilience import events
from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.config import Config
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.hang import nodeloss as NL
from slurm_resilience.hang import orphans
from slurm_resilience.hang.detect import JobVerdict, RankState
from slurm_resilience.hang.jobrecord import JobRecord
from slurm_resilience.hang.launches import Launch, Launches
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.hang.nodelossflow import NodeLossDesk
from slurm_resilience.hang.nodereach import Reach, Target
from slurm_resilience.launch import plan as P
from slurm_resilience.launch.supervise import MAX_LOSS_WAIT_S, WAIT_GRACE_S, Launcher, Settings
from slurm_resilience.proc import Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.parse import NodeInfo
from slurm_resilience.testing import FakeClock

OWNER = Peer(pid=10, uid=1001, gid=1001)
OTHER = Peer(pid=11, uid=1002, gid=1002)
ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1",
       "SLURM_TASKS_PER_NODE": "1(x3)"}


def ours(reason: str) -> bool:
    return reason.startswith("SR:")


def node(name: str, state: str = "MIXED", *flags: str, reason: str = "") -> NodeInfo:
    return NodeInfo(name, state, frozenset(flags), reason)


def launch(**over: object) -> Launch:
    base = Launch(42, 1001, 10, 0, ("n1", "n2"), ("n3",), 3, 0.0)
    return replace(base, **over)  # type: ignore[arg-type]


HEALTHY = {"n1": node("n1"), "n2": node("n2"), "n3": node("n3", "IDLE")}


# -- which node is out (pure) ------------------------------------------------------------------

@pytest.mark.parametrize("info,out", [
    (node("n2", "DOWN", "NOT_RESPONDING"), "down+not_responding"),
    (node("n2", "MIXED", "NOT_RESPONDING"), "mixed+not_responding"),
    (node("n2", "FAIL"), "fail"),
    (node("n2", "MIXED", "DRAIN", reason="SR: health: gpu0 XID 79"),
     "drained (SR: health: gpu0 XID 79)"),
    (None, "Slurm no longer lists it"),
])
def test_a_node_slurm_shows_down_failing_or_drained_by_us_is_out(info: NodeInfo | None,
                                                                 out: str) -> None:
    assert NL.why_out(info, ours) == out


def test_a_node_in_service_or_drained_by_someone_else_is_not_out() -> None:
    assert NL.why_out(node("n2"), ours) == ""
    assert NL.why_out(node("n2", "MIXED", "DRAIN", reason="maintenance"), ours) == ""


# -- the decision (pure) -----------------------------------------------------------------------

def test_a_lost_node_is_replaced_by_the_spare() -> None:
    infos = {**HEALTHY, "n2": node("n2", "DOWN", "NOT_RESPONDING")}
    loss = NL.decide(launch(), infos, job_nodes=("n1", "n3"), ours=ours, waited_s=0,
                     bound_s=90)
    assert loss.verdict is NL.Verdict.RELAUNCH and list(loss.out) == ["n2"]
    assert loss.order is not None
    assert (loss.order.relaunch, loss.order.nodes, loss.order.joined, loss.order.out) == (
        1, ("n1", "n3"), ("n3",), ("n2",))
    assert "node fault in job 42 (n2 down+not_responding): relaunch 1 of 3" in loss.reason


@pytest.mark.parametrize("over,infos,why", [
    ({}, {"n3": node("n3", "IDLE", "DRAIN", reason="SR: health: x")},
     "no usable spare for n2; spare n3 not used: idle (SR: health: x)"),
    ({"spares": ("n9",)}, {}, "spare n9 not used: not in the job's allocation"),
    ({"spares": ()}, {}, "no usable spare for n2"),
    ({"relaunch": 3}, {}, "--max-restarts 3 is spent"),
])
def test_without_a_usable_spare_or_restarts_left_the_job_is_requeued(
        over: dict[str, object], infos: dict[str, NodeInfo], why: str) -> None:
    seen = {**HEALTHY, "n2": node("n2", "DOWN"), **infos}
    loss = NL.decide(launch(**over), seen, job_nodes=("n1", "n2", "n3"), ours=ours,
                     waited_s=0, bound_s=90)
    assert loss.verdict is NL.Verdict.REQUEUE and loss.order is None
    assert why in loss.reason and list(loss.out) == ["n2"]


def test_with_nothing_out_the_agent_waits_up_to_the_bound_then_lets_the_step_end() -> None:
    bound = NL.wait_bound(30, 15)
    assert bound == 60
    waiting = NL.decide(launch(), HEALTHY, job_nodes=("n1", "n2", "n3"), ours=ours,
                        waited_s=20, bound_s=bound)
    assert waiting.verdict is NL.Verdict.WAIT and waiting.wait_s == 40
    ended = NL.decide(launch(), HEALTHY, job_nodes=("n1", "n2", "n3"), ours=ours,
                      waited_s=60, bound_s=bound)
    assert ended.verdict is NL.Verdict.EXIT and "left alone" in ended.reason


def test_slurmd_timeout_is_read_from_show_config() -> None:
    assert NL.slurmd_timeout({"SlurmdTimeout": "30 sec"}) == 30
    assert NL.slurmd_timeout({}) is None
    assert NL.slurmd_port({"SlurmdPort": "6818"}) == 6818
    assert NL.slurmd_port({}) is None


def test_a_node_the_probes_found_lost_is_out_as_one_slurm_shows_down() -> None:
    loss = NL.decide(launch(), HEALTHY, job_nodes=("n1", "n2", "n3"), ours=ours, waited_s=6,
                     bound_s=60, unreachable={"n2": "unreachable for 6s (...)"})
    assert loss.verdict is NL.Verdict.RELAUNCH and loss.out == {"n2": "unreachable for 6s (...)"}
    assert loss.order is not None and loss.order.nodes == ("n1", "n3")
    # Slurm's own view comes first when it has one.
    down = {**HEALTHY, "n2": node("n2", "DOWN", "NOT_RESPONDING")}
    loss = NL.decide(launch(), down, job_nodes=("n1", "n2", "n3"), ours=ours, waited_s=6,
                     bound_s=60, unreachable={"n2": "unreachable for 6s (...)"})
    assert loss.out == {"n2": "down+not_responding"}


# -- the agent's answer ------------------------------------------------------------------------

class SlurmState:
    """Answers scontrol like slurmctld for job 42 on n[1-3]; node states as a test sets."""

    def __init__(self, states: Mapping[str, str]):
        self.states = dict(states)
        self.calls: list[list[str]] = []
        self.comment = "(null)"

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        if list(argv[1:]) == ["--version"]:
            return Completed(tuple(argv), 0, "slurm 22.05.8\n", "", 0.0)
        self.calls.append(list(argv))
        out = ""
        if argv[1:3] == ["show", "config"]:
            out = "SlurmdTimeout           = 30 sec\n"
        elif argv[1:3] == ["show", "job"]:
            out = ("JobId=42 JobName=t UserId=u(1001) JobState=RUNNING Restarts=0 "
                   "BatchHost=n1 NodeList=n[1-3] NumNodes=3 Requeue=1 "
                   f"AdminComment={self.comment} ExcNodeList=(null) StdOut=/nonexistent/x")
        elif argv[1:3] == ["show", "node"]:
            out = "\n".join(f"NodeName={n} State={s} CPUTot=2 CPUAlloc=2 Reason=(null)"
                            for n, s in self.states.items())
        elif argv[1:3] == ["update", "JobId=42"] and argv[3].startswith("AdminComment="):
            self.comment = argv[3].removeprefix("AdminComment=")
        return Completed(tuple(argv), 0, out, "", 0.0)


class Probes:
    """The batch host's probes of the step nodes, as a test sets them: each node's slurmd and
    agent answer unless listed in ``down`` (what a connect to either then said)."""

    def __init__(self) -> None:
        self.down: dict[str, str] = {}
        self.asked: list[list[str]] = []

    def __call__(self, targets: Sequence[Target]) -> dict[str, Reach]:
        self.asked.append([t.node for t in targets])
        return {t.node: Reach(t.node, self.down.get(t.node, ""), self.down.get(t.node, ""))
                for t in targets}


def desk(tmp_path: Path, states: Mapping[str, str], unreachable_s: float = 5.0,
         **register: object) -> tuple[NodeLossDesk, SlurmState, FakeClock]:
    d, slurm, clock, _ = probed_desk(tmp_path, states, unreachable_s, **register)
    return d, slurm, clock


def run_now(fn: Callable[[], None]) -> None:
    fn()


def probed_desk(tmp_path: Path, states: Mapping[str, str], unreachable_s: float = 5.0,
                aside: Callable[[Callable[[], None]], None] = run_now,
                **register: object) -> tuple[NodeLossDesk, SlurmState, FakeClock, Probes]:
    clock = FakeClock()
    slurm = SlurmState(states)
    adapter = SlurmAdapter(runner=slurm)
    adapter.events_path = str(tmp_path / events.FILENAME)
    launches = Launches(clock)
    launches.register({"job_id": 42, "relaunch": 0, "nodes": ["n1", "n2"], "spares": ["n3"],
                       "max_restarts": 3, **register}, OWNER, 1001)
    cfg = Config(heartbeat=HeartbeatSection(node_loss_margin_s=15,
                                            node_unreachable_s=unreachable_s))
    probes = Probes()
    return (NodeLossDesk(lambda: cfg, launches, adapter, clock, "n1", probes, aside), slurm,
            clock, probes)


def counted(tmp_path: Path, decision: str) -> int:
    path = tmp_path / events.FILENAME
    counters = json.loads(path.read_text())["counters"] if path.exists() else {}
    return int(counters.get(f"{events.NODE_LOSS}|{decision}", 0))


ASK = {"job_id": 42, "relaunch": 0, "status": 1}


def test_only_the_jobs_owner_asks_and_the_status_is_checked(tmp_path: Path) -> None:
    d, _, _ = desk(tmp_path, {"n1": "MIXED", "n2": "MIXED", "n3": "IDLE"})
    with pytest.raises(RequestError, match="no launcher of job 42 for uid 1002"):
        d.step_ended(ASK, OTHER)
    with pytest.raises(RequestError, match="no launcher of job 7 for uid 1001"):
        d.step_ended({**ASK, "job_id": 7}, OWNER)
    with pytest.raises(RequestError, match="status must be"):
        d.step_ended({**ASK, "status": "1"}, OWNER)
    with pytest.raises(RequestError, match="is at relaunch 0, not 2"):
        d.step_ended({**ASK, "relaunch": 2}, OWNER)


def test_a_lost_node_is_relaunched_on_the_spare_once(tmp_path: Path) -> None:
    d, slurm, _ = desk(tmp_path, {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING", "n3": "IDLE"})
    first = d.step_ended(ASK, OWNER)
    again = d.step_ended(ASK, OWNER)
    assert first == again and first["verdict"] == "relaunch"
    assert first["order"]["nodes"] == ["n1", "n3"]  # type: ignore[index]
    shows = [c for c in slurm.calls if c[1:3] == ["show", "node"]]
    assert shows == [["scontrol", "show", "node", "n[1-3]", "-o"]]  # one call for all
    assert "node fault on n2" in slurm.comment and "relaunch 1 of 3" in slurm.comment
    assert not [c for c in slurm.calls if c[1] in ("requeuehold", "requeue")]
    assert not [c for c in slurm.calls if "State=DRAIN" in " ".join(c)]  # never drained here
    assert counted(tmp_path, "relaunch") == 1
    # The launcher's poll sees the same order.
    assert d.launches.poll({"job_id": 42}, OWNER)["order"] == first["order"]


def test_the_order_is_answered_before_the_admin_comment_is_written(tmp_path: Path) -> None:
    """Slurm may hold a resized job's update for seconds before refusing it (seen in the
    fault storm: 5 s), and the launcher's request carried that wait: the comment is written
    aside, and the answer with the order does not wait for it."""
    held: list[Callable[[], None]] = []
    d, slurm, _, _ = probed_desk(tmp_path, {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING",
                                            "n3": "IDLE"}, aside=held.append)
    answer = d.step_ended(ASK, OWNER)
    assert answer["verdict"] == "relaunch" and len(held) == 1
    assert slurm.comment == "(null)"  # not yet
    held.pop()()
    assert "node fault on n2" in slurm.comment and "relaunch 1 of 3" in slurm.comment


def test_nothing_out_waits_from_the_first_question_then_ends(tmp_path: Path) -> None:
    d, slurm, clock = desk(tmp_path, {"n1": "MIXED", "n2": "MIXED", "n3": "IDLE"})
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"
    clock.advance(59)
    answer = d.step_ended(ASK, OWNER)
    assert answer["verdict"] == "wait" and answer["wait_s"] == 1
    clock.advance(1)
    assert d.step_ended(ASK, OWNER)["verdict"] == "exit"
    assert len([c for c in slurm.calls if c[1:3] == ["show", "config"]]) == 1  # read once
    assert counted(tmp_path, "relaunch") == counted(tmp_path, "requeue") == 0


def test_a_node_marked_while_waiting_is_relaunched(tmp_path: Path) -> None:
    d, slurm, clock = desk(tmp_path, {"n1": "MIXED", "n2": "MIXED", "n3": "IDLE"})
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"
    clock.advance(31)
    slurm.states["n2"] = "MIXED+NOT_RESPONDING"
    assert d.step_ended(ASK, OWNER)["verdict"] == "relaunch"


def test_a_node_neither_slurmd_nor_agent_answers_for_long_enough_is_relaunched_without(
        tmp_path: Path) -> None:
    """Slurm still shows n2 in service; the batch host's probes find its slurmd and agent
    gone. It is out once it stayed unreachable through every probe for
    ``node_unreachable_s``; an answer in between starts that over. Never drained."""
    d, slurm, clock, probes = probed_desk(tmp_path, {"n1": "MIXED", "n2": "MIXED",
                                                     "n3": "IDLE"})
    probes.down["n2"] = "connection refused"
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"
    assert probes.asked == [["n2"]]  # its own node (n1) is never probed
    clock.advance(3)
    probes.down.clear()  # it answered once: the miss before counts for nothing
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"
    probes.down["n2"] = "connection refused"
    clock.advance(1)
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"
    clock.advance(4)
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"  # 4 s unreachable: not yet
    clock.advance(0.5)
    asked = len(probes.asked)
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"  # no new round within the second
    assert len(probes.asked) == asked
    clock.advance(0.5)
    answer = d.step_ended(ASK, OWNER)
    assert answer["verdict"] == "relaunch", answer
    assert answer["order"]["nodes"] == ["n1", "n3"]  # type: ignore[index]
    assert "n2 unreachable for 5s (slurmd n2:6818 connection refused, agent n2:6828 " \
        "connection refused)" in str(answer["reason"])
    assert not [c for c in slurm.calls if "State=DRAIN" in " ".join(c)]
    assert counted(tmp_path, "relaunch") == 1


def test_a_node_whose_slurmd_or_agent_still_answers_is_not_out(tmp_path: Path) -> None:
    d, _, clock, _ = probed_desk(tmp_path, {"n1": "MIXED", "n2": "MIXED", "n3": "IDLE"})
    half = {"slurmd": Reach("n2", "connection refused", ""),
            "agent": Reach("n2", "", "no answer in 1s")}
    for reach in half.values():
        d.probe = lambda targets, r=reach: {"n2": r}  # type: ignore[misc]
        clock.advance(30)
        assert d.step_ended(ASK, OWNER)["verdict"] == "wait", reach
    assert not d.unreachable[(42, 0)].since


def test_with_node_unreachable_s_0_only_slurm_is_asked(tmp_path: Path) -> None:
    d, _, clock, probes = probed_desk(tmp_path, {"n1": "MIXED", "n2": "MIXED", "n3": "IDLE"},
                                      unreachable_s=0)
    probes.down["n2"] = "connection refused"
    clock.advance(59)
    assert d.step_ended(ASK, OWNER)["verdict"] == "wait"
    assert probes.asked == []


def test_a_requeued_job_is_released_only_after_the_checkpoint_service_had_its_say(
        tmp_path: Path) -> None:
    """The checkpoint service announces this node's newest step of the job in S3 while the
    job is still held (uploader/announce.py): after the exclusion, before the release."""
    d, slurm, _ = desk(tmp_path, {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING"}, spares=[])
    d.before_requeue = lambda job_id: slurm.calls.append(["announce", str(job_id)])
    assert d.step_ended(ASK, OWNER)["verdict"] == "requeue"
    acts = [" ".join(c) if c[0] == "announce" else c[1] if c[1] != "update"
            else c[3].split("=")[0] for c in slurm.calls
            if c[0] == "announce" or c[1] in ("requeuehold", "release", "update")]
    assert acts == ["requeuehold", "AdminComment", "ExcNodeList", "announce 42", "release"]


def test_without_a_spare_the_job_is_requeued_away_from_the_lost_node(tmp_path: Path) -> None:
    d, slurm, _ = desk(tmp_path, {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING"}, spares=[])
    answer = d.step_ended(ASK, OWNER)
    assert answer["verdict"] == "requeue" and "no usable spare for n2" in str(answer["reason"])
    acts = [c[1] if c[1] != "update" else c[3].split("=")[0] for c in slurm.calls
            if c[1] in ("requeuehold", "release", "update")]
    assert acts == ["requeuehold", "AdminComment", "ExcNodeList", "release"]
    assert ["scontrol", "update", "JobId=42", "ExcNodeList=n2"] in slurm.calls
    assert "[sr-fault n=1 restart=0] node fault on n2" in slurm.comment
    assert d.step_ended(ASK, OWNER) == answer  # acted on once
    assert len([c for c in slurm.calls if c[1] == "requeuehold"]) == 1
    assert counted(tmp_path, "requeue") == 1


# -- the launcher's loop ----------------------------------------------------------------------

class Step:
    def __init__(self, code: int):
        self.code = code

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        return self.code

    def kill(self) -> None:
        self.code = -9


class Agent:
    def __init__(self, answers: list[Mapping[str, object]]):
        self.answers = answers
        self.asked: list[int] = []
        self.registered: list[P.Placement] = []

    def register(self, place: P.Placement, max_restarts: int) -> None:
        self.registered.append(place)

    def poll(self) -> Mapping[str, object] | None:
        return None

    def step_ended(self, status: int) -> Mapping[str, object]:
        self.asked.append(status)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


WAIT = {"verdict": "wait", "wait_s": 60.0, "reason": "", "out": {}, "order": None}
RELAUNCH = {"verdict": "relaunch", "reason": "node fault", "out": {"n2": "down"},
            "order": {"relaunch": 1, "nodes": ["n1", "n3"], "reason": "node fault"}}


def test_the_launcher_asks_again_soon_then_once_a_second_and_relaunches_on_the_order(
        capsys: pytest.CaptureFixture[str]) -> None:
    steps = [Step(1), Step(0)]
    agent = Agent([WAIT, WAIT, WAIT, WAIT, RELAUNCH, {"verdict": "exit"}])
    clock = FakeClock()
    launcher = Launcher(P.allocation(ENV), ["t"], Settings(1, 3), agent,
                        lambda argv, env: steps.pop(0), lambda r: None, {}, clock=clock)
    assert launcher.run() == 0
    assert agent.asked == [1] * 5 and clock.slept == [0.25, 0.5, 1.0, 1.0]
    assert [p.nodes for p in agent.registered] == [("n1", "n2"), ("n1", "n3")]
    assert "slurm-resilience launch: node n2 lost: relaunch 1 on n1 n3" in capsys.readouterr().err


def test_the_launcher_ends_with_sruns_status_past_the_wait_or_when_told() -> None:
    clock = FakeClock()

    class Shrinking(Agent):
        """Says wait for what is left of 60 s, and keeps saying it (an agent gone wrong)."""

        def step_ended(self, status: int) -> Mapping[str, object]:
            return {**WAIT, "wait_s": max(0.0, 60.0 - clock.monotonic())}

    launcher = Launcher(P.allocation(ENV), ["t"], Settings(1, 3), Shrinking([]),
                        lambda argv, env: Step(3), lambda r: None, {}, clock=clock)
    assert launcher.run() == 3
    assert 60 <= sum(clock.slept) <= 60 + WAIT_GRACE_S + 1  # the wait plus the grace
    stuck = FakeClock()
    forever = Launcher(P.allocation(ENV), ["t"], Settings(1, 3), Agent([WAIT]),
                       lambda argv, env: Step(3), lambda r: None, {}, clock=stuck)
    assert forever.run() == 3 and MAX_LOSS_WAIT_S <= sum(stuck.slept) < MAX_LOSS_WAIT_S + 1
    told = Launcher(P.allocation(ENV), ["t"], Settings(1, 3),
                    Agent([{"verdict": "exit", "reason": "left alone"}]),
                    lambda argv, env: Step(3), lambda r: None, {}, clock=FakeClock())
    assert told.run() == 3
    ok = Agent([RELAUNCH])
    fine = Launcher(P.allocation(ENV), ["t"], Settings(1, 3), ok, lambda argv, env: Step(0),
                    lambda r: None, {}, clock=FakeClock())
    assert fine.run() == 0 and ok.asked == []  # a step that ended well is never asked about


# -- a job that lost its batch host (--no-kill) ------------------------------------------------

def _view(job_id: int, nodes: tuple[str, ...]) -> JobView:
    rec = JobRecord(job_id, 1001, 1001, "u", 0.0, nodes)
    return JobView(rec, [], JobVerdict(job_id, "act", ()))


class Orphaned(SlurmState):
    """Job 42 kept running on n2 after Slurm removed its batch host n1 (DOWN)."""

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        done = super().run(argv, timeout=timeout, check=check, input_text=input_text, env=env)
        return replace(done, stdout=done.stdout.replace("NodeList=n[1-3] NumNodes=3",
                                                        "NodeList=n2 NumNodes=1"))


def test_a_job_that_lost_its_batch_host_is_requeued_by_its_first_survivor(
        tmp_path: Path) -> None:
    slurm = Orphaned({"n1": "DOWN+NOT_RESPONDING"})
    adapter = SlurmAdapter(runner=slurm)
    adapter.events_path = str(tmp_path / events.FILENAME)
    views = [_view(42, ("n1", "n2")), _view(7, ("n2", "n3"))]  # n2 is job 7's batch host
    assert orphans.quiet_jobs(views, "n2") == {42: "n1"}
    done = orphans.check(Config(), adapter, "n2", views)
    assert len(done) == 1 and "without its batch host n1" in done[0], done
    assert [c[1] for c in slurm.calls if c[1] in ("requeuehold", "release")] == [
        "requeuehold", "release"]
    assert ["scontrol", "update", "JobId=42", "ExcNodeList=n1"] in slurm.calls
    assert counted(tmp_path, "requeue") == 1
    # n3 is not the first survivor; a host that is only not responding is not lost yet.
    assert orphans.check(Config(), SlurmAdapter(runner=Orphaned({"n1": "DOWN"})), "n3",
                         [_view(42, ("n1", "n3"))]) == []
    calm = Orphaned({"n1": "MIXED+NOT_RESPONDING"})
    assert orphans.check(Config(), SlurmAdapter(runner=calm), "n2", views) == []
    assert not [c for c in calm.calls if c[1:3] == ["show", "job"]]


# -- ranks that died while srun still waits for a lost node's tasks -----------------------------

def test_ranks_that_died_while_the_step_runs_get_an_order_once_a_node_is_unreachable(
        tmp_path: Path) -> None:
    """srun waits for a dead node's tasks until Slurm marks the node, so the launcher would
    not ask before SlurmdTimeout. The batch host's ranks died: its agent probes the step's
    nodes at each poll and orders the relaunch once one stayed unreachable long enough;
    the launcher's later step_ended gets the same answer, acted on once."""
    d, slurm, clock, probes = probed_desk(tmp_path, {"n1": "MIXED", "n2": "MIXED",
                                                     "n3": "IDLE"})
    d.ranks_died(42)  # everything answers: nothing to do
    assert d.launches.poll({"job_id": 42}, OWNER)["order"] is None
    probes.down["n2"] = "connection refused"
    d.ranks_died(42)  # polled again within the second: no new round
    assert len(probes.asked) == 1
    clock.advance(1)
    d.ranks_died(42)
    clock.advance(4)
    d.ranks_died(42)
    assert d.launches.poll({"job_id": 42}, OWNER)["order"] is None
    clock.advance(1)
    d.ranks_died(42)
    order = d.launches.poll({"job_id": 42}, OWNER)["order"]
    assert order is not None and order["nodes"] == ["n1", "n3"] and order["gone"] == ["n2"]
    shows = [c for c in slurm.calls if c[1:3] == ["show", "node"]]
    assert len(shows) == 2  # where the nodes listen (once), then the decision's fresh view
    d.ranks_died(42)  # decided: never again
    assert d.step_ended(ASK, OWNER)["order"] == order
    assert counted(tmp_path, "relaunch") == 1


def test_ranks_that_died_ask_nothing_with_node_unreachable_s_0(tmp_path: Path) -> None:
    d, slurm, clock, probes = probed_desk(tmp_path, {"n1": "MIXED", "n2": "MIXED",
                                                     "n3": "IDLE"}, unreachable_s=0)
    probes.down["n2"] = "connection refused"
    for _ in range(10):
        clock.advance(1)
        d.ranks_died(42)
    assert probes.asked == [] and slurm.calls == []


def test_a_step_with_a_gone_node_gets_a_short_grace_then_srun_is_killed() -> None:
    """After an order naming a gone node, srun (waiting for that node's tasks) gets
    gone_grace_s, not end_timeout_s, before it is killed; a step whose nodes are all up gets
    the long wait."""
    waits: list[float | None] = []

    class Stuck(Step):
        def poll(self) -> int | None:
            return None if self.code != -9 else self.code

        def wait(self, timeout: float | None = None) -> int:
            waits.append(timeout)
            if self.code != -9 and timeout is not None:
                raise subprocess.TimeoutExpired("srun", timeout)
            return self.code

    for gone, expected in ((True, 0.5), (False, 60.0)):
        waits.clear()
        launcher = Launcher(P.allocation(ENV), ["t"], Settings(1, 3), Agent([WAIT]),
                            lambda argv, env: Stuck(1), lambda r: None, {}, clock=FakeClock())
        step = Stuck(1)
        launcher._end(step, gone=gone)
        assert waits[0] == expected and step.code == -9


def test_slurms_late_answer_about_a_step_already_ended_is_no_warning(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The signal of a step with a gone node is asked aside; when scancel's answer comes
    after srun was killed at the end of the grace, the launcher says so and kills nothing.
    While srun still runs, a failed scancel is a warning and srun is killed."""
    def timed_out(relaunch: int) -> None:
        raise RuntimeError("scancel: timed out after 10s")

    launcher = Launcher(P.allocation(ENV), ["t"], Settings(1, 3), Agent([WAIT]),
                        lambda argv, env: Step(0), timed_out, {}, clock=FakeClock())
    ended = Step(-9)
    launcher._signal(ended, 2)
    err = capsys.readouterr().err
    assert "Slurm's answer to signalling relaunch 2's step came late (scancel: timed out " \
           "after 10s); the step had already ended" in err and "WARNING" not in err

    class Running(Step):
        def poll(self) -> int | None:
            return None if self.code != -9 else self.code

    running = Running(0)
    launcher._signal(running, 2)
    assert "WARNING: couldn't signal the step through Slurm" in capsys.readouterr().err
    assert running.code == -9


def test_ranks_died_means_all_ended_and_one_died() -> None:
    detect = JobVerdict(1, "act", (RankState(0, "dead", 1, "step", 0, 1),
                                   RankState(1, "done", 1, "step", 0, 1)))
    assert detect.ranks_died
    assert not replace(detect, ranks=(RankState(0, "done", 1, "step", 0, 1),)).ranks_died
    assert not replace(detect, ranks=(RankState(0, "dead", 1, "step", 0, 1),
                                      RankState(1, "ok", 1, "step", 0, 1))).ranks_died
