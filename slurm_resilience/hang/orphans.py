"""A job that lost its batch host but kept running: under ``sbatch --no-kill`` Slurm (22.05
measured) removes a failed batch host from the job like any other node, and the job stays
RUNNING on the others with its script gone, holding them until its time limit. The agent
of the job's first surviving node requeues it away from the lost host (the node-fault
requeue), since the launcher and the batch host's agent, which decide otherwise, went
with it.

Cheap on Slurm: only jobs with no live rank on this node, where this node is not the first
of the job (the batch host Slurm picks), are looked at, at most every ``CHECK_EVERY_S``:
one ``scontrol show node`` of their first nodes, and ``scontrol show job`` only for a job
whose first node Slurm shows DOWN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from slurm_resilience import events
from slurm_resilience.config import Config
from slurm_resilience.hang import evidence
from slurm_resilience.hang.localpiece import JobView
from slurm_resilience.health import faultrequeue as FR
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import JobNotFound, SlurmError
from slurm_resilience.slurm.parse import JobInfo, NodeInfo

log = get_logger("heartbeat")

CHECK_EVERY_S = 30.0


def quiet_jobs(views: Iterable[JobView], node: str) -> dict[int, str]:
    """Jobs on this node with no live rank here, where this node is not the job's first
    node: {job id: its first node}."""
    out = {}
    for view in views:
        rec = view.record
        if not rec.nodes or rec.nodes[0] == node:
            continue
        if any(evidence.same_process(v.pid, v.pid_start, rec.uid) for v in view.slots):
            continue
        out[rec.job_id] = rec.nodes[0]
    return out


def orphaned(job: JobInfo, host: NodeInfo | None, node: str) -> str:
    """Pure: why this node's agent must requeue ``job`` ('' when it must not): the job runs
    on without its batch host, which Slurm shows DOWN, and this node is its first survivor."""
    state = job.state.split("+")[0]
    if state != "RUNNING" or not job.batch_host or job.batch_host in job.nodes:
        return ""
    if host is None or host.state != "DOWN":
        return ""
    if not job.nodes or job.nodes[0] != node:
        return ""  # another survivor acts
    return (f"job {job.job_id} runs on {','.join(job.nodes)} without its batch host "
            f"{job.batch_host} ({host.state.lower()}"
            + (f": {host.reason}" if host.reason else "") + "): its script was lost with it")


def check(cfg: Config, adapter: SlurmAdapter, node: str, views: Sequence[JobView],
          before_release: Callable[[int], object] | None = None) -> list[str]:
    """Requeue the jobs on this node that lost their batch host; what was done.
    ``before_release(job_id)`` runs while a requeued job is still held."""
    quiet = quiet_jobs(views, node)
    if not quiet:
        return []
    try:
        hosts = adapter.show_nodes(sorted(set(quiet.values())))
    except SlurmError as exc:
        log.warning("heartbeat: couldn't read the batch hosts of quiet jobs", error=str(exc))
        return []
    done = []
    for job_id, first in quiet.items():
        info = hosts.get(first)
        if info is None or info.state != "DOWN":
            continue
        try:
            job = adapter.show_job(job_id)
        except (JobNotFound, SlurmError):
            continue  # gone, or Slurm busy: the next check looks again
        done += _act(cfg, adapter, node, job, hosts.get(job.batch_host, info),
                     before_release)
    return done


def _act(cfg: Config, adapter: SlurmAdapter, node: str, job: JobInfo,
         host: NodeInfo, before_release: Callable[[int], object] | None = None) -> list[str]:
    why = orphaned(job, host, node)
    if not why:
        return []
    d = FR.decide(job, exit_code=1, cap=cfg.health.fault_requeue_max)
    if d.action != "requeue":
        if d.action == "leave":
            events.count(adapter.events_path, events.NODE_LOSS, "leave")
            log.error(f"heartbeat: {why}; not requeued: {d.reason} (cancel it: it can't end "
                      "by itself)", job_id=job.job_id)
        return [f"{why}; {d.reason}"]
    ok, what = FR.requeue_away(adapter, job, d.ledger, [job.batch_host],
                               f"node fault on {job.batch_host}: the batch host was lost",
                               before_release=before_release)
    events.count(adapter.events_path, events.NODE_LOSS, "requeue")
    log.warning(f"heartbeat: {why}: requeued" if ok else f"heartbeat: {why}: {what}",
                job_id=job.job_id, done=what)
    return [f"{why}; {what}"]

