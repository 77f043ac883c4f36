"""``ckpt.stage``: stage in the one step the job's ranks agreed on (agent side).

When ranks disagree and the newest step is committed in S3 (agree.py), a node whose
stage-in chose an older step (its agent listed S3 before that step's commit landed, or
fetching it failed transiently) is brought up to it: the node's local leader asks its
agent for exactly that step. It runs as the job's stage-in (the same record, status and
waits in ``load_latest``), fetching only that step, bounded by the stage-in deadlines
(checkpoint.stagein_retry_s). It never takes another step: a step that isn't committed
in S3, or doesn't verify, fails the stage-in with that cause.
"""

from __future__ import annotations

from slurm_resilience.checkpoint.prefix import S3Uri
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.s3 import S3, S3Error
from slurm_resilience.uploader.stagein import (
    StageinFailed,
    StageinPolicy,
    StageinResult,
    SystemClock,
    list_run,
    retrying,
    stage_remote,
)

log = get_logger("checkpoint.stagein")


def stage_step(s3: S3, uri: S3Uri, job_fd: int, uid: int, gid: int, step: int,
               policy: StageinPolicy) -> StageinResult:
    """Bring what a restore of ``step`` needs from S3, or raise naming why it can't."""
    clock = SystemClock()
    # A node that joined a relaunch asks as soon as the step restarts: the other nodes'
    # uploads of the step may still be landing, so its commit is waited for (bounded).
    deadline = clock.monotonic() + policy.intent_wait_s
    while True:
        listing = retrying(f"list {uri}", lambda: list_run(s3, uri), policy, clock)
        if step in listing.committed:
            break
        if clock.monotonic() >= deadline:
            raise StageinFailed(f"checkpoint: stage-in: step {step} is not committed in {uri} "
                                f"(no COMMIT.json after {policy.intent_wait_s:g}s)")
        clock.sleep(policy.poll_s)
    try:
        remote, mode, nbytes = stage_remote(s3, uri, step, listing.committed[step], job_fd,
                                            uid, gid, policy, clock)
    except S3Error as exc:
        raise StageinFailed(f"checkpoint: stage-in: step {step}: {exc}") from None
    log.info("stage-in: staged the step the ranks agreed on from S3", step=step,
             uri=str(uri), mode=mode, bytes=nbytes)
    return StageinResult(step, "s3", mode, nbytes, (), remote)
