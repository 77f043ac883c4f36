"""Bring a sandbox up, take it down, and report on it.

``up`` writes the configuration, then starts munged, slurmctld, one
``slurmd -N nodeX`` per node and the extra daemons (the S3 endpoint and, once
the agent exists, one node agent per node), and waits until every node is
IDLE and its agent's hook server listens (so the first job's hooks are served, as on a
site); a daemon that fails is named with the end of its log (SandboxError).
``down`` cancels the jobs, stops the daemons named by the pid files in the state
directory, then every other process of the sandbox (:mod:`.sweep`), and
removes nothing.

The lifecycle lives here and the file writing of ``up``; the host's prerequisites are
:mod:`.prereqs`, the daemons by name :mod:`.catalogue`, the sandbox's own records
:mod:`.statefiles` (their names stay reachable through this module).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from slurm_resilience import config
from slurm_resilience.agent.client import AgentUnavailable
from slurm_resilience.agent.client import call as agent_call
from slurm_resilience.fakes import nvml
from slurm_resilience.health.nvlink_domain import GpuFabric, NodeFabric
from slurm_resilience.log import get_logger
from slurm_resilience.proc import Runner
from slurm_resilience.sandbox import (
    accounting,
    daemons,
    hardware,
    resilience_conf,
    slurmconf,
    sweep,
)
from slurm_resilience.sandbox.catalogue import (
    EXTRAS as EXTRAS,
)
from slurm_resilience.sandbox.catalogue import (
    Extra as Extra,
)
from slurm_resilience.sandbox.catalogue import (
    _program_of as _program_of,
)
from slurm_resilience.sandbox.catalogue import (
    agent_extras as agent_extras,
)
from slurm_resilience.sandbox.catalogue import (
    extra_daemons as extra_daemons,
)
from slurm_resilience.sandbox.catalogue import (
    munged as munged,
)
from slurm_resilience.sandbox.catalogue import (
    s3_extra as s3_extra,
)
from slurm_resilience.sandbox.catalogue import (
    slurmctld as slurmctld,
)
from slurm_resilience.sandbox.catalogue import (
    slurmd as slurmd,
)
from slurm_resilience.sandbox.daemons import Daemon
from slurm_resilience.sandbox.errors import SandboxError as SandboxError
from slurm_resilience.sandbox.errors import failed
from slurm_resilience.sandbox.errors import tail as tail
from slurm_resilience.sandbox.layout import BUCKET, Layout
from slurm_resilience.sandbox.prereqs import (
    PACKAGES as PACKAGES,
)
from slurm_resilience.sandbox.prereqs import (
    PROGRAMS as PROGRAMS,
)
from slurm_resilience.sandbox.prereqs import SANDBOX_ENV as SANDBOX_ENV
from slurm_resilience.sandbox.prereqs import SYSTEM_PATH as SYSTEM_PATH
from slurm_resilience.sandbox.prereqs import (
    adapter as adapter,
)
from slurm_resilience.sandbox.prereqs import (
    daemon_env as daemon_env,
)
from slurm_resilience.sandbox.prereqs import (
    ensure_packages as ensure_packages,
)
from slurm_resilience.sandbox.prereqs import (
    env_match as env_match,
)
from slurm_resilience.sandbox.prereqs import missing_programs as missing_programs
from slurm_resilience.sandbox.prereqs import (
    rclone_path as rclone_path,
)
from slurm_resilience.sandbox.prereqs import (
    tool as tool,
)
from slurm_resilience.sandbox.prereqs import user_env as user_env
from slurm_resilience.sandbox.prereqs import (
    venv_bin as venv_bin,
)
from slurm_resilience.sandbox.statefiles import (
    LAYOUT_FILE as LAYOUT_FILE,
)
from slurm_resilience.sandbox.statefiles import (
    S3Info as S3Info,
)
from slurm_resilience.sandbox.statefiles import (
    load_layout as load_layout,
)
from slurm_resilience.sandbox.statefiles import (
    s3_info as s3_info,
)
from slurm_resilience.sandbox.statefiles import (
    save_layout as save_layout,
)
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import NodeInfo
from slurm_resilience.topology import install as topology_install

log = get_logger("sandbox")

# How long `down` waits for cancelled jobs to end before stopping everything anyway.
CANCEL_WAIT_S = 30.0


def stage_daemons(layout: Layout) -> list[Daemon]:
    """The daemons the stages of ``up`` start, in start order."""
    return [d for stage in STAGES for d in stage.daemons(layout)]


def all_daemons(layout: Layout) -> list[Daemon]:
    """Every daemon of the sandbox, in start order, and any other pid file's."""
    out = stage_daemons(layout)
    # Pid files of daemons no longer in the list (e.g. a node count changed) still count.
    known = {d.pid_file for d in out}
    for pid_file in sorted(layout.run_dir.glob("*.pid")) if layout.run_dir.exists() else []:
        if pid_file not in known and not pid_file.name.startswith("slurmd-"):
            out.append(Daemon(pid_file.stem, _program_of(pid_file.stem), pid_file,
                              str(layout.state_dir)))
        elif pid_file not in known:
            out.append(Daemon(pid_file.stem, "slurmd", pid_file, str(layout.state_dir)))
    return out


