"""The upload of one committed step: its files, then each rank's manifest, then
COMMIT.json once every rank of the save is in S3 (the uploader's ``sync_job`` calls it).

It runs on a worker (a job's sync or its stage-in) over the worker's working copy of the
job's record: every change of a step is reported to the record owner (``report_step``),
which writes the journal; nothing here touches the owner's records.

Before each file and manifest it writes, the upload checks that the step is still its
save's in S3 (``check_save``): a later save, or a commit by another save, stops it
without mixing its keys in. A step that must not be uploaded is rejected (``reject``),
its unfinished uploads aborted.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CommitMarker,
    Crc32c,
    Manifest,
    parse_rank,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri, parse_uri
from slurm_resilience.checkpoint.staging import (
    open_dir_at,
    open_owned_file,
)
from slurm_resilience.log import get_logger
from slurm_resilience.uploader import buddy_handoff, intent
from slurm_resilience.uploader.journal import (
    DONE_STATES,
    FileDoc,
    JobRecord,
    StepState,
)
from slurm_resilience.uploader.records import OrphansDue, StaleDue
from slurm_resilience.uploader.rootfs import read_small, read_step
from slurm_resilience.uploader.s3 import (
    S3Error,
    TransientS3Error,
    error_code,
)
from slurm_resilience.uploader.s3_multipart import (
    MultipartState,
    PartResult,
    PartsDropped,
    PartUploaded,
    UploadEvent,
    UploadStarted,
)

if TYPE_CHECKING:
    from slurm_resilience.uploader.service import Uploader

log = get_logger("checkpoint.uploader")

ORPHAN_AGE_S = 24 * 3600.0


class SaveSuperseded(CheckpointError):
    """Another save of the step owns it in S3 (committed it, or a newer save is under
    way): this upload stops before writing anything more."""


class CommittedBySave(Exception):
    """Our own save of the step is already committed in S3 (another node wrote it)."""


def new_save(up: Uploader, rec: JobRecord, jfd: int, step: int) -> bool:
    """Whether the local step is a new save of a step whose journal entry is finished
    (rejected or failed for an earlier save, e.g. one stage-in set aside before the
    job saved the step again): the entry starts over for the new save."""
    st = rec["steps"].get(str(step), {})
    if "save_id" not in st or st.get("state") not in (StepState.REJECTED,
                                                      StepState.FAILED):
        return False
    try:
        marker, _ = read_step(jfd, step, int(rec["uid"]))
    except (CheckpointError, OSError):
        return False
    if marker.save_id == st["save_id"]:
        return False
    log.info("a new save of a step whose earlier save was not uploaded; uploading it",
             job_id=rec["job_id"], step=step, save_id=marker.save_id,
             earlier_save_id=st["save_id"], earlier_state=str(st.get("state")))
    rec["steps"][str(step)] = {"state": StepState.PENDING, "files": {},
                               "since": time.time()}
    up.report_step(rec, step)
    return True


def check_save(up: Uploader, uri: S3Uri, step: int, save_id: str) -> None:
    """Raise SaveSuperseded when another save owns ``step`` in S3: its COMMIT.json
    holds another save id, or a newer save of the step is announced (``SAVE-<id>``);
    CommittedBySave when our own save is committed there already. Called before
    every file and manifest an upload writes, so an agent that comes back with an
    old upload stops before it touches a newer save's keys. Legacy uploads (no save
    id) keep the older rule (``upload_step``), except that any save with an id is
    newer than them."""
    sname = step_name(step)
    newer = sorted(i for i in intent.saves_of(up.s3, uri, step) if i > save_id)
    if not save_id:
        if newer:
            raise SaveSuperseded(f"{uri}/{sname}: a newer save of step {step} is in S3 "
                                 f"(save {newer[-1]}); this upload (written before "
                                 "save ids) stops and is not mixed into it")
        return
    commit_key = uri.join(sname, COMMIT)
    try:
        body = up.s3.get_bytes(uri.bucket, commit_key, limit=1024**2)
    except S3Error as exc:
        if error_code(exc.__cause__ or exc) not in ("NoSuchKey", "404", "NotFound"):
            raise
        body = None
    if body is not None:
        theirs = CommitMarker.from_json(body, f"{uri}/{sname}/{COMMIT}")
        if theirs.save_id == save_id:
            raise CommittedBySave()
        raise SaveSuperseded(f"{uri}/{sname} is already committed in S3 by another save "
                             f"(save {theirs.save_id or '(legacy, none)'}, ours "
                             f"{save_id}); this upload stops and is not mixed into it")
    if newer:
        raise SaveSuperseded(f"{uri}/{sname}: a newer save of step {step} is under way "
                             f"in S3 (save {newer[-1]}, ours {save_id}); this upload "
                             "stops and is not mixed into it")


def upload_step(up: Uploader, rec: JobRecord, jfd: int, uri: S3Uri, step: int) -> None:
    uid = int(rec["uid"])
    sname = step_name(step)
    steps = rec["steps"]
    st = steps.setdefault(str(step), {"state": StepState.PENDING, "files": {},
                                      "since": time.time()})
    st.setdefault("files", {})
    try:
        marker, manifests = read_step(jfd, step, uid)
    except (CheckpointError, OSError) as exc:
        reject(up, rec, step, f"unreadable commit marker or manifest: {exc}")
        return
    save_id = marker.save_id
    stale = {r: m.save_id for r, m in manifests.items() if m.save_id != save_id}
    if stale:  # left in the step dir by an abandoned save: never uploaded with this one
        log.warning("rank parts of another save in the local step dir; not uploaded",
                    job_id=rec["job_id"], step=step, save_id=save_id, stale=stale)
        manifests = {r: m for r, m in manifests.items() if r not in stale}
        if not manifests:
            reject(up, rec, step, f"no rank part of this node belongs to the step's "
                                    f"save {save_id or '(legacy, none)'} ({stale})")
            return
    st["save_id"] = save_id
    st["world_size"] = marker.world_size
    st["bytes"] = sum(f.size for m in manifests.values() for f in m.files)  # the backlog
    commit_key = uri.join(sname, COMMIT)
    if not save_id and not any(f.get("done") for f in st["files"].values()) and \
            up.s3.head(uri.bucket, commit_key) is not None:
        # Another job of this run committed this step: never mix our files into it.
        reject(up, rec, step, f"{uri}/{sname} is already committed in S3 by another "
                                "job of this run; ours is not uploaded", StepState.FAILED,
                     delete_ours=False)
        return
    try:
        check_save(up, uri, step, save_id)
        intent.announce(up.s3, uri, rec, st, marker, sorted(manifests), up.node)
        uploaded = upload_parts(up, rec, jfd, uri, step, manifests)
    except (SaveSuperseded, CommittedBySave) as exc:
        settle_not_ours(up, rec, step, uri, exc)
        return
    if uploaded:
        commit(up, rec, uri, step, marker, manifests)


def upload_parts(up: Uploader, rec: JobRecord, jfd: int, uri: S3Uri, step: int,
                  manifests: dict[int, Manifest]) -> bool:
    """Every file of this node's ranks, then each rank's manifest, each written only
    after ``_check_save`` found the step still ours in S3. False when the step was
    rejected on the way (it must not be committed)."""
    uid, sname, st = int(rec["uid"]), step_name(step), rec["steps"][str(step)]
    save_id = str(st.get("save_id", ""))

    def check() -> None:
        check_save(up, uri, step, save_id)

    sfd = open_dir_at(jfd, sname)
    try:
        for rank, manifest in manifests.items():
            for f in manifest.files:
                key = uri.join(sname, rank_name(rank), f.path)
                frec = st["files"].setdefault(key, {"done": False})
                if frec["done"]:
                    continue
                check()
                try:
                    fd = open_owned_file(sfd, f"{rank_name(rank)}/{f.path}", uid)
                except (CheckpointError, OSError) as exc:
                    reject(up, rec, step, f"{rank_name(rank)}/{f.path}: {exc}")
                    return False
                try:
                    if os.fstat(fd).st_size != f.size:
                        reject(up, rec, step, f"{rank_name(rank)}/{f.path}: size "
                                     f"{os.fstat(fd).st_size}, manifest says {f.size}")
                        return False
                    up.s3.upload_fd(fd, f.size, f.crc32c, uri.bucket, key, resume_of(frec),
                                    functools.partial(keep_event, up, rec, step, frec),
                                    blocks=f.blocks, block_size=f.block_size,
                                    owner=f"job-{rec['job_id']}", before_write=check)
                finally:
                    os.close(fd)
                frec.pop("upload_id", None)
                frec.pop("parts", None)
                frec["done"] = True
                up.report_step(rec, step)
            mkey = uri.join(sname, rank_name(rank), MANIFEST)
            if not st["files"].get(mkey, {}).get("done"):
                body = read_small(sfd, f"{rank_name(rank)}/{MANIFEST}", uid)
                if Manifest.from_json(body, mkey).save_id != save_id:
                    raise CheckpointError(f"checkpoint: upload: {sname}/{rank_name(rank)}"
                                          f"/{MANIFEST} changed while uploading")
                crc = Crc32c()
                crc.update(body)
                check()
                up.s3.put_bytes(uri.bucket, mkey, body, crc.hexdigest())
                st["files"][mkey] = {"done": True}
                up.report_step(rec, step)
    finally:
        os.close(sfd)
    return True


def commit(up: Uploader, rec: JobRecord, uri: S3Uri, step: int, marker: CommitMarker,
            manifests: dict[int, Manifest]) -> None:
    """COMMIT.json goes up last, once every rank (from every node) has its manifest in
    S3 and every one of them carries the marker's save id: a manifest another save of
    the step left there is never counted (it is overwritten when its rank's node of
    this save uploads it)."""
    sname, st = step_name(step), rec["steps"][str(step)]
    commit_key = uri.join(sname, COMMIT)
    prefix = uri.join(sname) + "/"
    keys = up.s3.list_keys(uri.bucket, prefix)
    have = {r for r in range(marker.world_size)
            if f"{prefix}{rank_name(r)}/{MANIFEST}" in keys}
    stale: dict[int, str] = {}
    if len(have) == marker.world_size and marker.save_id:
        for r in sorted(have):
            mkey = f"{prefix}{rank_name(r)}/{MANIFEST}"
            try:
                theirs = Manifest.from_json(up.s3.get_bytes(uri.bucket, mkey), mkey)
            except CheckpointError as exc:
                if isinstance(exc, TransientS3Error):
                    raise
                stale[r] = f"unreadable ({exc})"
                continue
            if theirs.save_id != marker.save_id:
                stale[r] = theirs.save_id or "(legacy, none)"
        if stale:
            log.warning("manifests of another save of this step are in S3; not counted "
                        "(each is overwritten when its rank's node of this save uploads)",
                        job_id=rec["job_id"], step=step, save_id=marker.save_id,
                        stale_ranks=stale)
        have -= set(stale)
    if len(have) < marker.world_size and marker.save_id:
        # Ranks of a node no longer in the job whose copy this node holds (buddy_handoff.py).
        try:
            have |= buddy_handoff.upload_held(up, rec, uri, step, marker,
                                              set(range(marker.world_size)) - have, keys)
        except (SaveSuperseded, CommittedBySave) as exc:
            settle_not_ours(up, rec, step, uri, exc)
            return
    if len(have) < marker.world_size:
        st["state"] = StepState.WAITING_PEERS
        up.report_step(rec, step)
        log.info("step waits for other nodes' ranks", job_id=rec["job_id"], step=step,
                 ranks_in_s3=len(have), world_size=marker.world_size,
                 save_id=marker.save_id)
        return
    try:
        check_save(up, uri, step, marker.save_id)
    except (SaveSuperseded, CommittedBySave) as exc:
        settle_not_ours(up, rec, step, uri, exc)
        return
    body = marker.to_json()
    crc = Crc32c()
    crc.update(body)
    if not up.s3.put_if_absent(uri.bucket, commit_key, body, crc.hexdigest(),
                                 prefix=uri.join() + "/"):
        # Another node of this job got there first (same marker), or another job did.
        existing = up.s3.get_bytes(uri.bucket, commit_key, limit=1024**2)
        if existing != body:
            reject(up, rec, step, f"{uri}/{sname}: a different commit marker is already "
                                "in S3 (another job of this run)", StepState.FAILED,
                     delete_ours=False)
            return
        log.info("commit marker already in S3 (another node of the job wrote it)",
                 job_id=rec["job_id"], step=step)
    committed(up, rec, step, uri, "step committed in S3")
    clean_beyond(up, uri, step, marker)


def settle_not_ours(up: Uploader, rec: JobRecord, step: int, uri: S3Uri,
                     found: SaveSuperseded | CommittedBySave) -> None:
    """What ``_check_save`` found ends this upload: another save owns the step (failed,
    nothing of it deleted: the keys are shared), or this save is committed already."""
    if isinstance(found, CommittedBySave):
        committed(up, rec, step, uri, "committed in S3 by another node of this save")
    else:
        reject(up, rec, step, str(found), StepState.FAILED, delete_ours=False,
                     withdraw=True)


def committed(up: Uploader, rec: JobRecord, step: int, uri: S3Uri, what: str) -> None:
    st = rec["steps"][str(step)]
    st["state"] = StepState.COMMITTED
    st["files"] = {}
    st["committed_at"] = time.time()
    up.report_step(rec, step)
    log.info(what, job_id=rec["job_id"], step=step, uri=str(uri),
             save_id=st.get("save_id", ""))


def clean_beyond(up: Uploader, uri: S3Uri, step: int, marker: CommitMarker) -> None:
    """Rank dirs of the step beyond its world size are an earlier save's (a job of
    another size): nothing reads them; they go, with a log line. Best effort."""
    prefix = uri.join(step_name(step)) + "/"
    try:
        keys = up.s3.list_keys(uri.bucket, prefix)
        extra = sorted(k for k in keys
                       if (r := parse_rank(k[len(prefix):].partition("/")[0])) is not None
                       and r >= marker.world_size)
        if extra:
            log.info("removing rank parts an earlier save of the step left beyond its "
                     "world size", step=step, world_size=marker.world_size,
                     keys=len(extra), save_id=marker.save_id)
            up.s3.delete_keys(uri.bucket, extra)
    except CheckpointError as exc:
        log.warning("couldn't remove an earlier save's leftover rank parts", step=step,
                    error=str(exc))


def abandon_step(up: Uploader, rec: JobRecord, step: int, why: str) -> None:
    """Stage-in passed over a local step and set it aside: a pending upload of it will
    never finish (its intent is withdrawn, its objects go); ``.stale/`` is cleaned
    on the next pass."""
    up.tell(StaleDue(True))
    st = rec["steps"].get(str(step))
    if st is not None and st.get("state") not in DONE_STATES:
        reject(up, rec, step, why)


def reject(up: Uploader, rec: JobRecord, step: int, why: str,
            state: StepState = StepState.REJECTED, *, delete_ours: bool = True,
            withdraw: bool = False) -> None:
    """A step we must not upload (a link, a foreign file, a bad manifest, bytes that
    don't match it) or that S3 refused for good (``FAILED``): never retried. Its
    unfinished uploads are aborted and, with ``delete_ours``, the objects it had
    completed are deleted (never committed, they would only take space)."""
    log.error("checkpoint: upload: couldn't upload step; it will not be retried",
              job_id=rec["job_id"], step=step, state=state.value, reason=why)
    old = rec["steps"].get(str(step), {})
    if delete_ours or withdraw:  # a step another job committed keeps its intents
        intent.withdraw(up.s3, rec, old, step, up.node)  # intent.py: never waited for
    if rec["uri"]:
        uri = parse_uri(rec["uri"])
        for key, frec in old.get("files", {}).items():
            try:
                if frec.get("upload_id"):  # never completed: do not leave it behind
                    up.s3.abort(uri.bucket, key, frec["upload_id"])
                elif frec.get("done") and delete_ours:
                    up.s3.delete_keys(uri.bucket, [key])
            except CheckpointError as exc:
                log.warning("couldn't clean up after a step that will not be uploaded",
                            key=key, error=str(exc))
    rec["steps"][str(step)] = {"state": state, "reason": why}
    if "save_id" in old:  # a later save of the step number is uploaded anew
        rec["steps"][str(step)]["save_id"] = old["save_id"]
    up.report_step(rec, step)


def abort_orphans(up: Uploader, rec: JobRecord, uri: S3Uri) -> None:
    """Abort multipart uploads under the run that no journal record will finish."""
    if not up.tell(OrphansDue(int(rec["job_id"]), 600.0)):
        return
    ours: dict[str, str] = {}
    for st in rec["steps"].values():
        for key, frec in st.get("files", {}).items():
            if frec.get("upload_id"):
                ours[key] = frec["upload_id"]
    for key, upload_id, age in up.s3.multipart_uploads(uri.bucket, uri.join() + "/"):
        # Another id for a key we upload is ours from before a crash; other keys may be
        # another node's upload in progress, so those only go once they are a day old.
        stale = age is not None and age > ORPHAN_AGE_S and key not in ours
        if (key in ours and ours[key] != upload_id) or stale:
            log.info("aborting orphaned multipart upload", key=key, upload_id=upload_id,
                     age_s=age)
            up.s3.abort(uri.bucket, key, upload_id)


def resume_of(frec: FileDoc) -> MultipartState:
    """What the journal kept of a file's earlier upload attempt, for the S3 layer."""
    return MultipartState(
        upload_id=str(frec.get("upload_id") or ""), part_size=int(frec.get("part_size") or 0),
        checksums=bool(frec.get("checksums")),
        parts={int(n): PartResult(int(n), str(p.get("etag", "")), int(p.get("size", 0)),
                                  str(p.get("crc32c", "")))
               for n, p in frec.get("parts", {}).items()})


def keep_event(up: Uploader, rec: JobRecord, step: int, frec: FileDoc,
               event: UploadEvent) -> None:
    """Apply one report of the S3 layer (on the job's sync thread: the part workers only
    return results) to the working copy's file entry and report the step to the record
    owner, which persists it, so a killed agent resumes without re-sending parts."""
    parts = frec.setdefault("parts", {})
    if isinstance(event, UploadStarted):
        frec["upload_id"], frec["part_size"] = event.upload_id, event.part_size
        frec["checksums"] = event.checksums
        parts.clear()
    elif isinstance(event, PartUploaded):
        p = event.part
        parts[str(p.number)] = {"etag": p.etag, "size": p.size, "crc32c": p.crc32c}
    elif isinstance(event, PartsDropped):
        for n in event.numbers:
            parts.pop(str(n), None)
    else:  # UploadForgotten: the upload was aborted
        frec.pop("upload_id", None)
        parts.clear()
    up.report_step(rec, step)
