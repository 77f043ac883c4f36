"""The launcher's loop: start the step with srun, ask the node agent for an order four times
a second (a local socket; the agent answers from memory), and when an incident of this job
was decided as a relaunch, end the step (bounded) and start it again on the nodes the order
names, inside the same allocation.

The agent on the batch host is the only one that decides (the launcher never judges a hang
itself): it takes the bad node out as it would for a requeue (drained on evidence, or a
suspect verified and returned), and hands the launcher an order instead of requeueing the
job. Without a usable spare, with ``--max-restarts`` spent, or when this launcher stops
polling (its batch host lost), the agent requeues the job as it does for any job.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.launch import plan as P
from slurm_resilience.launch.returning import Returning, Seen


class Agent(Protocol):
    """The batch host's agent as the launcher uses it (``launch.register``, ``launch.poll``,
    ``launch.step_ended``)."""

    def register(self, place: P.Placement, max_restarts: int) -> None: ...

    def poll(self) -> Mapping[str, object] | None: ...

    def step_ended(self, status: int) -> Mapping[str, object]: ...


class Step(Protocol):
    """A running srun (subprocess.Popen's methods the loop uses)."""

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class Settings:
    spares: int
    max_restarts: int
    # Each poll is a call to the local agent, answered from memory: a decided incident waits
    # half of this on average before its relaunch starts.
    poll_s: float = 0.25
    end_timeout_s: float = 60.0  # from the order to the old step gone
    # The same when a node of the step is gone (see _end): srun then waits for that node's
    # tasks until Slurm marks it, so any wait here is lost time.
    gone_grace_s: float = 0.5
    # A failed step's question to the agent (two Slurm reads each): again after 0.25 s, then
    # doubling up to this; most node faults are decided in the first seconds (a drain by
    # the node's own gate, a node unreachable for 5 s), Slurm's own mark takes minutes.
    loss_poll_s: float = 1.0
    # How often Slurm is asked about nodes a relaunch took out, while any waits to be a
    # spare again (returning.py): one ``scontrol show node`` of them per look.
    return_poll_s: float = 30.0


# A launcher past the wait the agent announced ends anyway (an agent that keeps saying wait).
WAIT_GRACE_S = 30.0
FIRST_LOSS_POLL_S = 0.25
MAX_LOSS_WAIT_S = 1800.0


def say(message: str) -> None:
    print(f"slurm-resilience launch: {message}", file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, alloc: P.Allocation, command: Sequence[str], settings: Settings,
                 agent: Agent, start: Callable[[list[str], dict[str, str]], Step],
                 end_step: Callable[[int], None], env: Mapping[str, str], srun: str = "srun",
                 clock: Clock = SystemClock(),
                 nodes_seen: Callable[[Sequence[str]], Mapping[str, Seen]] | None = None,
                 run_aside: Callable[[Callable[[], None]], None] | None = None):
        self.alloc = alloc
        self.command = list(command)
        self.settings = settings
        self.agent = agent
        self.start = start
        self.end_step = end_step
        self.env = env
        self.srun = srun
        self.clock = clock
        self.place = P.first(alloc, settings.spares)
        self.agent_ok = True
        # Nodes taken out, until Slurm shows them back in service (None: never asked).
        self.nodes_seen = nodes_seen
        self.returning = Returning()
        self.next_look = 0.0
        self.look_failed = False
        self.looking = False
        self.looked: queue.SimpleQueue[Mapping[str, Seen] | Exception] = queue.SimpleQueue()
        self.run_aside = run_aside or _on_a_thread

    def _register(self) -> None:
        try:
            self.agent.register(self.place, self.settings.max_restarts)
            self.agent_ok = True
        except Exception as exc:  # noqa: BLE001 - the step runs on; said, not hidden
            if self.agent_ok:
                say(f"WARNING: couldn't register with the node agent ({exc}): an incident "
                    "of this job takes the requeue path until it answers")
            self.agent_ok = False

    def _poll(self) -> Mapping[str, object] | None:
        try:
            order = self.agent.poll()
        except Exception as exc:  # noqa: BLE001 - agent restarted: register again
            if self.agent_ok:
                say(f"WARNING: the node agent didn't answer ({exc}); registering again")
            self._register()
            return None
        return order

    def run(self) -> int:
        """Run until the step ends without an order; its exit status."""
        while True:
            argv = P.srun_argv(self.srun, self.alloc, self.place, self.command)
            say(f"relaunch {self.place.relaunch}: {' '.join(self.place.nodes)}"
                + (f" (spares {' '.join(self.place.spares)})" if self.place.spares else "")
                + f" at={self.clock.time():.3f}")
            self._register()
            step = self.start(argv, P.step_env(self.env, self.alloc, self.place))
            order = self._supervise(step)
            if order is not None:
                _say_gone(order)
            else:
                code = step.wait()
                order = self._poll()  # a decision that raced the step's end
                if order is not None:
                    _say_gone(order)
                elif code != 0:
                    order = self._node_lost(code)
                if order is None:
                    return code
            say(f"order for relaunch {order.get('relaunch')} at={self.clock.time():.3f}")
            self._end(step, gone=bool(order.get("gone")))
            say(f"step of relaunch {self.place.relaunch} ended at={self.clock.time():.3f}")
            self._follow(order)

    def _supervise(self, step: Step) -> Mapping[str, object] | None:
        while step.poll() is None:
            order = self._poll()
            if order is not None:
                return order
            self._look_for_returns()
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.wait(timeout=self.settings.poll_s)
        return None

    def _node_lost(self, code: int) -> Mapping[str, object] | None:
        """The step failed: ask the agent whether Slurm shows a node of it lost, again and
        again (0.25 s, then doubling to ``loss_poll_s``) while it says to wait (Slurm marks a
        dead node only after SlurmdTimeout).
        A relaunch order, or None: end with srun's status (after a requeue Slurm ends this
        script; waited for up to ``end_timeout_s``)."""
        started = self.clock.monotonic()
        deadline: float | None = None
        pause = FIRST_LOSS_POLL_S
        while True:
            try:
                answer = self.agent.step_ended(code)
            except Exception as exc:  # noqa: BLE001 - said; the job ends as without us
                say(f"WARNING: the node agent didn't answer about the step's end ({exc}); "
                    "ending with srun's status")
                return None
            verdict, reason = answer.get("verdict"), str(answer.get("reason", ""))
            out = answer.get("out")
            lost = ",".join(str(n) for n in out) if isinstance(out, dict) else ""
            order = answer.get("order")
            if verdict == "relaunch" and isinstance(order, dict):
                nodes = order.get("nodes")
                say(f"node {lost} lost: relaunch {order.get('relaunch')} on "
                    f"{' '.join(str(n) for n in nodes) if isinstance(nodes, list) else '?'}")
                return order
            if verdict == "wait":
                wait_s = answer.get("wait_s")
                left = float(wait_s) if isinstance(wait_s, (int, float)) else 0.0
                now = self.clock.monotonic()
                if deadline is None:
                    say(f"step ended with status {code} at={self.clock.time():.3f}; asking "
                        f"the node agent whether a node of it was lost (up to {left:.0f}s)")
                    deadline = now + left + WAIT_GRACE_S
                elif left > 0:
                    # The agent's own wait shrinks as it goes; a longer one (Slurm
                    # unreadable at first) moves ours.
                    deadline = max(deadline, now + left + WAIT_GRACE_S)
                deadline = min(deadline, started + MAX_LOSS_WAIT_S)
                if now < deadline:
                    pause = min(pause, self.settings.loss_poll_s)
                    self.clock.sleep(pause)
                    pause *= 2
                    continue
                say(f"the node agent kept waiting past {left:.0f}s; ending with srun's status")
                return None
            if verdict == "requeue":
                say(f"node {lost} lost: {reason}")
                self.clock.sleep(self.settings.end_timeout_s)  # Slurm ends us before
                return None
            say(reason or f"the node agent answered {verdict!r}: ending with srun's status")
            return None

    def _end(self, step: Step, gone: bool = False) -> None:
        """End the old step: its tasks are killed through Slurm, then srun is waited for,
        up to ``end_timeout_s`` (then srun itself is killed). With a node of it ``gone``
        (down or unreachable) srun would wait for that node's tasks until Slurm marks it:
        it gets ``gone_grace_s`` (the relaunch overlaps what is left of the step)."""
        if step.poll() is not None:
            return
        if gone:
            # slurmctld may hold the signal's answer until it gives up on the gone node
            # (over 10 s): the survivors' tasks are signalled on a thread of their own.
            threading.Thread(target=self._signal, args=(step, self.place.relaunch),
                             name="end-step", daemon=True).start()
        else:
            self._signal(step, self.place.relaunch)
        wait_s = self.settings.gone_grace_s if gone else self.settings.end_timeout_s
        try:
            step.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            if gone:
                say(f"the step still waits for its lost node's tasks after {wait_s:g}s; "
                    "killing srun")
            else:
                say(f"WARNING: the step did not end within {wait_s:g}s; killing srun")
            step.kill()
            step.wait()

    def _signal(self, step: Step, relaunch: int) -> None:
        """Kill the step's tasks through Slurm (srun itself, when Slurm can't be asked)."""
        try:
            self.end_step(relaunch)
        except Exception as exc:  # noqa: BLE001 - killing srun still ends it
            if step.poll() is not None:
                # Asked aside after a node was lost: srun was killed after its grace while
                # slurmctld still held the answer. Nothing is left to end.
                say(f"Slurm's answer to signalling relaunch {relaunch}'s step came late "
                    f"({exc}); the step had already ended")
                return
            say(f"WARNING: couldn't signal the step through Slurm ({exc}); killing srun")
            step.kill()

    def _follow(self, order: Mapping[str, object]) -> None:
        relaunch, nodes = order.get("relaunch"), order.get("nodes")
        if not isinstance(relaunch, int) or not isinstance(nodes, list) or \
                relaunch != self.place.relaunch + 1:
            raise P.PlanError(f"the node agent's order is not the next relaunch: {order}")
        before = self.place
        self.place = P.after(self.place, relaunch, [str(n) for n in nodes])
        self.returning.add(n for n in before.nodes if n not in self.place.nodes)
        # Look at once: the agent drained the nodes it took out before its order, and a
        # suspect may be verified and back within seconds (hang/suspect.py); a look that
        # never saw it out of service would keep it out of the step for good.
        self.next_look = 0.0
        say(f"incident: {order.get('reason', '')}")

    def _look_for_returns(self) -> None:
        """Every ``return_poll_s`` while a node taken out waits: the nodes Slurm shows back
        in service become spares again, and the agent is told (see returning.py). Slurm is
        asked aside (``run_aside``): a slow slurmctld must not stop the polls that keep
        this launcher live for its agent and let it find a lost node."""
        if self.nodes_seen is None:
            return
        self._take_look()
        if self.looking or not self.returning.waiting:
            return
        now = self.clock.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + self.settings.return_poll_s
        self.looking = True
        self.run_aside(functools.partial(self._ask_slurm, sorted(self.returning.waiting)))
        self._take_look()  # at once when it ran inline

    def _ask_slurm(self, names: list[str]) -> None:
        assert self.nodes_seen is not None
        try:
            self.looked.put(self.nodes_seen(names))
        except Exception as exc:  # noqa: BLE001 - said by _take_look
            self.looked.put(exc)

    def _take_look(self) -> None:
        """Act on the answer of the look in flight, if it came."""
        try:
            shown = self.looked.get_nowait()
        except queue.Empty:
            return
        self.looking = False
        if isinstance(shown, Exception):
            if not self.look_failed:
                say(f"WARNING: couldn't ask Slurm about the nodes taken out ({shown}); they "
                    "are not spares until it answers")
            self.look_failed = True
            return
        self.look_failed = False
        back, left = self.returning.update(shown)
        for node in left:
            say(f"{node} is no longer in the job's allocation: not a spare any more")
        if back:
            self.place = P.with_spares(self.place, back)
            say(f"{' '.join(back)} back in service: a spare again (spares "
                f"{' '.join(self.place.spares)})")
            self._register()

def _on_a_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="launch-returns", daemon=True).start()


def _say_gone(order: Mapping[str, object]) -> None:
    """The line of a node found lost while srun still waited for its tasks."""
    gone, nodes = order.get("gone"), order.get("nodes")
    if isinstance(gone, list) and gone:
        say(f"node {','.join(str(n) for n in gone)} lost: relaunch {order.get('relaunch')} on "
            f"{' '.join(str(n) for n in nodes) if isinstance(nodes, list) else '?'}")