# -- writing the state directory ----------------------------------------------------------------


def _mkdir(path: Path, mode: int = 0o755) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)


def write_files(layout: Layout) -> None:
    """Create the state directory tree and (re)write every generated file."""
    L = layout
    _mkdir(L.state_dir)
    for d in (L.etc, L.log_dir, L.run_dir, L.munge_dir, L.spool_dir, L.ctld_state_dir,
              L.s3_dir, L.s3_dir / BUCKET, L.nodes_dir):
        _mkdir(d)
    for node in L.node_names:
        _mkdir(L.spool_dir / node)
        for sub in ("", "nvme", "state", "run"):
            _mkdir(L.node_dir(node) / sub if sub else L.node_dir(node))
    lua = L.repo / "hooks" / "job_submit.lua"
    link = L.etc / "job_submit.lua"
    if link.is_symlink() or link.exists():
        link.unlink()
    if lua.exists():
        link.symlink_to(lua)
    # Our SPANK plugin (built by `make setup`), listed the way a site lists it.
    spank = L.repo / "spank" / "slurm_resilience.so"
    _write(L.etc / "plugstack.conf", f"optional {spank}\n" if spank.exists() else "")
    _write(L.slurm_conf, slurmconf.slurm_conf(L, job_submit_lua=lua.exists()))
    # topology.conf and job_submit.lua's data come from the topology generator, as on a site.
    topology_install.write_generated(L.etc, slurmconf.topology_conf(L),
                                     resilience_conf.sections(L).get("topology", {}), L.slurm_conf)
    (L.etc / "topology.yaml").unlink(missing_ok=True)  # Slurm would read it over topology.conf
    if L.block_topology:
        # An NVL72 sandbox: the block topology from the nodes' stand-in NVLink domains, in
        # the file this Slurm reads (topology.conf, or topology.yaml from 25.05).
        version = SlurmAdapter(slurm_conf=str(L.slurm_conf)).slurm_version()
        topology_install.write_blocks(L.etc, block_records(L), version,
                                      resilience_conf.sections(L).get("topology", {}),
                                      L.slurm_conf)
    _write(L.healthcheck_wrapper, slurmconf.healthcheck_wrapper(L))
    L.healthcheck_wrapper.chmod(0o755)
    (L.etc / "rclone.conf").touch()
    if not L.munge_key.exists():
        fd = os.open(L.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(1024))
    if not L.s3_keys_file.exists():
        fd = os.open(L.s3_keys_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"SR{secrets.token_hex(8).upper()} {secrets.token_urlsafe(24)}\n")
    write_resilience_conf(L, resilience_conf.sections(L))
    save_layout(L)


def fabric_of(layout: Layout) -> dict[str, dict[str, Any]]:
    """Block mode: each node's GPUs' NVLink fabric (the real GB200 capture's, one clique per
    leaf); otherwise none (HGX H100 stand-ins)."""
    if not layout.block_topology:
        return {}
    return {node: nvml.nvl72_fabric(clique) for node, clique in layout.clique_of().items()}


def block_records(layout: Layout) -> list[NodeFabric]:
    """The NVLink domain records the nodes' health gates will save, from their stand-ins."""
    out = []
    for node, entry in fabric_of(layout).items():
        gpus = [GpuFabric(i, entry["state"], entry["status"], entry["cluster_uuid"],
                          entry["clique_id"], entry["health_mask"], entry["health_summary"])
                for i in range(hardware.GPUS)]
        out.append(NodeFabric(node, 0.0, gpus))
    return out


