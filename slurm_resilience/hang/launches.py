"""The launchers (``slurm-resilience launch``) running on this node, as their agent knows
them, and the relaunch orders the incident handling leaves for them.

A launcher runs in the job's batch script, on the batch host, whose agent decides the job's
incidents. It registers its step's nodes and its spare nodes (``launch.register``) and asks
for an order four times a second (``launch.poll``); an incident decided for the job while a
live launcher with a usable spare is registered becomes a relaunch order instead of a
requeue. Both requests are checked against the caller's kernel credentials: only the job's
owner (or root) registers or polls, for a job watched on this node, and nothing a launcher
says is trusted beyond its own job: spares are used only when Slurm lists them in the job's
allocation and they pass the gate (see :mod:`relaunch`). One entry per job, bounded by the
jobs running here.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

from slurm_resilience.agent.service import Peer, Request, RequestError, Response, int_arg
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.heartbeat.attempt import MAX_RELAUNCHES

# A launcher that has not polled for this long is gone (its batch host lost, killed):
# incidents of its job take the requeue path.
STALE_S = 15.0
MAX_NODES = 4096
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True)
class Order:
    """Relaunch the step as relaunch ``relaunch`` on ``nodes``: ``joined`` are spares new to
    the step, ``out`` the nodes taken out of it."""

    relaunch: int
    nodes: tuple[str, ...]
    joined: tuple[str, ...]
    out: tuple[str, ...]
    reason: str
    # Of ``out``, the nodes that are gone (down, or unreachable): their tasks never report,
    # so srun would wait for them until Slurm marks them; the launcher doesn't.
    gone: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"relaunch": self.relaunch, "nodes": list(self.nodes),
                "joined": list(self.joined), "out": list(self.out), "reason": self.reason,
                "gone": list(self.gone)}


@dataclass(frozen=True)
class Launch:
    """One job's launcher as registered: the step's nodes now, the spares it has left."""

    job_id: int
    uid: int
    pid: int
    relaunch: int
    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    max_restarts: int
    seen: float  # monotonic time of its last request
    order: Order | None = None
    # Its step ended non-zero (launch.step_ended): when it first said so, and the answer
    # once decided (repeated, never decided twice).
    ended_at: float | None = None
    settled: Mapping[str, object] | None = None


def _nodes(request: Request, key: str) -> tuple[str, ...]:
    value = request.get(key)
    if not isinstance(value, list) or len(value) > MAX_NODES:
        raise RequestError(f"{key} must be a list of at most {MAX_NODES} node names")
    out = []
    for n in value:
        if not isinstance(n, str) or not _NODE.match(n):
            raise RequestError(f"{key}: {str(n)[:40]!r} is not a node name")
        out.append(n)
    if len(set(out)) != len(out):
        raise RequestError(f"{key} names a node twice")
    return tuple(out)


class Launches:
    """The registry; its methods are called from socket threads and incident threads."""

    def __init__(self, clock: Clock = SystemClock()):
        self.clock = clock
        self.lock = threading.Lock()
        self.jobs: dict[int, Launch] = {}

    def register(self, request: Request, peer: Peer, owner_uid: int | None) -> Response:
        """``launch.register``: ``owner_uid`` is the uid of the job as watched on this node
        (None: not watched here); the same refusal for another's job and for none."""
        job_id = int_arg(request, "job_id")
        if owner_uid is None or peer.uid not in (0, owner_uid):
            raise RequestError(f"no job {job_id} of uid {peer.uid} is watched here")
        relaunch = int_arg(request, "relaunch")
        max_restarts = min(int_arg(request, "max_restarts"), MAX_RELAUNCHES)
        nodes, spares = _nodes(request, "nodes"), _nodes(request, "spares")
        if not nodes or set(nodes) & set(spares):
            raise RequestError("nodes must be non-empty and apart from spares")
        with self.lock:
            old = self.jobs.get(job_id)
            if old is not None and relaunch < old.relaunch:
                raise RequestError(f"job {job_id} is at relaunch {old.relaunch}, not "
                                   f"{relaunch}")
            # An order is done once the launcher registers the relaunch it asked for.
            order = old.order if old is not None and old.order is not None and \
                old.order.relaunch > relaunch else None
            self.jobs[job_id] = Launch(job_id, owner_uid, peer.pid, relaunch, nodes, spares,
                                       max_restarts, self.clock.monotonic(), order)
        return {"job_id": job_id, "relaunch": relaunch}

    def poll(self, request: Request, peer: Peer) -> Response:
        """``launch.poll``: the pending order of the caller's job, if any."""
        order = self.owned(int_arg(request, "job_id"), peer).order
        return {"order": order.to_json() if order is not None else None}

    def owned(self, job_id: int, peer: Peer) -> Launch:
        """The caller's job's launcher (owner or root), marked as seen now; the same
        refusal for another's job and for none."""
        with self.lock:
            launch = self.jobs.get(job_id)
            if launch is None or peer.uid not in (0, launch.uid):
                raise RequestError(f"no launcher of job {job_id} for uid {peer.uid} is "
                                   "registered here")
            launch = self.jobs[job_id] = replace(launch, seen=self.clock.monotonic())
        return launch

    def step_ended(self, job_id: int, relaunch: int) -> Launch:
        """Note that the step of ``relaunch`` ended non-zero (the first time only)."""
        with self.lock:
            launch = self.jobs[job_id]
            if launch.relaunch != relaunch:
                raise RequestError(f"job {job_id} is at relaunch {launch.relaunch}, not "
                                   f"{relaunch}")
            if launch.ended_at is None:
                launch = self.jobs[job_id] = replace(launch, ended_at=self.clock.monotonic())
        return launch

    def settle(self, job_id: int, relaunch: int, answer: Mapping[str, object]) -> None:
        """Keep the answer decided for the step of ``relaunch`` (repeated from now on)."""
        with self.lock:
            launch = self.jobs.get(job_id)
            if launch is not None and launch.relaunch == relaunch:
                self.jobs[job_id] = replace(launch, settled=dict(answer))

    def live(self, job_id: int) -> Launch | None:
        """The job's launcher when it polled recently, else None."""
        with self.lock:
            launch = self.jobs.get(job_id)
        if launch is None or self.clock.monotonic() - launch.seen > STALE_S:
            return None
        return launch

    def give(self, job_id: int, order: Order) -> bool:
        """Leave ``order`` for the job's launcher; False when it is gone or moved on (its
        relaunch is no longer the one the order follows)."""
        with self.lock:
            launch = self.jobs.get(job_id)
            if launch is None or self.clock.monotonic() - launch.seen > STALE_S:
                return False
            if launch.order is not None and launch.order.relaunch == order.relaunch:
                return True  # a resumed plan gives it again
            if launch.relaunch + 1 != order.relaunch:
                return False
            self.jobs[job_id] = replace(launch, order=order)
        return True

    def forget(self, keep: set[int]) -> None:
        """Drop the launchers of jobs no longer on this node."""
        with self.lock:
            for job_id in set(self.jobs) - keep:
                del self.jobs[job_id]
