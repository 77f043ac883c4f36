"""The sandbox's daemons by name: munged, slurmctld, one slurmd per node, and the extras
started once Slurm is up (the S3 endpoint, one node agent per node)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from slurm_resilience.sandbox.daemons import Daemon
from slurm_resilience.sandbox.errors import SandboxError
from slurm_resilience.sandbox.layout import Layout
from slurm_resilience.sandbox.prereqs import rclone_path
from slurm_resilience.sandbox.statefiles import s3_info


@dataclass(frozen=True)
class Extra:
    """A daemon started after Slurm is up (S3 endpoint, node agents)."""

    daemon: Daemon
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def munged(layout: Layout) -> Daemon:
    return Daemon("munged", "munged", layout.pid_file("munged"), str(layout.state_dir))


def slurmctld(layout: Layout) -> Daemon:
    return Daemon("slurmctld", "slurmctld", layout.pid_file("slurmctld"), str(layout.state_dir))


def slurmd(layout: Layout, node: str) -> Daemon:
    return Daemon(f"slurmd-{node}", "slurmd", layout.pid_file(f"slurmd-{node}"),
                  str(layout.state_dir))


def s3_extra(layout: Layout) -> list[Extra]:
    s3 = s3_info(layout)
    argv = [rclone_path(), "serve", "s3", str(layout.s3_dir),
            "--addr", f"127.0.0.1:{layout.s3_port}",
            "--auth-key", f"{s3.access_key},{s3.secret_key}",
            "--config", str(layout.etc / "rclone.conf")]
    return [Extra(Daemon("s3", "rclone", layout.pid_file("s3"), str(layout.state_dir)), argv)]


def agent_extras(layout: Layout) -> list[Extra]:
    """One node agent per node, once the agent exists in this checkout."""
    if not (layout.repo / "slurm_resilience" / "agent" / "cli.py").exists():
        return []
    out = []
    for node in layout.node_names:
        argv = [sys.executable, "-m", "slurm_resilience", "--config", str(layout.resilience_conf),
                "agent", "--node", node]
        daemon = Daemon(f"agent-{node}", "slurm_resilience", layout.pid_file(f"agent-{node}"),
                        str(layout.state_dir))
        out.append(Extra(daemon, argv, {"SLURM_RESILIENCE_CONFIG": str(layout.resilience_conf),
                                        "SLURMD_NODENAME": node}))
    return out


# Started in this order after Slurm is up; add a function here to run another daemon.
EXTRAS: list[Callable[[Layout], list[Extra]]] = [s3_extra, agent_extras]


def extra_daemons(layout: Layout) -> list[Daemon]:
    out = []
    for make in EXTRAS:
        try:
            out += [e.daemon for e in make(layout)]
        except (SandboxError, FileNotFoundError, ValueError):
            continue  # not configured (no keys yet): nothing of that kind can be running
    return out


def _program_of(name: str) -> str:
    return {"s3": "rclone"}.get(name, "slurm_resilience" if name.startswith("agent-") else name)
