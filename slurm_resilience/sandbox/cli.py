"""``slurm-resilience sandbox up|down|status|env``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_resilience.sandbox import control
from slurm_resilience.sandbox.layout import DEFAULT_PORT_BASE, DEFAULT_STATE_DIR, Layout


def register(sub: Any) -> None:
    p = sub.add_parser("sandbox", help="a real local Slurm cluster to try the hooks on")
    ssub = p.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                       help=f"where configuration, logs and state live (default: "
                            f"{DEFAULT_STATE_DIR})")

    up = ssub.add_parser("up", help="start munge, slurmctld, N slurmd and an S3 endpoint")
    common(up)
    up.add_argument("--nodes", type=int, default=4, help="number of nodes (default: 4)")
    up.add_argument("--leaves", type=int, default=2, help="number of leaf switches (default: 2)")
    up.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE,
                    help=f"slurmctld port; slurmd use the next N, the agents' exchange "
                         f"base+51.., their /metrics base+75.., S3 base+99 "
                         f"(default: {DEFAULT_PORT_BASE})")
    up.add_argument("--accounting", action="store_true",
                    help="also run slurmdbd over a MariaDB of the sandbox's own (Debian's "
                         "slurmdbd and mariadb-server packages), so sacct and sacctmgr work")
    up.add_argument("--no-install", action="store_true",
                    help="fail instead of installing missing packages with apt-get")
    up.set_defaults(func=run_up)
    for name, func, text in (("down", run_down, "cancel the jobs, stop every process"),
                             ("status", run_status, "show daemons and node states"),
                             ("env", run_env, "print export lines for SLURM_CONF and S3")):
        q = ssub.add_parser(name, help=text)
        common(q)
        q.set_defaults(func=func)
    from slurm_resilience.sandbox import faults

    inj = ssub.add_parser("inject", help="break a node's stand-in hardware: "
                                         + faults.usages())
    common(inj)
    inj.add_argument("node", help="the sandbox node to break (node1, node2, ...)")
    inj.add_argument("fault", help=faults.usages())
    inj.set_defaults(func=lambda a: _faults(faults.inject, a.state_dir, a.node, a.fault))
    heal = ssub.add_parser("heal", help="make a node's stand-in hardware healthy again")
    common(heal)
    heal.add_argument("node", help="the sandbox node to repair (node1, node2, ...)")
    heal.set_defaults(func=lambda a: _faults(faults.heal, a.state_dir, a.node))


def _faults(fn: Any, *args: Any) -> int:
    from slurm_resilience.sandbox.faults import FaultError

    try:
        print(fn(*args))
    except FaultError as exc:
        return _fail(exc)
    return 0


def _fail(exc: Exception) -> int:
    print(exc, file=sys.stderr)
    return 1


def run_up(args: argparse.Namespace) -> int:
    try:
        from slurm_resilience.sandbox import accounting

        layout = Layout(state_dir=args.state_dir, nodes=args.nodes, leaves=args.leaves,
                        port_base=args.port_base)
        if args.accounting:
            layout = replace(layout, slurm_overrides=accounting.overrides(layout))
        print(control.up(layout, install=not args.no_install))
    except (control.SandboxError, ValueError) as exc:
        return _fail(exc)
    for path in (layout.state_dir, layout.repo):
        blocked = control.unreachable_ancestor(path)
        if blocked is not None:
            print(f"note: {blocked} is not traversable by other users, so jobs of non-root "
                  f"users cannot reach {path} (chmod o+x {blocked} to allow it)")
    s3 = control.s3_info(layout)
    print(f"S3 endpoint {s3.endpoint} bucket {s3.bucket} access key {s3.access_key} "
          f"secret key {s3.secret_key}")
    print(f"Use it:  eval \"$(slurm-resilience sandbox env --state-dir {layout.state_dir})\"")
    return 0


def run_down(args: argparse.Namespace) -> int:
    try:
        layout = control.load_layout(args.state_dir)
    except control.SandboxError as exc:
        return _fail(exc)
    try:
        stopped = control.down(layout)
    except control.SandboxError as exc:
        return _fail(exc)
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def run_status(args: argparse.Namespace) -> int:
    try:
        print(control.status(control.load_layout(args.state_dir)))
    except control.SandboxError as exc:
        return _fail(exc)
    return 0


def run_env(args: argparse.Namespace) -> int:
    try:
        print("\n".join(control.env_lines(control.load_layout(args.state_dir))))
    except control.SandboxError as exc:
        return _fail(exc)
    return 0