def write_resilience_conf(layout: Layout, sections: dict[str, dict[str, object]]) -> None:
    """Write the hooks' YAML atomically after checking it loads."""
    text = ("# Generated by `slurm-resilience sandbox up` (slurm_resilience/sandbox/"
            "resilience_conf.py).\n" + yaml.safe_dump(sections, sort_keys=False))
    tmp = layout.resilience_conf.with_suffix(".yaml.tmp")
    _write(tmp, text)
    config.load(str(tmp))
    os.replace(tmp, layout.resilience_conf)


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o644)


# -- up / down / status -------------------------------------------------------------------------


def running(layout: Layout) -> dict[str, int | None]:
    """Daemon name → pid when running (and really ours), else None."""
    return {d.name: d.pid() for d in all_daemons(layout)}


def up(layout: Layout, *, install: bool = True, wait_s: float = 40.0,
       runner: Runner | None = None) -> str:
    """Start the sandbox; returns a one-line summary. Already up with this layout: no-op."""
    runner = runner or Runner()
    if os.geteuid() != 0:
        raise SandboxError("sandbox: up: needs root: slurmd runs jobs as their users and "
                           "hooks as root, as on a real node")
    if layout.state_dir.exists() and (layout.state_dir / LAYOUT_FILE).exists():
        old = load_layout(layout.state_dir)
        state = running(old)
        if any(state.values()):
            if old == layout and all(state.values()):
                return f"sandbox in {layout.state_dir} is already up"
            raise SandboxError(
                f"sandbox: up: {layout.state_dir} already has running daemons "
                f"({', '.join(n for n, p in state.items() if p)}) with layout nodes={old.nodes} "
                f"leaves={old.leaves} port_base={old.port_base}; run `slurm-resilience sandbox "
                f"down --state-dir {layout.state_dir}` first")
    ensure_packages(runner, install=install)
    start = time.monotonic()
    write_files(layout)
    hardware.prepare_node_hardware(layout.state_dir, layout.node_names, fabric_of(layout))
    env = daemon_env(layout)
    try:
        for stage in STAGES:
            stage.start(layout, env)
        _wait_idle(layout, wait_s - (time.monotonic() - start))
        _wait_agents(layout, wait_s - (time.monotonic() - start))
    except Exception:
        try:
            down(layout)
        except SandboxError as exc:  # the start failure is the news; this comes with it
            log.error("sandbox: up failed and down left processes", error=str(exc))
        raise
    return (f"sandbox up in {time.monotonic() - start:.1f}s: {layout.nodes} nodes, "
            f"{layout.leaves} leaves, state {layout.state_dir}")


def unreachable_ancestor(path: Path) -> Path | None:
    """The first ancestor of ``path`` that other users cannot traverse, if any.

    Jobs of ordinary users read their scripts and outputs in the state dir and may
    run this checkout's Python; under e.g. /root (0700) they cannot.
    """
    for parent in [*reversed(path.parents), path]:
        if parent.exists() and not parent.stat().st_mode & 0o001:
            return parent
    return None


def _start_munge(layout: Layout, env: dict[str, str]) -> None:
    L = layout
    L.munge_socket.unlink(missing_ok=True)
    logs = [L.log_dir / "munged.out", L.log_dir / "munged.log"]
    daemons.start_forking(
        [tool("munged"), f"--socket={L.munge_socket}", f"--key-file={L.munge_key}",
         f"--pid-file={L.pid_file('munged')}", f"--log-file={L.log_dir / 'munged.log'}",
         f"--seed-file={L.munge_dir / 'munged.seed'}", "--force"],
        env=env, log_file=logs[0], name="munged", logs=logs[1:])
    if not daemons.wait_for(L.munge_socket, 10):
        raise failed("munged", f"did not create {L.munge_socket}", logs)
    L.munge_socket.parent.chmod(0o755)


def _start_accounting(layout: Layout, env: dict[str, str]) -> None:
    if not accounting.enabled(layout):
        return
    try:
        accounting.start(layout, env)
    except accounting.AccountingError as exc:
        raise SandboxError(str(exc)) from None


