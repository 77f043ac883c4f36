"""``slurm-resilience agent``: run the node agent in the foreground (systemd runs it)."""

from __future__ import annotations

import argparse
import signal
from typing import Any

from slurm_resilience import config, events, log
from slurm_resilience.agent.daemon import Agent, bind_server, load_services
from slurm_resilience.agent.service import AgentContext
from slurm_resilience.config import lastgood
from slurm_resilience.config.paths import node_name
from slurm_resilience.slurm.adapter import from_config


def register(sub: Any) -> None:
    p = sub.add_parser("agent", help="run the node agent (checkpoint sync, hang watching)")
    p.add_argument("--node", default="", help="Slurm node name this agent serves "
                   "(default: node.name from config, then SLURMD_NODENAME, then the hostname)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # A file that does not load never stops the agent (its hook server gates, its metrics
    # say config_valid 0): it runs with the last good copy, or the built-in defaults.
    loaded = lastgood.load(args.config)
    cfg = loaded.cfg
    # Live reload (and anything else that re-reads the file) reads this same file.
    config.use_path(config.resolve_path(args.config)[0])
    node = node_name(args.node or cfg.node.name)
    log.configure(mode="json", level="debug" if args.verbose else cfg.logging.level,
                  file=cfg.logging.file, use_syslog=cfg.logging.syslog, node=node)
    if not loaded.valid:
        log.get_logger("agent").error(
            f"agent: config: couldn't load; running with {loaded.gating_with}",
            **loaded.fields())
    adapter = from_config(cfg)
    adapter.events_path = events.path_for(cfg.node.state_dir, node)
    ctx = AgentContext(cfg=cfg, node=node, adapter=adapter)
    server = bind_server(ctx)  # before the services: the hook server's prologs call it
    agent = Agent(ctx, load_services(ctx), server)
    signal.signal(signal.SIGTERM, agent.request_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    agent.run()
    return 0
