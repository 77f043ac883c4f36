"""The agent's main loop: start services, serve the socket, tick, stop cleanly."""

from __future__ import annotations

import importlib
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from slurm_resilience.agent.server import AgentServer
from slurm_resilience.agent.service import AgentContext, Service
from slurm_resilience.agent.services import SERVICES
from slurm_resilience.config.paths import node_path
from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import flush_all

log = get_logger("agent")
SLOW_TICK_S = 5.0  # a tick longer than this delays every service on the loop: said

Factory = Callable[[AgentContext], "Service | None"]


def load_services(ctx: AgentContext, specs: list[str] | None = None) -> list[Service]:
    services: list[Service] = []
    for spec in SERVICES if specs is None else specs:
        module, _, name = spec.partition(":")
        factory: Factory = getattr(importlib.import_module(module), name)
        try:
            svc = factory(ctx)
        except Exception:
            # not take the others down with it: said, and the agent goes on without it
            log.exception("agent: a service couldn't start; the agent goes on without it",
                          service=spec)
            continue
        if svc is not None:
            services.append(svc)
            # A later service (metrics) may read an earlier one's state.
            ctx.extra.setdefault("services", {})[svc.name] = svc
            log.info("service started", service=svc.name)
    return services


def bind_server(ctx: AgentContext) -> AgentServer:
    """The agent's socket, listening, before any service starts.

    The first service starts the hook server, and a prolog it runs asks this socket for the
    job's staging. Listening from the start, the kernel queues such a request until the
    loop accepts it (the prolog's own timeout bounds the wait), where a socket bound after
    the services would refuse it while they start (at boot, or an agent restart)."""
    a = ctx.cfg.agent
    return AgentServer(node_path(a.socket, ctx.node), max_bytes=a.max_request_bytes,
                       io_timeout=a.request_timeout_s, max_connections=a.max_connections,
                       max_per_uid=a.max_connections_per_uid,
                       newcomer_reserve=a.newcomer_reserve)


class Agent:
    """Runs services' ``tick`` on one loop thread (a service with ``own_thread`` on one of
    its own) and their handlers on socket threads."""

    def __init__(self, ctx: AgentContext, services: list[Service],
                 server: AgentServer | None = None):
        self.ctx = ctx
        self.services = services
        self.stop_event = threading.Event()
        self.server = server if server is not None else bind_server(ctx)
        for svc in services:
            for op, handler in svc.handlers().items():
                self.server.route(op, handler)
        self._next: dict[str, float] = {svc.name: 0.0 for svc in services}
        self.tick_failures: dict[str, int] = {}  # for the metrics
        # A service with a deadline (``own_thread = True``: the warning ahead of a time
        # limit) ticks on a thread of its own: a slow tick on the loop (a Slurm call up to
        # its timeout, a host starved of CPU) must not make it late.
        self.own_thread = [s for s in services if getattr(s, "own_thread", False)]
        self.looped = [s for s in services if not getattr(s, "own_thread", False)]
        for svc in services:
            attach = getattr(svc, "attach", None)
            if attach is not None:
                attach(self)

    def tick_once(self) -> None:
        """One turn of the loop: each looped service whose interval has passed ticks."""
        now = time.monotonic()
        for svc in self.looped:
            if now < self._next[svc.name]:
                continue
            self._next[svc.name] = now + svc.interval_s
            self._tick(svc)
        flush_all()  # the summary lines of user-triggered warnings held back

    def _tick(self, svc: Service) -> None:
        started = time.monotonic()
        try:
            svc.tick()
        except Exception:
            # Each key is written by the one thread that ticks its service.
            self.tick_failures[svc.name] = self.tick_failures.get(svc.name, 0) + 1
            log.exception("service tick failed", service=svc.name)
        took = time.monotonic() - started
        if took > SLOW_TICK_S:
            # Every other service on its thread waited as long.
            log.warning("service tick was slow", service=svc.name, seconds=round(took, 1))

    def _run_own(self, svc: Service) -> None:
        while not self.stop_event.is_set():
            self._tick(svc)
            self.stop_event.wait(svc.interval_s)

    def run(self) -> None:
        thread = threading.Thread(target=self.server.serve_forever, name="agent-socket",
                                  daemon=True)
        thread.start()
        own = [threading.Thread(target=self._run_own, args=(svc,), name=f"agent-{svc.name}",
                                daemon=True) for svc in self.own_thread]
        for t in own:
            t.start()
        log.info("agent running", socket=self.server.path,
                 services=[s.name for s in self.services])
        try:
            while not self.stop_event.is_set():
                self.tick_once()
                self.stop_event.wait(self.ctx.cfg.agent.tick_s)
        finally:
            self.stop_event.set()
            for t in own:
                t.join(timeout=15.0)  # one tick's Slurm call at most
            self.server.shutdown()
            self.server.server_close()
            for svc in self.services:
                try:
                    svc.close()
                except Exception:
                    log.exception("service close failed", service=svc.name)
            log.info("agent stopped")

    def request_stop(self, signum: int, _frame: FrameType | None) -> None:
        log.info("agent stopping", signal=signal.Signals(signum).name)
        self.stop_event.set()