def _start_slurmctld(layout: Layout, env: dict[str, str]) -> None:
    L = layout
    conf = str(L.slurm_conf)
    # -c: a fresh sandbox starts without the jobs of an earlier run.
    logs = [L.log_dir / "slurmctld.out", L.log_dir / "slurmctld.log"]
    daemons.start_forking([tool("slurmctld"), "-f", conf, "-c"], env=env,
                          log_file=logs[0], name="slurmctld", logs=logs[1:])
    ctl = adapter(L, timeout=5)
    deadline = time.monotonic() + 15
    while not _ping(ctl):
        # exited(), not pid(): slurmctld creates its pid file before writing the pid, and
        # an empty pid file is a slurmctld still starting, not one that exited.
        if daemons.exited(slurmctld(L)):
            raise failed("slurmctld", "exited while starting", logs)
        if time.monotonic() > deadline:
            raise failed("slurmctld", "did not answer within 15s", logs)
        time.sleep(0.1)


def _start_slurmds(layout: Layout, env: dict[str, str]) -> None:
    for node in layout.node_names:
        start_slurmd(layout, node, env)


def start_slurmd(layout: Layout, node: str, env: dict[str, str]) -> None:
    """One node's slurmd (also to bring back a node killed by ``nodekill``)."""
    L = layout
    daemons.start_forking([tool("slurmd"), "-f", str(L.slurm_conf), "-N", node], env=env,
                          log_file=L.log_dir / f"slurmd-{node}.out", name=f"slurmd-{node}",
                          logs=[L.log_dir / f"slurmd-{node}.log"])


def _start_extras(layout: Layout, env: dict[str, str]) -> None:
    for make in EXTRAS:
        for extra in make(layout):
            daemons.spawn(extra.argv, log_file=layout.log_dir / f"{extra.daemon.name}.log",
                          pid_file=extra.daemon.pid_file, env={**env, **extra.env})


@dataclass(frozen=True)
class Stage:
    """One step of ``up``: the daemons it starts (for ``status``, the start checks and
    ``down``) and how it starts them, raising SandboxError naming the daemon that failed."""

    name: str
    daemons: Callable[[Layout], list[Daemon]]
    start: Callable[[Layout, dict[str, str]], None]


# `up` runs these in order; to add a daemon (e.g. slurmdbd before slurmctld), add a stage.
STAGES: list[Stage] = [
    Stage("munge", lambda L: [munged(L)], _start_munge),
    # slurmdbd (and its MariaDB) before slurmctld, as on a site; only with --accounting.
    Stage("accounting", lambda L: [], _start_accounting),
    Stage("slurmctld", lambda L: [slurmctld(L)], _start_slurmctld),
    Stage("slurmd", lambda L: [slurmd(L, n) for n in L.node_names], _start_slurmds),
    Stage("extras", extra_daemons, _start_extras),
]


def restart_slurmctld(layout: Layout, *, wait_s: float = 20.0) -> None:
    """Stop slurmctld and start it again keeping its state (jobs survive), e.g. after
    changing settings that ``scontrol reconfigure`` does not apply."""
    daemons.stop(slurmctld(layout))
    daemons.start_forking([tool("slurmctld"), "-f", str(layout.slurm_conf)],
                          env=daemon_env(layout), log_file=layout.log_dir / "slurmctld.out",
                          name="slurmctld", logs=[layout.log_dir / "slurmctld.log"])
    ctl = adapter(layout, timeout=5)
    deadline = time.monotonic() + wait_s
    while not _ping(ctl):
        if time.monotonic() > deadline:
            raise SandboxError("sandbox: restart: slurmctld did not answer\n"
                               + tail(layout.log_dir / "slurmctld.log"))
        time.sleep(0.1)


def _ping(ctl: SlurmAdapter) -> bool:
    try:
        return ctl.ping()
    except SlurmError:
        return False


def _daemon_logs(layout: Layout, daemon: Daemon) -> list[Path]:
    """A daemon's logs: what it printed (``.out``) and its own log file, where it has one."""
    out = [layout.log_dir / f"{daemon.name}.out", layout.log_dir / f"{daemon.name}.log"]
    return [p for p in out if p.exists()] or out[1:]


