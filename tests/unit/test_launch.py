"""slurm-resilience launch: placement and srun line (pure), the agent's launcher registry
(credentials, bounds, orders), the relaunch decision (pure), the launcher's loop with a
fake agent and fake steps, attempts, and the restore agreement of a spare that joined."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence

import pytest

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint.agree import RankView, agree
from slurm_resilience.hang import policy
from slurm_resilience.hang import relaunch as RL
from slurm_resilience.hang.actions import StepKind, run_step
from slurm_resilience.hang.incidentrecords import Action, Decision, NodeCall, NodeVerdict
from slurm_resilience.hang.launches import STALE_S, Launch, Launches, Order
from slurm_resilience.heartbeat import attempt as A
from slurm_resilience.launch import plan as P
from slurm_resilience.launch.returning import Returning, Seen, seen
from slurm_resilience.launch.supervise import Launcher, Settings
from slurm_resilience.testing import FakeClock

ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1",
       "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_RESTART_COUNT": "1"}
OWNER = Peer(pid=10, uid=1001, gid=1001)
OTHER = Peer(pid=11, uid=1002, gid=1002)


# -- attempts ---------------------------------------------------------------------------------

def test_attempt_keeps_plain_restarts_and_tells_relaunches_apart() -> None:
    assert A.attempt(2) == 2 and A.attempt(0, 1) == 1000 and A.attempt(1, 2) == 2001
    assert A.restarts_of(2001) == 1 and A.relaunch_of(2001) == 2
    assert A.from_env({"SLURM_RESTART_COUNT": "1", A.ENV_RELAUNCH: "2"}) == 2001
    assert A.from_env({"SLURM_RESTART_COUNT": "x", A.ENV_RELAUNCH: "-1"}) == 0
    with pytest.raises(ValueError):
        A.attempt(0, A.MAX_RELAUNCHES + 1)


# -- placement --------------------------------------------------------------------------------

def test_spares_are_the_last_nodes_but_never_the_batch_host() -> None:
    alloc = P.allocation(ENV)
    assert (alloc.job_id, alloc.nodes, alloc.tasks_per_node, alloc.restarts) == (
        42, ("n1", "n2", "n3"), 2, 1)
    assert P.first(alloc, 1) == P.Placement(0, ("n1", "n2"), ("n3",))
    on_last = P.allocation({**ENV, "SLURMD_NODENAME": "n3"})
    assert P.first(on_last, 1) == P.Placement(0, ("n1", "n3"), ("n2",))
    with pytest.raises(P.PlanError, match="leaves no node"):
        P.first(alloc, 3)


def test_uneven_tasks_per_node_is_refused() -> None:
    with pytest.raises(P.PlanError, match="differ"):
        P.tasks_per_node({"SLURM_TASKS_PER_NODE": "2,1(x2)"})
    assert P.tasks_per_node({"SLURM_NTASKS_PER_NODE": "4"}) == 4


def test_order_moves_a_spare_into_the_step_and_the_line_keeps_tasks_per_node() -> None:
    alloc = P.allocation(ENV)
    place = P.after(P.first(alloc, 1), 1, ["n1", "n3"])
    assert place == P.Placement(1, ("n1", "n3"), (), ("n3",))
    argv = P.srun_argv("srun", alloc, place, ["python", "train.py"])
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                        "--nodelist=n1,n3", "--kill-on-bad-exit=1"]
    assert argv[-3:] == ["--", "python", "train.py"]
    # A relaunch overlaps a step that lost a node (slurmctld keeps it until the job ends).
    assert "--overlap" in argv and "--overlap" not in P.srun_argv(
        "srun", alloc, P.first(alloc, 1), ["python"])
    env = P.step_env({"SLURM_NTASKS": "6"}, alloc, place)
    assert env[A.ENV_RELAUNCH] == "1" and env[A.ENV_RESTART_COUNT] == "2"
    assert env[A.ENV_JOINED] == "n3" and "SLURM_NTASKS" not in env
    with pytest.raises(P.PlanError):
        P.after(place, 2, ["n1", "n2"])  # n2 is neither in the step nor a spare


# -- the agent's registry ---------------------------------------------------------------------

def _register(reg: Launches, peer: Peer = OWNER, owner: int | None = 1001,
              **over: object) -> Mapping[str, object]:
    request = {"job_id": 42, "relaunch": 0, "nodes": ["n1", "n2"], "spares": ["n3"],
               "max_restarts": 3, **over}
    return reg.register(request, peer, owner)


def test_only_the_jobs_owner_registers_and_polls() -> None:
    clock = FakeClock()
    reg = Launches(clock)
    for peer, owner in ((OTHER, 1001), (OWNER, None)):
        with pytest.raises(RequestError, match="no job 42 of uid"):
            _register(reg, peer, owner)
    _register(reg)
    with pytest.raises(RequestError, match="no launcher of job 42 for uid 1002"):
        reg.poll({"job_id": 42}, OTHER)
    assert reg.poll({"job_id": 42}, OWNER) == {"order": None}
    assert reg.poll({"job_id": 42}, Peer(1, 0, 0)) == {"order": None}  # root


@pytest.mark.parametrize("over,why", [
    ({"nodes": ["n1", "../x"]}, "not a node name"),
    ({"nodes": ["n1", "n1"]}, "twice"),
    ({"nodes": [f"n{i}" for i in range(5000)]}, "at most"),
    ({"spares": ["n2"]}, "apart from spares"),
    ({"relaunch": -1}, "non-negative"),
])
def test_registrations_are_checked(over: dict[str, object], why: str) -> None:
    with pytest.raises(RequestError, match=why):
        _register(Launches(), **over)


def test_an_order_waits_for_a_live_launcher_and_ends_when_it_relaunches() -> None:
    clock = FakeClock()
    reg = Launches(clock)
    _register(reg)
    order = Order(1, ("n1", "n3"), ("n3",), ("n2",), "why")
    assert not reg.give(42, Order(2, ("n1",), (), (), "skips one"))
    assert reg.give(42, order) and reg.give(42, order)  # a resumed plan gives it again
    assert reg.poll({"job_id": 42}, OWNER)["order"] == order.to_json()
    _register(reg, relaunch=1, nodes=["n1", "n3"], spares=[])
    assert reg.poll({"job_id": 42}, OWNER) == {"order": None}
    with pytest.raises(RequestError, match="is at relaunch 1"):
        _register(reg, relaunch=0)
    clock.advance(STALE_S + 1)
    assert reg.live(42) is None and not reg.give(42, Order(2, ("n1",), (), (), ""))
    reg.forget(set())
    assert reg.jobs == {}


# -- the decision -----------------------------------------------------------------------------

def _launch(**over: object) -> Launch:
    base = Launch(42, 1001, 10, 0, ("n1", "n2"), ("n3", "n4"), 3, 0.0)
    return Launch(**{**base.__dict__, **over})  # type: ignore[arg-type]


REQUEUE = Decision(Action.REQUEUE, "hang job 42: requeue 1 of 3", "[sr-hang n=1 ckpt=10 "
                   "restart=0]", 10, (NodeCall("n2", NodeVerdict.SUSPECT, "suspect ..."),),
                   ("n2",))


def test_a_suspect_is_replaced_by_a_spare_that_passes_the_gate() -> None:
    decision, order = RL.choose(REQUEUE, _launch(), job_nodes=("n1", "n2", "n3", "n4"),
                                unusable={"n3": "drained (SR: health ...)"}, run=0,
                                admin_comment="")
    assert decision.action is Action.RELAUNCH and decision.exclude == ()
    assert order == Order(1, ("n1", "n4"), ("n4",), ("n2",), decision.reason)
    assert "n4 for n2" in decision.reason and "spare n3 not used: drained" in decision.reason
    assert decision.ledger == "[sr-hang n=0 ckpt=10 restart=0]"  # not a requeue
    steps = policy.plan(42, decision, "", drain=True, relaunch=RL.order_step(order))
    # The relaunch before its comment: Slurm may refuse to update the job (actions.py).
    assert [s.kind for s in steps] == [StepKind.DRAIN, StepKind.RECORD, StepKind.RELAUNCH,
                                       StepKind.COMMENT]
    assert RL.order_of(steps[-2]) == order


def test_requeue_stays_without_a_usable_spare_or_restarts_left() -> None:
    for launch, unusable, why in (
            (_launch(spares=("n3",)), {"n3": "down"}, "no usable spare for n2 (spare n3 not "
                                                      "used: down)"),
            (_launch(spares=("n9",)), {}, "no usable spare for n2"),  # not in the job
            (_launch(relaunch=3), {}, "--max-restarts 3 is spent")):
        decision, order = RL.choose(REQUEUE, launch, job_nodes=("n1", "n2", "n3", "n4"),
                                    unusable=unusable, run=0, admin_comment="")
        assert order is None and decision.action is Action.REQUEUE
        assert why in decision.reason


def test_a_hang_nobody_is_blamed_for_relaunches_on_the_same_nodes() -> None:
    nobody = Decision(Action.REQUEUE, "hang job 42: requeue 1 of 3", "", 10)
    decision, order = RL.choose(nobody, _launch(relaunch=1), job_nodes=("n1", "n2", "n3"),
                                unusable={}, run=1000, admin_comment="[sr-hang n=1 ckpt=5 "
                                                                     "restart=0]")
    assert order is not None and order.nodes == ("n1", "n2") and order.joined == ()
    assert decision.ledger == "[sr-hang n=1 ckpt=10 restart=1000]"
    held = Decision(Action.HOLD, "held", "", 10)
    assert RL.choose(held, _launch(), job_nodes=("n1",), unusable={}, run=0,
                     admin_comment="") == (held, None)


def test_gate_reason() -> None:
    assert RL.gate_reason(True, False, "MIXED+DRAIN", "SR: x") == "mixed+drain (SR: x)"
    assert RL.gate_reason(False, False, "ALLOCATED", "") == ""
    assert RL.gate_reason(False, False, "FAIL", "") == "fail"


def test_relaunch_step_needs_the_registry() -> None:
    step = RL.order_step(Order(1, ("n1",), (), (), "r"))
    with pytest.raises(ValueError, match="registry"):
        run_step(None, 42, 0, step)  # type: ignore[arg-type]
    assert run_step(None, 42, 0, step, relaunch=lambda s: f"gave {s.target}") == "gave 1"  # type: ignore[arg-type]


# -- the launcher's loop ----------------------------------------------------------------------

class FakeStep:
    def __init__(self, code: int | None = None):
        self.code = code
        self.killed = False

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            raise subprocess.TimeoutExpired("srun", timeout or 0)
        return self.code

    def kill(self) -> None:
        self.code = -9


class FakeAgent:
    def __init__(self, orders: list[Mapping[str, object] | None]):
        self.orders = orders
        self.registered: list[P.Placement] = []

    def register(self, place: P.Placement, max_restarts: int) -> None:
        self.registered.append(place)

    def poll(self) -> Mapping[str, object] | None:
        return self.orders.pop(0) if self.orders else None

    def step_ended(self, status: int) -> Mapping[str, object]:
        return {"verdict": "exit", "reason": f"status {status}: no node of the step is out"}


def test_launcher_ends_the_step_on_an_order_and_relaunches_on_the_spare() -> None:
    first, second = FakeStep(), FakeStep(0)
    steps = [first, second]
    started: list[tuple[list[str], dict[str, str]]] = []
    ended: list[int] = []
    agent = FakeAgent([None, {"relaunch": 1, "nodes": ["n1", "n3"], "reason": "hang"}])

    def start(argv: list[str], env: dict[str, str]) -> FakeStep:
        started.append((argv, env))
        return steps.pop(0)

    def end_step(relaunch: int) -> None:
        ended.append(relaunch)
        first.code = -9

    launcher = Launcher(P.allocation(ENV), ["python", "t.py"], Settings(1, 3, poll_s=0.01),
                        agent, start, end_step, {})
    assert launcher.run() == 0
    assert ended == [0] and [p.nodes for p in agent.registered] == [("n1", "n2"), ("n1", "n3")]
    assert "--nodelist=n1,n3" in started[1][0] and started[1][1][A.ENV_JOINED] == "n3"


def test_launcher_returns_the_steps_status_without_an_order() -> None:
    launcher = Launcher(P.allocation(ENV), ["false"], Settings(0, 3), FakeAgent([]),
                        lambda argv, env: FakeStep(3), lambda r: None, {})
    assert launcher.run() == 3


def test_launcher_refuses_an_order_that_is_not_the_next_relaunch() -> None:
    launcher = Launcher(P.allocation(ENV), ["x"], Settings(1, 3),
                        FakeAgent([{"relaunch": 5, "nodes": ["n1"]}]),
                        lambda argv, env: FakeStep(None), lambda r: None, {})
    launcher.settings = Settings(1, 3, end_timeout_s=0.01)
    with pytest.raises(P.PlanError, match="not the next relaunch"):
        launcher.run()


def test_a_node_taken_out_is_a_spare_again_once_slurm_had_it_out_and_shows_it_back() -> None:
    w = Returning()
    w.add(["n2", "n4", "n5"])
    # n2 not yet marked (lost moments ago), n4 only avoided, n5 drained: none comes back.
    assert w.update({"n2": Seen.IN_SERVICE, "n4": Seen.IN_SERVICE, "n5": Seen.OUT}) == ([], [])
    assert w.update({"n2": Seen.OUT, "n4": Seen.IN_SERVICE}) == ([], [])
    # n5 resumed, n2 still out; Slurm didn't show n4 this time: it waits as it was.
    assert w.update({"n2": Seen.OUT, "n5": Seen.IN_SERVICE}) == (["n5"], [])
    assert w.update({"n2": Seen.LEFT_JOB}) == ([], ["n2"])
    assert w.waiting == {"n4": False}
    assert seen(True, False, "IDLE", True) is Seen.OUT
    assert seen(False, True, "ALLOCATED", True) is Seen.OUT
    assert seen(False, False, "FAIL", True) is Seen.OUT
    assert seen(False, False, "ALLOCATED", True) is Seen.IN_SERVICE
    assert seen(False, False, "IDLE", False) is Seen.LEFT_JOB
    place = P.Placement(1, ("n1", "n3"), ("n6",), ("n3",))
    assert P.with_spares(place, ["n2", "n3", "n6", "n2"]) == P.Placement(
        1, ("n1", "n3"), ("n6", "n2"), ("n3",))


class TickingStep(FakeStep):
    """A step running for ``looks`` waits of ``seconds`` each on ``clock``, then done."""

    def __init__(self, clock: FakeClock, looks: int, seconds: float):
        super().__init__(None)
        self.clock, self.left, self.seconds = clock, looks, seconds

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            self.clock.sleep(self.seconds)
            self.left -= 1
            if self.left <= 0:
                self.code = 0
            raise subprocess.TimeoutExpired("srun", timeout or 0)
        return self.code


def test_launcher_has_a_node_it_took_out_as_a_spare_once_slurm_shows_it_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    """n2 leaves the step for the spare n3. Slurm shows it in service at first (not yet
    marked), then out, then in service again: only then is it a spare, and the agent is
    told. Slurm is asked every return_poll_s (30 s) of the step's time, and not once
    nothing waits."""
    clock = FakeClock()
    first = FakeStep()
    steps = [first, TickingStep(clock, looks=12, seconds=10.0)]
    agent = FakeAgent([None, {"relaunch": 1, "nodes": ["n1", "n3"], "reason": "hang"}])
    shown = [{"n2": Seen.IN_SERVICE}, {"n2": Seen.OUT}, {"n2": Seen.IN_SERVICE}]
    asked: list[tuple[float, list[str]]] = []

    def nodes_seen(names: Sequence[str]) -> dict[str, Seen]:
        asked.append((clock.monotonic(), list(names)))
        return shown.pop(0)

    def end_step(relaunch: int) -> None:
        first.code = -9

    launcher = Launcher(P.allocation(ENV), ["python", "t.py"], Settings(1, 3, poll_s=0.01),
                        agent, lambda argv, env: steps.pop(0), end_step, {}, clock=clock,
                        nodes_seen=nodes_seen, run_aside=lambda fn: fn())
    assert launcher.run() == 0
    assert [t for t, _ in asked] == [0.0, 30.0, 60.0] and asked[0][1] == ["n2"]
    assert agent.registered[-1] == P.Placement(1, ("n1", "n3"), ("n2",), ("n3",))
    assert len(agent.registered) == 3  # relaunch 0, relaunch 1, then n2 back
    assert "n2 back in service: a spare again (spares n2)" in capsys.readouterr().err


def test_after_an_order_the_launcher_looks_at_slurm_at_once() -> None:
    """A suspect can be verified and back in service within seconds of its drain: the look
    after an order comes at once, not return_poll_s after the last one, so that it sees the
    node out of service (a node never seen out would stay out of the step for good)."""
    clock = FakeClock()
    first = FakeStep()
    second = TickingStep(clock, looks=100, seconds=10.0)
    steps = [first, second, TickingStep(clock, looks=1, seconds=10.0)]
    agent = FakeAgent([None, {"relaunch": 1, "nodes": ["n1", "n3"], "reason": "hang"},
                       None, {"relaunch": 2, "nodes": ["n1", "n3"], "reason": "hang"}])
    asked: list[tuple[float, list[str]]] = []

    def nodes_seen(names: Sequence[str]) -> dict[str, Seen]:
        asked.append((clock.monotonic(), list(names)))
        return {n: Seen.OUT for n in names}

    def end_step(relaunch: int) -> None:
        (first if relaunch == 0 else second).code = -9

    launcher = Launcher(P.allocation(ENV), ["python", "t.py"], Settings(1, 3, poll_s=0.01),
                        agent, lambda argv, env: steps.pop(0), end_step, {}, clock=clock,
                        nodes_seen=nodes_seen, run_aside=lambda fn: fn())
    assert launcher.run() == 0
    assert asked == [(0.0, ["n2"]), (10.0, ["n2"])]


def test_the_launcher_keeps_polling_its_agent_while_slurm_is_slow_to_answer() -> None:
    """Slurm is asked aside: while its answer is pending the loop polls its agent as
    always (what keeps the launcher live and lets the agent find a lost node), and starts
    no second look; the answer is acted on when it comes."""
    clock = FakeClock()
    first = FakeStep()
    steps = [first, TickingStep(clock, looks=12, seconds=10.0)]
    agent = FakeAgent([None, {"relaunch": 1, "nodes": ["n1", "n3"], "reason": "hang"}])
    pending: list[Callable[[], None]] = []
    polls: list[float] = []
    answers = iter([{"n2": Seen.OUT}, {"n2": Seen.IN_SERVICE}])
    real_poll = agent.poll

    def poll() -> Mapping[str, object] | None:
        polls.append(clock.monotonic())
        if len(polls) == 8:  # Slurm answers the first look only now (at 60 s)
            pending.pop(0)()
        return real_poll()

    def end_step(relaunch: int) -> None:
        first.code = -9

    agent.poll = poll  # type: ignore[method-assign]
    launcher = Launcher(P.allocation(ENV), ["python", "t.py"], Settings(1, 3, poll_s=0.01),
                        agent, lambda argv, env: steps.pop(0), end_step, {}, clock=clock,
                        nodes_seen=lambda names: next(answers), run_aside=pending.append)
    assert launcher.run() == 0
    assert len(polls) >= 13  # every 10 s of the step, the answer pending or not
    assert len(pending) == 1  # the second look, started once the first was acted on
    assert agent.registered[-1].spares == ()  # its answer never came: n2 is not back


# -- the restore of a spare that joined --------------------------------------------------------

def test_a_spare_that_joined_fetches_the_step_the_survivors_committed() -> None:
    survivor = RankView(0, "n1", 10, False, (5, 10))
    spare = RankView(1, "n3", -1, False, (), joined=True)
    got = agree([survivor, spare])
    assert (got.step, got.fetch) == (10, ("n3",)) and "joined the step" in got.warning
    # Without the relaunch mark it is the old rule: no step is committed on every node.
    assert agree([survivor, RankView(1, "n3", -1, False, ())]).step is None
