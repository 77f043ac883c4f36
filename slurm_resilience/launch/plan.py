"""Pure: where the step runs, which nodes wait as spares, and the srun command line and
environment of each launch. Nothing here runs a process or reads the environment."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurm_resilience.heartbeat import attempt as A
from slurm_resilience.slurm.parse import expand_hostlist

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
STEP_NAME = "sr-launch"


class PlanError(ValueError):
    """The allocation can't hold the step as asked; the message says why."""


@dataclass(frozen=True)
class Allocation:
    """What the batch script's environment says about the job."""

    job_id: int
    nodes: tuple[str, ...]
    batch_host: str
    tasks_per_node: int
    restarts: int  # Slurm's SLURM_RESTART_COUNT


@dataclass(frozen=True)
class Placement:
    """One launch: the step's nodes, the spares left, which nodes are new to the step."""

    relaunch: int
    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    joined: tuple[str, ...] = ()


def tasks_per_node(env: Mapping[str, str]) -> int:
    """The job's tasks per node (SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE when the
    same on every node): the step keeps it."""
    given = env.get("SLURM_NTASKS_PER_NODE", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    counts = set()
    for part in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        m = _TASKS.match(part.strip())
        if not m:
            raise PlanError(f"SLURM_TASKS_PER_NODE {env.get('SLURM_TASKS_PER_NODE', '')!r} is "
                            "not Slurm's N(xM),... form; run launch inside a batch job")
        counts.add(int(m.group(1)))
    if len(counts) != 1 or 0 in counts:
        raise PlanError(f"the job's tasks per node differ ({env['SLURM_TASKS_PER_NODE']}); "
                        "submit with --ntasks-per-node so every node runs as many")
    return counts.pop()


def allocation(env: Mapping[str, str]) -> Allocation:
    job = env.get("SLURM_JOB_ID", "")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    if not job.isdigit() or not nodelist:
        raise PlanError("no SLURM_JOB_ID and SLURM_JOB_NODELIST: run launch in the job's "
                        "batch script (sbatch)")
    nodes = tuple(expand_hostlist(nodelist))
    host = env.get("SLURMD_NODENAME", "")
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return Allocation(int(job), nodes, host if host in nodes else nodes[0],
                      tasks_per_node(env), int(restarts) if restarts.isdigit() else 0)


def first(alloc: Allocation, spares: int) -> Placement:
    """The step on all nodes less ``spares``; the spares are the last nodes of the
    allocation other than the batch host (the launcher's own node keeps running it)."""
    if spares < 0 or spares >= len(alloc.nodes):
        raise PlanError(f"--spares {spares} leaves no node for the step: the job has "
                        f"{len(alloc.nodes)} node{'s' if len(alloc.nodes) != 1 else ''}")
    others = [n for n in alloc.nodes if n != alloc.batch_host]
    kept = set(others[len(others) - spares:]) if spares else set()
    return Placement(0, tuple(n for n in alloc.nodes if n not in kept),
                     tuple(n for n in alloc.nodes if n in kept))


def after(current: Placement, relaunch: int, nodes: Sequence[str]) -> Placement:
    """The placement the agent's order names: spares it took join the step, nodes it took
    out leave it and are not spares any more."""
    joined = tuple(n for n in nodes if n not in current.nodes)
    unknown = [n for n in joined if n not in current.spares]
    if unknown or len(set(nodes)) != len(nodes) or not nodes:
        raise PlanError(f"the agent's order names nodes {','.join(nodes)} that are not this "
                        f"step's nodes or spares")
    return Placement(relaunch, tuple(nodes),
                     tuple(s for s in current.spares if s not in joined), joined)


def with_spares(place: Placement, nodes: Sequence[str]) -> Placement:
    """``place`` with ``nodes`` among its spares again, after those it has (nodes of the
    step or spares already are left as they are)."""
    new = tuple(n for n in dict.fromkeys(nodes) if n not in place.nodes and n not in place.spares)
    return Placement(place.relaunch, place.nodes, place.spares + new, place.joined)


def srun_argv(srun: str, alloc: Allocation, place: Placement, command: Sequence[str],
              extra: Sequence[str] = ()) -> list[str]:
    n = len(place.nodes)
    # A step that lost a node stays in slurmctld, holding its CPUs on the survivors, until
    # the job ends (the lost node never reports its part done): a relaunch overlaps it.
    overlap = ["--overlap"] if place.relaunch > 0 else []
    return [srun, f"--nodes={n}", f"--ntasks={n * alloc.tasks_per_node}",
            f"--ntasks-per-node={alloc.tasks_per_node}", f"--nodelist={','.join(place.nodes)}",
            "--kill-on-bad-exit=1", *overlap, f"--job-name={STEP_NAME}-{place.relaunch}",
            *extra, "--", *command]


def step_env(base: Mapping[str, str], alloc: Allocation, place: Placement) -> dict[str, str]:
    """srun's environment: the job's, the relaunch count, the restart count (requeues plus
    relaunches) and the nodes that joined at this relaunch (a restore fetches there)."""
    env = dict(base)
    env[A.ENV_RELAUNCH] = str(place.relaunch)
    env[A.ENV_RESTART_COUNT] = str(alloc.restarts + place.relaunch)
    env[A.ENV_JOINED] = ",".join(place.joined)
    # The batch step's own counts would contradict the step's size; SLURM_NO_KILL would
    # keep a step whose node failed running (it must end, to be relaunched).
    for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_NO_KILL"):
        env.pop(name, None)
    return env