def _check_started(layout: Layout, started: list[Daemon]) -> None:
    """Raise naming the first daemon that has exited since it was started."""
    for daemon in started:
        if daemons.exited(daemon):
            raise failed(daemon.name, "exited while starting", _daemon_logs(layout, daemon))


def _wait_agents(layout: Layout, wait_s: float) -> None:
    """Wait until each node agent's hook server (``hooks.server: agent`` here) listens and
    its own socket answers a ping. The socket listens before the services start, and the
    ping is answered once they have: a test's first call never waits on their start."""
    from slurm_resilience.hooks import endpoint

    if not agent_extras(layout):
        return
    real = os.path.realpath(layout.resilience_conf)
    deadline = time.monotonic() + max(wait_s, 10.0)
    for node in layout.node_names:
        hooks = Path(endpoint.socket_path(real, node))
        sock = resilience_conf.agent_socket(layout, node)
        if not daemons.wait_listening(hooks, deadline - time.monotonic()):
            problem = f"its hook server did not listen at {hooks}"
        elif not _pinged(sock, deadline):
            problem = f"its socket {sock} did not answer a ping"
        else:
            continue
        agent = next(d for d in extra_daemons(layout) if d.name == f"agent-{node}")
        raise failed(agent.name, problem, _daemon_logs(layout, agent))


def _pinged(path: Path, deadline: float) -> bool:
    """Until ``deadline``: the agent at ``path`` answers (a socket file left by a killed
    agent refuses the connection, and one whose services still start queues it)."""
    while True:
        try:
            agent_call(str(path), "ping", timeout=max(0.1, deadline - time.monotonic()))
            return True
        except AgentUnavailable:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _wait_idle(layout: Layout, wait_s: float) -> None:
    """Wait until every node is IDLE, failing early, by name, when a daemon has exited."""
    ctl = adapter(layout, timeout=5)
    deadline = time.monotonic() + max(wait_s, 5.0)
    started = stage_daemons(layout)
    nodes: list[NodeInfo] = []
    while True:
        _check_started(layout, started)
        try:
            nodes = ctl.list_nodes()
        except SlurmError:
            nodes = []
        if len(nodes) == layout.nodes and all(ready(n) for n in nodes):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    seen = {n.name: n for n in nodes}
    stuck = [n for n in layout.node_names if n not in seen or not ready(seen[n])]
    states = ", ".join(f"{n.name}={n.state}{'+' if n.flags else ''}{'+'.join(sorted(n.flags))}"
                       f"{' (' + n.reason + ')' if n.reason else ''}" for n in nodes)
    never = [d.name for d in started if d.name.startswith("slurmd-") and not d.pid_file.exists()]
    what = (f"did not register as IDLE within {wait_s:.0f}s (slurmctld sees: {states or 'none'})"
            + (f"; no pid file from {', '.join(never)}" if never else ""))
    raise failed(", ".join(f"slurmd-{n}" for n in stuck) or "slurmd", what,
                 [layout.log_dir / "slurmctld.log"]
                 + [layout.log_dir / f"slurmd-{n}.log" for n in stuck[:2]], lines=10)


def ready(node: NodeInfo) -> bool:
    """IDLE and schedulable: not drained, down or still registering."""
    return node.state == "IDLE" and not (node.flags & {"DRAIN", "NOT_RESPONDING", "POWERED_DOWN",
                                                       "POWERING_UP", "NO_RESPOND"})


def down(layout: Layout, *, grace: float = 5.0) -> list[str]:
    """Stop everything of this sandbox; returns what was stopped (daemon names, then
    ``comm[pid]`` of every other process found).

    Jobs are cancelled first (so their epilogs run while slurmd is up), then the daemons
    named by pid files (all but munged at once, then munged, which the others may need
    while shutting down), then every other process of the sandbox (``slurmstepd``, jobs,
    idle verifiers and their ranks): TERM, then KILL after ``grace``; last, mounts left
    inside the state dir (a killed job's run-dir tmpfs) are detached. Raises SandboxError
    naming what is still running, or still mounted, after that.
    """
    _cancel_jobs(layout)
    everything = list(reversed(all_daemons(layout)))
    munge = [d for d in everything if d.program == "munged"]
    rest = [d for d in everything if d.program != "munged"]
    names = daemons.stop_all(rest, grace=grace) + daemons.stop_all(munge, grace=grace)
    swept, left = sweep.stop(layout.state_dir, env_match(layout), grace=grace)
    daemons.reap_all()
    if left:
        raise SandboxError("sandbox: down: still running after SIGKILL: " + ", ".join(
            f"{f.proc.comm}[{f.proc.pid}] ({f.why})" for f in left))
    # Jobs killed before their epilog ran leave their run-dir tmpfs mounted.
    unmounted, stuck = sweep.unmount_under(layout.state_dir)
    if stuck:
        raise SandboxError("sandbox: down: couldn't unmount " + ", ".join(stuck))
    return (names + [f"{f.proc.comm}[{f.proc.pid}]" for f in swept]
            + [f"mount {p}" for p in unmounted])


