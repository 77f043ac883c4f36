"""Lose a sandbox node at once, as a power cut would: SIGKILL its slurmd, its slurmstepds
and every process running as that node (job tasks, its agent). Slurm notices only by the
missed pings (SlurmdTimeout), as on a real cluster. :func:`revive_node` starts its slurmd
and agent again.

The sandbox's nodes share one host, so each process is told apart safely: slurmd by its pid
file (checked against its command line, see :mod:`daemons`); a slurmstepd by the node's
slurmd log, which it keeps open; tasks and the agent by ``SLURMD_NODENAME`` together with
this sandbox's ``SLURM_CONF`` in ``/proc/<pid>/environ`` (another sandbox's node of the same
name is left alone). Nothing is parsed by a shell.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from slurm_resilience.sandbox import catalogue, daemons
from slurm_resilience.sandbox.layout import Layout


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or a kernel thread
        return {}
    out = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            out[key] = value
    return out


def _holds(pid: int, path: Path) -> bool:
    """Whether ``pid`` has ``path`` open."""
    want = str(path)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                return True
        except OSError:
            continue
    return False


def node_processes(layout: Layout, node: str) -> list[int]:
    """The pids that make up ``node`` now: slurmd, slurmstepds, tasks, its agent."""
    me = os.getpid()
    conf = str(layout.slurm_conf).encode()
    log = layout.log_dir / f"slurmd-{node}.log"
    found = []
    slurmd = catalogue.slurmd(layout, node).pid()
    if slurmd is not None:
        found.append(slurmd)
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (me, slurmd):
            continue
        pid = int(name)
        argv = daemons.cmdline(pid)
        if argv and argv[0].startswith("slurmstepd") and _holds(pid, log):
            found.append(pid)
            continue
        env = _environ(pid)
        if env.get(b"SLURMD_NODENAME") == node.encode() and env.get(b"SLURM_CONF") == conf:
            found.append(pid)
    return found


def kill_node(layout: Layout, node: str) -> list[int]:
    """SIGKILL every process of ``node`` (repeated until none is left: a task may fork
    meanwhile); the pids killed."""
    if node not in layout.node_names:
        raise ValueError(f"sandbox: no node {node!r} (nodes: {', '.join(layout.node_names)})")
    killed: list[int] = []
    for _ in range(10):
        pids = [p for p in node_processes(layout, node) if daemons.alive(p)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                continue
        for pid in pids:
            daemons.reap(pid)
    return killed


def revive_node(layout: Layout, node: str) -> None:
    """Start the node's slurmd and agent again (Slurm returns it to service when slurmd
    registers: ReturnToService=2)."""
    from slurm_resilience.sandbox import control

    env = control.daemon_env(layout)
    control.start_slurmd(layout, node, env)
    for extra in catalogue.agent_extras(layout):
        if extra.daemon.name == f"agent-{node}" and extra.daemon.pid() is None:
            daemons.spawn(extra.argv, log_file=layout.log_dir / f"{extra.daemon.name}.log",
                          pid_file=extra.daemon.pid_file, env={**env, **extra.env})
