"""``launch.step_ended``: a launcher's step ended non-zero without an order. The batch
host's agent gathers Slurm's view of the step's nodes and spares (one ``scontrol show
node``), decides (:mod:`nodeloss`, pure) and acts: a relaunch order for the launcher, or the
node-fault requeue away from the lost nodes, each recorded once (AdminComment, the node-loss
counter, the log). Nothing here drains a node: the lost one is left as Slurm (or our gate)
put it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping, Sequence

from slurm_resilience import events
from slurm_resilience.agent.service import Peer, Request, RequestError, Response, int_arg
from slurm_resilience.clock import Clock
from slurm_resilience.config import Config
from slurm_resilience.hang import nodeloss as NL
from slurm_resilience.hang.launches import Launches
from slurm_resilience.hang.nodereach import (
    DEFAULT_SLURMD_PORT,
    Reach,
    Target,
    UnreachableSince,
    probe_nodes,
)
from slurm_resilience.health import faultrequeue as FR
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import JobInfo, NodeInfo

log = get_logger("heartbeat")
MAX_TRACKED_STEPS = 64  # failed steps whose probes are kept (each decided in minutes)


def status_arg(request: Request) -> int:
    """srun's exit status as the launcher saw it (negative: killed by that signal)."""
    value = request.get("status")
    if isinstance(value, bool) or not isinstance(value, int) or not -255 <= value <= 255:
        raise RequestError(f"status must be an integer in -255..255, got {str(value)[:40]!r}")
    return value


