"""Before a job is requeued away from a lost node: its newest step committed here is
announced in S3 first.

A requeued run's stage-in takes the newest step S3 shows, committed or announced by an
intent record (which it waits for). After an S3 outage every node's uploader is backing
off, so the step the job committed last may have no intent record in S3 yet when the
requeued run lists the run: it would resume from an older step. The agent that requeues
the job holds it (requeued, held) while this node's uploader tries the job at once and
writes the intent record of that step, bounded by ``checkpoint.requeue_announce_wait_s``;
the job is released either way, and a step left unannounced is said.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.checkpoint.staging import open_job_dir
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.journal import DONE_STATES
from slurm_resilience.uploader.owner import Command
from slurm_resilience.uploader.rootfs import committed_steps_at

if TYPE_CHECKING:
    from slurm_resilience.uploader.service import Uploader

log = get_logger("checkpoint.uploader")
POLL_S = 0.2


@dataclass(frozen=True)
class Hurry(Command["Uploader", bool]):
    """Try the job's uploads at the next tick, whatever its back-off (False: not tracked)."""

    job_id: int

    def apply(self, up: Uploader) -> bool:
        up.owner.check("hurry a job")
        up.backoff.pop(self.job_id, None)
        return self.job_id in up.jobs


def _newest_local(up: Uploader, job_id: int, root: str) -> int | None:
    try:
        with open_job_dir(root, job_id) as jfd:
            steps = committed_steps_at(jfd)
    except FileNotFoundError:
        return None  # nothing staged here for the job
    except (CheckpointError, OSError) as exc:
        log.error("checkpoint: couldn't read the job's staging dir before its requeue; its "
                  "newest step here is not announced", job_id=job_id, error=str(exc))
        return None
    return max(steps) if steps else None


def announce_now(up: Uploader, job_id: int, wait_s: float, clock: Clock | None = None) -> str:
    """Hurry the job's upload until its newest step committed here is announced in S3
    (intent record written, or the step done), for at most ``wait_s``. '' when it is (or
    there is nothing to announce), else why not."""
    clock = clock or SystemClock()
    rec = up.current(job_id)
    if rec is None or not rec.get("uri") or wait_s <= 0:
        return ""
    newest = _newest_local(up, job_id, rec["staging_root"])
    if newest is None:
        return ""
    deadline = clock.monotonic() + wait_s
    while True:
        rec = up.current(job_id)
        st = rec["steps"].get(str(newest), {}) if rec is not None else {}
        if rec is None or st.get("intent") or st.get("state") in DONE_STATES:
            log.info("checkpoint: the newest step committed here is announced in S3 before "
                     "the job's requeue", job_id=job_id, step=newest)
            return ""
        if clock.monotonic() >= deadline:
            why = (f"step {newest}, committed on {up.node}, is not announced in S3 after "
                   f"{wait_s:g}s (checkpoint.requeue_announce_wait_s; S3 unreachable?): the "
                   "requeued run may resume from an older step unless this node's upload "
                   "announces it before the run lists S3")
            log.error(f"checkpoint: {why}", job_id=job_id, step=newest)
            return why
        if up.tell(Hurry(job_id)):
            up.tick()
        clock.sleep(POLL_S)
