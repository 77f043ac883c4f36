"""``slurm-resilience launch [--spares K] [--max-restarts N] -- COMMAND ARGS...``"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from slurm_resilience.heartbeat.attempt import MAX_RELAUNCHES
from slurm_resilience.launch import plan as P
from slurm_resilience.launch import returning
from slurm_resilience.launch.returning import Seen
from slurm_resilience.launch.supervise import Launcher, Settings, say

if TYPE_CHECKING:
    from slurm_resilience.slurm.adapter import SlurmAdapter


def register(sub: Any) -> None:
    p = sub.add_parser("launch", help="run a training step on the allocation less hot spares "
                                      "and relaunch it inside the allocation after an incident")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="nodes of the allocation kept out of the step as hot spares "
                        "(default: 0: relaunch on the same nodes when no node is to blame)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="relaunches inside this allocation; past them an incident requeues "
                        "the job (default: 3)")
    p.add_argument("--poll", type=float, default=0.25, metavar="SECONDS",
                   help="how often to ask this node's agent for an order, over its local "
                        "socket; a decided incident waits half of this on average "
                        "(default: 0.25)")
    p.add_argument("--end-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long the old step may take to end before srun is killed "
                        "(default: 60)")
    p.add_argument("--return-poll", type=float, default=30.0, metavar="SECONDS",
                   help="how often to ask Slurm whether a node an incident took out is back "
                        "in service, to have it as a spare again (default: 30)")
    p.add_argument("--srun", default="srun", help="the srun program (default: srun on PATH)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS",
                   help="what srun runs on every task")
    p.set_defaults(func=run)


class SocketAgent:
    """The batch host's agent over its unix socket."""

    def __init__(self, path: str, job_id: int):
        self.path = path
        self.job_id = job_id
        self.relaunch = 0

    def register(self, place: P.Placement, max_restarts: int) -> None:
        from slurm_resilience.agent.client import call

        call(self.path, "launch.register", job_id=self.job_id, relaunch=place.relaunch,
             nodes=list(place.nodes), spares=list(place.spares), max_restarts=max_restarts)
        self.relaunch = place.relaunch

    def poll(self) -> Mapping[str, object] | None:
        from slurm_resilience.agent.client import call

        order = call(self.path, "launch.poll", job_id=self.job_id).get("order")
        if isinstance(order, dict) and order.get("relaunch") == self.relaunch + 1:
            return order
        return None

    def step_ended(self, status: int) -> Mapping[str, object]:
        from slurm_resilience.agent.client import call

        # Slurm calls on the agent's side: more than a poll's 5 s.
        return call(self.path, "launch.step_ended", timeout=60.0, job_id=self.job_id,
                    relaunch=self.relaunch, status=max(-255, min(255, status)))


def nodes_seen(adapter: SlurmAdapter, job_id: int, names: Sequence[str]) -> dict[str, Seen]:
    """What Slurm shows of ``names`` for the launcher's nodes waiting to be spares again:
    one ``scontrol show node``, and the job's nodes only when one of them is in service."""
    infos = adapter.show_nodes(names)
    in_job = set(adapter.show_job(job_id).nodes) if any(
        returning.seen(i.drained, i.down, i.state, True) is Seen.IN_SERVICE
        for i in infos.values()) else set(names)
    return {n: returning.seen(i.drained, i.down, i.state, n in in_job)
            for n, i in infos.items()}


def run(args: argparse.Namespace) -> int:
    from slurm_resilience import config
    from slurm_resilience.cli import UsageError
    from slurm_resilience.config.paths import node_name, node_path
    from slurm_resilience.slurm.adapter import from_config

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("launch: no command: slurm-resilience launch [--spares K] -- "
                         "COMMAND ARGS...")
    if not 0 <= args.max_restarts <= MAX_RELAUNCHES:
        raise UsageError(f"launch: --max-restarts must be 0..{MAX_RELAUNCHES}")
    env = dict(os.environ)
    try:
        alloc = P.allocation(env)
        P.first(alloc, args.spares)
    except P.PlanError as exc:
        raise UsageError(f"launch: {exc}") from None
    cfg = config.load(args.config or config.job_config_path(env))
    socket_path = node_path(cfg.agent.socket, node_name(cfg.node.name, env))
    adapter = from_config(cfg)
    adapter.observe = False  # the launcher acts on its own step only

    def end_step(relaunch: int) -> None:
        name = f"{P.STEP_NAME}-{relaunch}"
        for step_id, step_name in adapter.job_steps(alloc.job_id):
            if step_name == name:
                adapter.signal_step(step_id, "KILL")

    def start(argv: list[str], step_env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, env=step_env)

    if args.poll <= 0:
        raise UsageError("launch: --poll must be above 0 seconds")
    if args.return_poll <= 0:
        raise UsageError("launch: --return-poll must be above 0 seconds")
    settings = Settings(args.spares, args.max_restarts, args.poll, args.end_timeout,
                        return_poll_s=args.return_poll)
    launcher = Launcher(alloc, command, settings, SocketAgent(socket_path, alloc.job_id),
                        start, end_step, env, srun=args.srun,
                        nodes_seen=functools.partial(nodes_seen, adapter, alloc.job_id))
    code = launcher.run()
    say(f"step ended with status {code} (relaunch {launcher.place.relaunch})")
    return code