# States in which a job may still have processes on a node; the first ones can be cancelled.
CANCELLABLE_JOB_STATES = frozenset({"PENDING", "RUNNING", "CONFIGURING", "SUSPENDED",
                                    "REQUEUED", "RESIZING", "SIGNALING", "STOPPED"})
ACTIVE_JOB_STATES = CANCELLABLE_JOB_STATES | {"COMPLETING", "STAGE_OUT"}


def _cancel_jobs(layout: Layout, wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancel the sandbox's unfinished jobs and wait (bounded) for them to end, so their
    epilogs run; whatever is left is killed by ``down`` afterwards (and said so)."""
    if slurmctld(layout).pid() is None:
        return
    ctl = adapter(layout, timeout=5)
    try:
        jobs = [j for j in ctl.list_jobs() if j.state in ACTIVE_JOB_STATES]
    except SlurmError as exc:
        log.warning("sandbox: down: couldn't list jobs; their processes are killed",
                    error=str(exc))
        return
    for job in jobs:
        if job.state in CANCELLABLE_JOB_STATES:
            try:
                ctl.cancel(job.job_id)
            except SlurmError as exc:  # e.g. it ended meanwhile
                log.warning("sandbox: down: couldn't cancel a job", job_id=job.job_id,
                            error=str(exc))
    deadline = time.monotonic() + wait_s
    while jobs and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            jobs = [j for j in ctl.list_jobs() if j.state in ACTIVE_JOB_STATES]
        except SlurmError:
            break
    if jobs:
        log.warning("sandbox: down: jobs still ending; their processes are killed",
                    jobs=[j.job_id for j in jobs])


def status(layout: Layout) -> str:
    """Daemons with their pids, and the nodes as slurmctld sees them."""
    lines = [f"sandbox {layout.state_dir} (nodes={layout.nodes} leaves={layout.leaves} "
             f"port_base={layout.port_base})"]
    state = running(layout)
    metrics = {f"agent-{n}": layout.metrics_url(i) for i, n in enumerate(layout.node_names, 1)}
    for name, pid in state.items():
        extra = f"  metrics {metrics[name]}" if name in metrics else ""
        lines.append(f"  {name:<16} {'running, pid ' + str(pid) if pid else 'stopped'}{extra}")
    if state.get("slurmctld"):
        try:
            for n in adapter(layout, timeout=5).list_nodes():
                flags = "+" + "+".join(sorted(n.flags)) if n.flags else ""
                reason = f"  reason: {n.reason}" if n.reason else ""
                lines.append(f"  {n.name:<8} {n.state}{flags:<12} features={','.join(n.features)}"
                             f"{reason}")
        except SlurmError as exc:
            lines.append(f"  nodes: couldn't list: {exc}")
    return "\n".join(lines)


def env_lines(layout: Layout) -> list[str]:
    """Shell ``export`` lines for using this sandbox."""
    s3 = s3_info(layout)
    return [
        f"export SLURM_CONF={layout.slurm_conf}",
        f"export SLURM_RESILIENCE_CONFIG={layout.resilience_conf}",
        f"export AWS_ENDPOINT_URL={s3.endpoint}",
        f"export S3_ENDPOINT_URL={s3.endpoint}",
        f"export S3_BUCKET={s3.bucket}",
        f"export AWS_ACCESS_KEY_ID={s3.access_key}",
        f"export AWS_SECRET_ACCESS_KEY={s3.secret_key}",
        "export AWS_DEFAULT_REGION=us-east-1",
    ]
