"""The checkpoint service's restore side: run a job's stage-in, answer ``ckpt.status``'s
stage-in fields and ``ckpt.fetch`` (the upload side lives in service.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from slurm_resilience.checkpoint.commit import CheckpointError, step_name
from slurm_resilience.checkpoint.prefix import parse_uri
from slurm_resilience.checkpoint.staging import open_job_dir, set_aside_step
from slurm_resilience.config import Config
from slurm_resilience.log import get_logger
from slurm_resilience.uploader import s3_reach
from slurm_resilience.uploader.deadline import endpoint_name
from slurm_resilience.uploader.fetch import FetchJob, FetchSettings, RangeFetcher, parse_ranges
from slurm_resilience.uploader.journal import (
    FallbackDoc,
    JobRecord,
    StageinDoc,
    StageinState,
    pending_steps,
)
from slurm_resilience.uploader.records import AllowOlder
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.stage_agreed import stage_step
from slurm_resilience.uploader.stagein import (
    Fallback,
    StageinFailed,
    StageinPolicy,
    StageinResult,
    StepStillUploading,
    stage_in,
)

if TYPE_CHECKING:
    from slurm_resilience.agent.service import Request
    from slurm_resilience.uploader.service import Uploader

log = get_logger("checkpoint.stagein")


def policy(cfg: Config) -> StageinPolicy:
    ck = cfg.checkpoint
    return StageinPolicy(retry_s=ck.stagein_retry_s, intent_wait_s=ck.stagein_intent_wait_s,
                         intent_fallback=ck.stagein_intent_fallback,
                         poll_s=min(2.0, max(0.1, ck.stagein_intent_wait_s / 10)),
                         endpoint=endpoint_name(ck.s3_endpoint, ck.s3_region))


def make_fetcher(cfg: Config, s3: Callable[[], S3]) -> RangeFetcher:
    ck = cfg.checkpoint
    settings = FetchSettings(concurrency=ck.fetch_concurrency,
                             request_bytes=int(ck.fetch_request_bytes),
                             max_per_job=ck.fetch_max_per_job, retry_s=ck.stagein_retry_s)
    return RangeFetcher(settings, s3, policy(cfg))


def run_stagein(up: Uploader, rec: JobRecord) -> StageinDoc:
    """Stage the job's newest committed step in, on a stage-in thread over the working
    copy ``rec``; the journal's ``stagein`` record, for the record owner to keep (it
    also marks a step taken from S3 committed: never uploaded again)."""
    started = time.monotonic()
    job_id = int(rec["job_id"])
    try:
        uri = parse_uri(rec["uri"]) if rec["uri"] else None
        with open_job_dir(rec["staging_root"], job_id) as jfd:

            def upload_local(step: int) -> None:
                # The upload worker skips a job while its stage-in runs, so this is the
                # only upload of the job's steps right now.
                assert uri is not None
                log.info("stage-in: uploading this node's part of a step still uploading",
                         job_id=job_id, step=step)
                try:
                    up.upload_step(rec, jfd, uri, step)
                except (CheckpointError, OSError) as exc:
                    log.warning("stage-in: couldn't upload this node's part", job_id=job_id,
                                step=step, error=str(exc))

            def set_aside(step: int, why: str) -> None:
                # Out of the job's sight (a later save(step) must not find its COMMIT.json),
                # never uploaded again (the job moved on from it), removed by the agent.
                set_aside_step(rec["staging_root"], job_id, jfd, step_name(step),
                               f"stage-in passed over step {step}: {why}")
                up.abandon_step(rec, step, f"passed over by stage-in and set aside: {why}")

            wanted = rec.get("stagein_wanted")
            res = _when_s3_refuses(up, rec, jfd, wanted) if uri is not None else None
            if res is not None:
                pass  # the job's nodes gave it: S3 takes no connection now
            elif wanted is not None and uri is not None and wanted not in excluded_steps(rec):
                try:  # ckpt.stage: that step or an error
                    res = stage_step(up.s3, uri, jfd, int(rec["uid"]), int(rec["gid"]),
                                     wanted, policy(up.cfg))
                except StageinFailed as exc:
                    up.fetcher.note_s3_unreachable()  # the ranks' fetches: peers first
                    # The job's ranks agreed the step is committed (on the nodes that kept
                    # running): a part S3 never got may be on its node's buddy.
                    got = _through_buddies(up, rec, jfd, set(), str(exc), force=True)
                    if got is None or got.step != wanted:
                        raise
                    res = got
            else:
                try:
                    res = stage_in(up.s3 if uri else None, uri, jfd, int(rec["uid"]),
                                   int(rec["gid"]), policy(up.cfg), upload_local=upload_local,
                                   exclude=excluded_steps(rec), set_aside=set_aside,
                                   allow_older=lambda: up.tell(AllowOlder(job_id)))
                except StageinFailed as exc:
                    if not isinstance(exc, StepStillUploading):
                        up.fetcher.note_s3_unreachable()  # the ranks' fetches: peers first
                    # S3 down, or a step still uploading from a node that is gone: the
                    # job's nodes may hold it (buddy copies); if not, the error stands.
                    got = _through_buddies(up, rec, jfd, set(), str(exc))
                    if got is None:
                        raise
                    res = got
                else:
                    if uri is not None and up.buddy is not None and \
                            up.buddy.newer_held(job_id, res.step):
                        res = _through_buddies(
                            up, rec, jfd, {res.step} if res.source == "s3" and
                            res.step is not None else set(), "") or res
        result: StageinDoc = {
            "state": StageinState.DONE, "step": res.step, "source": res.source, "mode": res.mode,
            "fetched_bytes": res.fetched_bytes,
            "fallbacks": [_fallback_doc(f) for f in res.fallbacks],
            "seconds": round(time.monotonic() - started, 3)}
        if res.remote is not None and res.step is not None:
            up.fetcher.remember(job_id, res.step, res.remote)
        if res.fallbacks:
            log.warning("stage-in fell back to an older step", job_id=job_id, step=res.step,
                        passed_over=[f.step for f in res.fallbacks])
    except (CheckpointError, OSError) as exc:
        error = str(exc)
        if isinstance(exc, FileNotFoundError) and _staging_gone(rec):
            # Not the cause: whatever stage-in was waiting for outlasted the job's dir.
            error = (f"checkpoint: stage-in: job {job_id}'s staging dir is gone (the job "
                     "ended, or its load gave up after checkpoint.stagein_timeout_s, and the "
                     f"epilog removed it) while stage-in ran; it stopped at: {exc}")
        result = {"state": StageinState.FAILED, "step": None, "error": error,
                  "seconds": round(time.monotonic() - started, 3)}
        if isinstance(exc, StepStillUploading):  # a later opt-in (ckpt.register) reruns it
            result["still_uploading"] = exc.step
        log.error("stage-in failed", job_id=job_id, error=error)
    return result


def _when_s3_refuses(up: Uploader, rec: JobRecord, jfd: int,
                     wanted: int | None) -> StageinResult | None:
    """The step from the job's nodes at once when S3's endpoint takes no connection now
    (s3_reach.py), instead of retrying S3 for stagein_retry_s first; None when S3 takes
    connections, or the job's nodes can't give the step (S3 is then tried as always)."""
    if up.buddy is None or excluded_steps(rec):
        return None  # the job's nodes would not know which steps the restore found corrupt
    ck = up.cfg.checkpoint
    why = s3_reach.refusing(ck.s3_endpoint)
    if not why:
        return None
    up.fetcher.note_s3_unreachable()  # the ranks' fetches: peers first too
    endpoint = endpoint_name(ck.s3_endpoint, ck.s3_region)
    log.warning("stage-in: S3 takes no connection; asking the job's nodes first",
                job_id=int(rec["job_id"]), endpoint=endpoint, error=why)
    got = _through_buddies(up, rec, jfd, set(),
                           f"S3 endpoint {endpoint} takes no connection: {why}",
                           force=wanted is not None)
    if got is None or (wanted is not None and got.step != wanted):
        return None
    return got


def _through_buddies(up: Uploader, rec: JobRecord, jfd: int, s3_steps: set[int],
                     s3_error: str, force: bool = False) -> StageinResult | None:
    """The newest step through the job's nodes (buddy_peers.stage), when they hold a
    newer step than S3 gave, or S3 failed; None otherwise. ``force``: ask them even when
    this node has nothing of the run (the job's ranks said the step exists)."""
    if up.buddy is None or not rec.get("uri"):
        return None
    staged = up.buddy.stage(int(rec["job_id"]), jfd, int(rec["gid"]), s3_steps, s3_error,
                            force=force)
    if staged is None:
        return None
    return StageinResult(staged.choice.step, "buddy", "metadata", staged.nbytes,
                         tuple(Fallback(p.step, p.reason) for p in staged.choice.passed_over),
                         None)


def _staging_gone(rec: JobRecord) -> bool:
    try:
        with open_job_dir(rec["staging_root"], int(rec["job_id"])):
            return False
    except FileNotFoundError:
        return True
    except (CheckpointError, OSError):
        return False


def _fallback_doc(f: Fallback) -> FallbackDoc:
    doc: FallbackDoc = {"step": f.step, "reason": f.reason}
    if f.opt_in:
        doc["opt_in"] = f.opt_in
    return doc


class StageinStatus(TypedDict):
    """The stage-in fields of a ``ckpt.status`` answer."""

    stagein: str  # a StageinState's value, or "none" for a local-only job
    step: int | None
    error: str | None
    source: str | None
    mode: str | None
    fallbacks: list[FallbackDoc]
    stagein_bytes: int
    pending: list[int]
    uri: str | None


def stagein_status(rec: JobRecord) -> StageinStatus:
    """The stage-in fields of ``ckpt.status``, as the checkpoint contract names them."""
    si = rec["stagein"]
    state = str(StageinState(si.get("state", StageinState.PENDING)).value)
    if not rec["uri"]:
        state = "none"  # local-only: nothing to stage in
    elif state == StageinState.PENDING:
        state = StageinState.RUNNING.value  # about to start (or again after an agent restart)
    return {"stagein": state, "step": si.get("step"), "error": si.get("error"),
            "source": si.get("source"), "mode": si.get("mode"),
            "fallbacks": list(si.get("fallbacks") or []),
            "stagein_bytes": int(si.get("fetched_bytes") or 0), "pending": pending_steps(rec),
            "uri": rec["uri"]}


def excluded_steps(rec: JobRecord) -> dict[int, str]:
    """Steps the job's restore found corrupt (``ckpt.restage``), to be passed over."""
    raw = rec.get("stagein_excluded")
    if not isinstance(raw, dict):
        return {}
    return {int(k): str(v) for k, v in raw.items() if str(k).isdigit()}


def fetch_for(fetcher: RangeFetcher, rec: JobRecord, request: Request) -> dict[str, int]:
    """Answer ``ckpt.fetch`` for a job whose owner the caller was checked to be."""
    step = request.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint: fetch: step {step!r} is not a step number")
    job = FetchJob(job_id=int(rec["job_id"]), uid=int(rec["uid"]), gid=int(rec["gid"]),
                   staging_root=str(rec["staging_root"]),
                   uri=parse_uri(rec["uri"]) if rec["uri"] else None)
    return fetcher.fetch(job, step, parse_ranges(request.get("ranges")))