class NodeLossDesk:
    """Answers ``launch.step_ended``; one decision at a time (the answer is kept per
    relaunch, so a repeated question is answered the same and acted on once)."""

    def __init__(self, cfg: Callable[[], Config], launches: Launches, adapter: SlurmAdapter,
                 clock: Clock, node: str = "",
                 probe: Callable[[Sequence[Target]], Mapping[str, Reach]] = probe_nodes,
                 aside: Callable[[Callable[[], None]], None] | None = None):
        self.cfg = cfg
        # Where the AdminComment of a relaunch is written: off the launcher's request, which
        # carries the order back (a resized job's update can block for seconds, then fail).
        self.aside = aside or _on_a_thread
        self.launches = launches
        self.adapter = adapter
        self.clock = clock
        self.node = node  # this agent's node: never probed
        self.probe = probe
        # Set by the checkpoint service: its newest step of the job announced in S3 before
        # a requeue releases the job (uploader/announce.py).
        self.before_requeue: Callable[[int], object] | None = None
        self.lock = threading.Lock()
        self._slurmd_timeout: float | None = None
        self._slurmd_port = DEFAULT_SLURMD_PORT
        # (job, relaunch) → its step nodes' unreachable times; the newest few failed steps.
        self.unreachable: collections.OrderedDict[tuple[int, int], UnreachableSince] = \
            collections.OrderedDict()
        self.addresses: collections.OrderedDict[tuple[int, int], dict[str, NodeInfo]] = \
            collections.OrderedDict()

    def slurmd_timeout(self) -> float:
        """Slurm's SlurmdTimeout, read once (Slurm's default when unreadable, said)."""
        if self._slurmd_timeout is None:
            try:
                config = self.adapter.show_config()
                found = NL.slurmd_timeout(config)
            except SlurmError as exc:
                log.warning("launch: couldn't read SlurmdTimeout; using Slurm's default",
                            default_s=NL.DEFAULT_SLURMD_TIMEOUT_S, error=str(exc))
                return NL.DEFAULT_SLURMD_TIMEOUT_S  # read again next time
            self._slurmd_timeout = found if found is not None else NL.DEFAULT_SLURMD_TIMEOUT_S
            self._slurmd_port = NL.slurmd_port(config) or DEFAULT_SLURMD_PORT
        return self._slurmd_timeout

    def _unreachable(self, job_id: int, relaunch: int, nodes: Sequence[str],
                     infos: Mapping[str, NodeInfo]) -> dict[str, str]:
        """The step nodes found lost by this agent's probes (node → what they saw): neither
        slurmd nor agent has taken a connection for ``heartbeat.node_unreachable_s``."""
        hb = self.cfg().heartbeat
        after_s = hb.node_unreachable_s
        if after_s <= 0:
            return {}
        targets = []
        for n in nodes:
            info = infos.get(n)
            if n == self.node or info is None:
                continue
            host = info.address or info.hostname or n
            agent_host = hb.exchange.addresses.get(n, host)
            targets.append(Target(n, (host, info.port or self._slurmd_port),
                                  (agent_host, hb.exchange.port_of(n))))
        key = (job_id, relaunch)
        since = self.unreachable.get(key)
        if since is None:
            since = self.unreachable[key] = UnreachableSince()
            while len(self.unreachable) > MAX_TRACKED_STEPS:
                self.unreachable.popitem(last=False)
        if since.due(self.clock.monotonic()):
            since.update(self.probe(targets), self.clock.monotonic())
        # Lost as of the newest round: unreachable in every probe from its first miss to then.
        assert since.probed_at is not None
        probes, by_node = since.last, {t.node: t for t in targets}
        return {n: f"unreachable for {held:.0f}s ({probes[n].describe(by_node[n])})"
                for n, held in since.lost(since.probed_at, after_s).items()
                if n in probes and n in by_node}

    def ranks_died(self, job_id: int) -> None:
        """The job's ranks on this node died while its step still runs. srun waits for a
        lost node's tasks until Slurm marks the node (SlurmdTimeout), so the launcher would
        not ask before then: probe the step's nodes now, and when one has been unreachable
        for ``heartbeat.node_unreachable_s`` decide as for a step that ended (the answer is
        kept: the launcher polls the order, or later asks ``step_ended`` and gets it)."""
        if self.cfg().heartbeat.node_unreachable_s <= 0:
            return
        with self.lock:
            launch = self.launches.live(job_id)
            if launch is None or launch.order is not None or launch.settled is not None:
                return
            relaunch = launch.relaunch
            self.slurmd_timeout()  # read once with SlurmdPort, for nodes showing no Port
            infos = self.addresses.get((job_id, relaunch))
            try:
                if infos is None:  # where each node listens; asked once per step
                    infos = self.addresses[(job_id, relaunch)] = \
                        self.adapter.show_nodes([*launch.nodes, *launch.spares])
                    while len(self.addresses) > MAX_TRACKED_STEPS:
                        self.addresses.popitem(last=False)
                unreachable = self._unreachable(job_id, relaunch, launch.nodes, infos)
                if not unreachable:
                    return
                infos = self.adapter.show_nodes([*launch.nodes, *launch.spares])
                job = self.adapter.show_job(job_id)
            except SlurmError as exc:
                log.warning("launch: ranks died; couldn't read Slurm (asked again at the next "
                            "poll)", job_id=job_id, error=str(exc))
                return
            loss = NL.decide(launch, infos, job_nodes=job.nodes, ours=self.adapter.ours,
                             waited_s=0.0, bound_s=float("inf"), unreachable=unreachable)
            if loss.verdict is NL.Verdict.WAIT:
                return
            log.warning("launch: the job's ranks here died and a step node is unreachable; "
                        "deciding before Slurm marks it", job_id=job_id,
                        lost=",".join(loss.out))
            self.launches.settle(job_id, relaunch, NL.answer(self._act(loss, job, 1)))
            self.unreachable.pop((job_id, relaunch), None)

    def step_ended(self, request: Request, peer: Peer) -> Response:
        job_id, relaunch = int_arg(request, "job_id"), int_arg(request, "relaunch")
        status = status_arg(request)
        with self.lock:
            launch = self.launches.owned(job_id, peer)
            if launch.settled is not None and launch.relaunch == relaunch:
                return dict(launch.settled)
            launch = self.launches.step_ended(job_id, relaunch)
            assert launch.ended_at is not None
            bound = NL.wait_bound(self.slurmd_timeout(),
                                  self.cfg().heartbeat.node_loss_margin_s)
            try:
                infos = self.adapter.show_nodes([*launch.nodes, *launch.spares])
                job = self.adapter.show_job(job_id)
            except SlurmError as exc:
                # Slurm can't be asked now: the launcher asks again (bounded like a wait).
                loss = NL.NodeLoss(NL.Verdict.WAIT, f"couldn't read Slurm: {exc}", {},
                                   wait_s=1.0)
                return NL.answer(loss)
            waited = self.clock.monotonic() - launch.ended_at
            unreachable = self._unreachable(job_id, relaunch, launch.nodes, infos)
            loss = NL.decide(launch, infos, job_nodes=job.nodes, ours=self.adapter.ours,
                             waited_s=waited, bound_s=bound, unreachable=unreachable)
            if loss.verdict is NL.Verdict.WAIT:
                return NL.answer(loss)
            answer = NL.answer(self._act(loss, job, status))
            self.launches.settle(job_id, relaunch, answer)
            self.unreachable.pop((job_id, relaunch), None)
            return answer

    def _act(self, loss: NL.NodeLoss, job: JobInfo, status: int) -> NL.NodeLoss:
        lost = ",".join(loss.out)
        if loss.verdict is NL.Verdict.EXIT:
            log.info("launch: step failed with its nodes in service", job_id=job.job_id,
                     status=status)
            return loss
        ledger = FR.parse_ledger(job.admin_comment)
        if loss.verdict is NL.Verdict.RELAUNCH and loss.order is not None:
            if not self.launches.give(job.job_id, loss.order):
                loss = NL.NodeLoss(NL.Verdict.REQUEUE, f"{loss.reason}; the launcher moved on "
                                                       "or went quiet", loss.out)
            else:
                text = f"node fault on {lost}: {loss.reason}"
                self.aside(lambda: self._record(job, ledger, text))
                events.count(self.adapter.events_path, events.NODE_LOSS, "relaunch")
                log.warning("launch: node lost: relaunch ordered", job_id=job.job_id,
                            lost=lost, reason=loss.reason)
                return loss
        d = FR.decide(job, exit_code=status or 1, cap=self.cfg().health.fault_requeue_max)
        if d.action != "requeue":
            events.count(self.adapter.events_path, events.NODE_LOSS, "leave")
            reason = f"{loss.reason}; not requeued: {d.reason}"
            log.warning("launch: node lost; job not requeued", job_id=job.job_id, lost=lost,
                        reason=reason)
            return NL.NodeLoss(NL.Verdict.EXIT, reason, loss.out)
        done, what = FR.requeue_away(self.adapter, job, d.ledger, list(loss.out),
                                     f"node fault on {lost}: {loss.reason}",
                                     before_release=self.before_requeue)
        events.count(self.adapter.events_path, events.NODE_LOSS, "requeue")
        log.warning("launch: node lost: job requeued" if done else
                    "launch: node lost: requeue incomplete", job_id=job.job_id, lost=lost,
                    reason=loss.reason, done=what)
        return NL.NodeLoss(NL.Verdict.REQUEUE, f"{loss.reason}; {what}", loss.out)

    def _record(self, job: JobInfo, ledger: FR.FaultLedger, text: str) -> None:
        """The relaunch in the job's AdminComment (a relaunch is not a requeue: the fault
        ledger's count stays)."""
        try:
            self.adapter.set_admin_comment(job.job_id,
                                           FR.merge_comment(job.admin_comment, ledger, text))
        except SlurmError as exc:
            # Slurm refuses updates of a job it resized (the lost node removed) until
            # accounting gives it a new record; without accounting, for the job's life.
            log.warning("launch: couldn't record the node-loss relaunch in the job's "
                        "AdminComment (the counter and this log keep it)",
                        job_id=job.job_id, error=str(exc))


def _on_a_thread(fn: Callable[[], None]) -> None:
    """One short-lived thread per relaunch ordered (bounded by the launcher's
    --max-restarts); each Slurm call in it has the adapter's timeout."""
    threading.Thread(target=fn, name="node-loss-record", daemon=True).start()
