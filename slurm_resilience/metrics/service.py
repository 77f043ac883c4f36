"""The agent's ``metrics`` service: serves ``/metrics`` over HTTP and rewrites the optional
node_exporter textfile. It only collects and serves: what it serves it reads from the other
services' snapshots (hang watcher, uploader, stragglers, goodput) at scrape time.

It is the last service the agent starts, so it finds the others in
``AgentContext.extra["services"]``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from slurm_resilience import events
from slurm_resilience.agent.service import AgentContext, Handler, Peer, Request, Response
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.health import nvlink_domain
from slurm_resilience.health.gate import state_dir as health_state_dir
from slurm_resilience.log import get_logger
from slurm_resilience.metrics import http
from slurm_resilience.metrics.collector import AgentCollector, AgentSources, nccl_path
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.stragglers.service import status_of

log = get_logger("metrics")


def write_textfile(path: str, registry: CollectorRegistry) -> None:
    """Replace ``path`` atomically (node_exporter must never read half a file)."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(generate_latest(registry))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class MetricsService:
    name = "metrics"

    def __init__(self, cfg: Config, node: str, adapter: SlurmAdapter,
                 services: dict[str, Any], agent: Any = None, *, serve: bool = True):
        self.cfg = cfg
        self.node = node
        self.adapter = adapter
        self.watcher = services.get("heartbeat")
        self.interval_s = min(cfg.heartbeat.interval_s, cfg.metrics.textfile_interval_s)
        self.stragglers = services.get("stragglers")  # stragglers.service.StragglerService
        self.goodput = services.get("goodput")  # goodput.service.GoodputService
        self.sources = AgentSources(
            node=node, events_path=adapter.events_path or events.path_for(cfg.node.state_dir,
                                                                          node),
            nccl_path=nccl_path(cfg.node.state_dir, node), watcher=self.watcher,
            uploader=services.get("checkpoint"), stragglers=self.stragglers,
            goodput=self.goodput, agent=agent,
            services=tuple(sorted([*services, self.name])),
            nvlink_path=nvlink_domain.path_for(health_state_dir(cfg, node)))
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = AgentCollector(self.sources)
        self.registry.register(self.collector)
        self.textfile = node_path(cfg.metrics.textfile, node) if cfg.metrics.textfile else ""
        self.next_textfile = 0.0
        self.server: Any = None
        self.url = ""
        m = cfg.metrics
        self.serve_error = ""
        port = m.port_of(node)
        if serve and port:
            host = f"[{m.listen_address}]" if ":" in m.listen_address else m.listen_address
            try:
                self.server = http.serve(m.listen_address, port, self.registry,
                                         wrap=self._queries)
                self.url = f"http://{host}:{port}/metrics"
                log.info("metrics: serving", url=self.url)
            except OSError as exc:
                # Hang watching and uploads go on; the operator sees why metrics don't.
                self.serve_error = f"couldn't listen on {host}:{port}: {exc}"
                log.error("metrics: no HTTP endpoint", error=self.serve_error)

    def _queries(self, metrics_app: Any) -> Any:
        """The endpoint also answers a login node's questions about a job (queries)."""
        from slurm_resilience.metrics import answers
        from slurm_resilience.queries.server import QueryApp
        from slurm_resilience.transport.credentials import for_queries

        return QueryApp(self.node, for_queries(self.cfg.heartbeat.exchange),
                        answers.handlers(self.cfg, self.node), metrics_app)

    def attach(self, agent: Any) -> None:
        """The agent, once built: its socket server's stats and tick failures."""
        self.sources.agent = agent

    def tick(self) -> None:
        now = time.monotonic()
        if self.textfile and now >= self.next_textfile:
            self.next_textfile = now + self.cfg.metrics.textfile_interval_s
            try:
                write_textfile(self.textfile, self.registry)
            except OSError as exc:
                log.warning("metrics: couldn't write the textfile", path=self.textfile,
                            error=str(exc))

    # -- requests --------------------------------------------------------------------------------

    def handle_stragglers(self, request: Request, peer: Peer) -> Response:
        """This node's straggler record and the jobs with straggler ranks now (anyone may
        ask: no job-private data, only job ids and step times)."""
        out: Response = {"node": self.node, "url": self.url, "serve_error": self.serve_error,
                         "jobs": [], "recent": [], "judged": []}
        if self.stragglers is not None:
            out.update(status_of(self.stragglers.snapshot()))
        return out

    def handlers(self) -> dict[str, Handler]:
        # metrics.ckpt_saved is the goodput service's (the save times feed goodput).
        return {"metrics.stragglers": self.handle_stragglers}

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def factory(ctx: AgentContext) -> MetricsService:
    return MetricsService(ctx.cfg, ctx.node, ctx.adapter, ctx.extra.get("services", {}),
                          ctx.extra.get("agent"))
