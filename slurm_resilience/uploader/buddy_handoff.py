"""A survivor completes a step in S3 from the buddy copies it holds (the hand-off).

A node lost after its ranks committed a step locally, but before their upload, leaves its
part nowhere but in its buddy's verified copy (buddy_store.py). The job's other nodes
upload their own parts and wait for the rest (``waiting-peers``), and the next run's
stage-in, which sees the step's intent records, waits for the step, bounded, then refuses
to take an older one. So when this node's own part of a step is in S3 and the step waits
for ranks whose copy this node holds, it uploads them itself: each file from the
root-owned copy, checked against its manifest while it is read (``S3.upload_fd``), then
each rank's manifest. The commit then goes ahead as for any step
(``upload_protocol.commit``).

Only for a source that is no longer a node of the job as this agent knows it: the job
ended here (its epilog told the uploader), or its current run (a requeue back onto this
node) does not include the source. A live node uploads its own part; its buddy would only
double the bytes. A source whose intent record of this save is in S3 began its own upload:
it is given ``HANDOFF_AFTER_S`` to finish before this node takes over (``HandOffs``, which
the buddy service keeps, decides which copies and when).

A copy that fails its check is never uploaded and never stops this node's own step: it is
logged and counted once (``buddy_copies_total{result="failed"}``), not tried again, and
the step waits as before. An S3 outage on the way raises, as any upload's does: the sync
backs off and the next pass starts the copy's files again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurm_resilience.checkpoint.commit import (
    MANIFEST,
    CheckpointError,
    CommitMarker,
    Crc32c,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri
from slurm_resilience.log import get_logger
from slurm_resilience.uploader import intent
from slurm_resilience.uploader.buddy_store import BuddyStore, HeldCopy, Refused
from slurm_resilience.uploader.journal import JobRecord, JobState
from slurm_resilience.uploader.s3 import S3Error, TransientS3Error
from slurm_resilience.uploader.s3_multipart import MultipartState

if TYPE_CHECKING:
    from slurm_resilience.uploader.service import Uploader

log = get_logger("checkpoint.buddy")
# A source that began its own upload of the step (its intent record is in S3) is given
# this long before the node holding its copy uploads its part instead.
HANDOFF_AFTER_S = 120.0


@dataclass(frozen=True)
class HandedOff:
    """What one hand-off put into S3."""

    ranks: frozenset[int]
    nbytes: int


class HandOffs:
    """Which copies held here to upload for their lost nodes, and when (the buddy service
    keeps one; ``jobs()``: the jobs running here as this agent knows them → their nodes)."""

    def __init__(self, node: str, store: BuddyStore,
                 jobs: Callable[[], dict[int, tuple[str, ...]]], clock: Callable[[], float]):
        self.node = node
        self.store = store
        self.jobs = jobs
        self.clock = clock
        # (job, source, step) → when a hand-off of it was first possible
        self.seen: dict[tuple[int, str, int], float] = {}
        # copies that failed their check on the way up: never read again (each pass would
        # read the whole copy and log the same error)
        self.failed: set[tuple[int, str, int]] = set()

    def candidates(self, job_id: int, step: int, save_id: str, missing: set[int],
                   ended: bool) -> list[HeldCopy]:
        """The copies held here of ``step`` (this save) that hold ranks of ``missing``, from
        nodes no longer in the job as this agent knows it: the job ended here (``ended``,
        the uploader's word, or no longer watched), or its current run leaves the source
        out."""
        nodes = None if ended else self.jobs().get(job_id)
        current = set(nodes or ())
        try:
            held = self.store.held(job_id)
        except Refused as exc:
            log.error("buddy: the buddy area is unsafe; no hand-off from it", job_id=job_id,
                      error=str(exc))
            return []
        return [c for c in held.values() if c.step == step and c.marker.save_id == save_id
                and c.source != self.node and c.source not in current and c.ranks & missing
                and (job_id, c.source, step) not in self.failed]

    def ready(self, job_id: int, step: int, held: list[HeldCopy],
              announced: set[str]) -> list[HeldCopy]:
        """Of ``held``, those to upload now: a source that began its own upload
        (``announced``) only ``HANDOFF_AFTER_S`` after its hand-off first became possible."""
        now, out = self.clock(), []
        for c in held:
            first = self.seen.setdefault((job_id, c.source, step), now)
            if c.source not in announced or now - first >= HANDOFF_AFTER_S:
                out.append(c)
            elif now == first:
                log.info("buddy: a node no longer in the job began its own upload of the "
                         "step; its part goes up from the copy here if it has not arrived",
                         job_id=job_id, step=step, source=c.source, wait_s=HANDOFF_AFTER_S)
        return out

    def forget(self, job_id: int) -> None:
        for key in [k for k in self.seen if k[0] == job_id]:
            del self.seen[key]
        self.failed = {k for k in self.failed if k[0] != job_id}


def announced(up: Uploader, uri: S3Uri, step: int, save_id: str, keys: Iterable[str],
              nodes: Iterable[str]) -> set[str]:
    """The nodes among ``nodes`` whose intent record of this save is in S3 (they began
    their own upload). ``keys``: the step's listing, which the commit just made."""
    listed = set(keys)
    out = set()
    for node in nodes:
        try:
            key = uri.join(step_name(step), intent.intent_name(node))
        except CheckpointError:
            continue
        if key not in listed:
            continue
        try:
            record = intent.Intent.from_json(up.s3.get_bytes(uri.bucket, key, limit=1 << 20),
                                             key)
        except TransientS3Error:
            raise
        except (CheckpointError, S3Error):
            continue  # gone or unreadable: not a sign of a live upload
        if record.save_id == save_id:
            out.add(node)
    return out


def upload_held(up: Uploader, rec: JobRecord, uri: S3Uri, step: int, marker: CommitMarker,
                missing: set[int], keys: Iterable[str]) -> set[int]:
    """Upload the ranks of ``missing`` that buddy copies held here can give (module doc);
    returns the ranks now in S3. TransientS3Error propagates (the sync backs off), and so
    do the upload protocol's SaveSuperseded and CommittedBySave (the commit settles them)."""
    from slurm_resilience.uploader.upload_protocol import SaveSuperseded, check_save

    buddy = up.buddy
    if buddy is None or not missing:
        return set()
    job_id = int(rec["job_id"])
    held = buddy.handoffs.candidates(job_id, step, marker.save_id, missing,
                                     ended=rec.get("state") == JobState.ENDED)
    if not held:
        return set()
    ready = buddy.handoffs.ready(job_id, step, held, announced(
        up, uri, step, marker.save_id, keys, [c.source for c in held]))

    def check() -> None:
        check_save(up, uri, step, marker.save_id)

    done: set[int] = set()
    for copy in ready:
        t0 = time.monotonic()
        try:
            got = _upload_copy(up, buddy.store, job_id, uri, step, copy, missing - done, check)
        except (TransientS3Error, SaveSuperseded):
            raise
        except (CheckpointError, Refused, OSError) as exc:
            buddy.handoffs.failed.add((job_id, copy.source, step))
            buddy.count("failed")
            log.error("buddy: couldn't upload a lost node's part from the copy held here; "
                      "the step waits for it as before (this copy is not tried again)",
                      job_id=job_id, step=step, source=copy.source,
                      ranks=sorted(copy.ranks & missing), error=str(exc))
            continue
        done |= got.ranks
        buddy.count("uploaded", got.nbytes, "uploaded")
        log.info("buddy: uploaded a node's part of the step from the copy held here (its "
                 "node is no longer in the job)", job_id=job_id, step=step,
                 source=copy.source, ranks=sorted(got.ranks), bytes=got.nbytes,
                 seconds=round(time.monotonic() - t0, 3))
    return done


def _upload_copy(up: Uploader, store: BuddyStore, job_id: int, uri: S3Uri, step: int,
                 copy: HeldCopy, ranks: set[int], check: Callable[[], None]) -> HandedOff:
    """Each file of the copy's ``ranks``, then each rank's manifest (``check``: the step is
    still this save's in S3, before every write, as for a node's own part)."""
    sname, nbytes, out = step_name(step), 0, set()
    for rank in sorted(copy.ranks & ranks):
        manifest = copy.manifests[rank]
        for f in manifest.files:
            rel = f"{rank_name(rank)}/{f.path}"
            fd = store.open_file(job_id, copy.source, step, rel)
            try:
                size = os.fstat(fd).st_size
                if size != f.size:
                    raise CheckpointError(f"{rel}: the copy holds {size:,} bytes, its "
                                          f"manifest says {f.size:,}")
                check()
                up.s3.upload_fd(fd, f.size, f.crc32c, uri.bucket, uri.join(sname, rel),
                                MultipartState(), lambda _event: None, blocks=f.blocks,
                                block_size=f.block_size, owner=f"job-{job_id}",
                                before_write=check)
            finally:
                os.close(fd)
            nbytes += f.size
        body = manifest.to_json()
        crc = Crc32c()
        crc.update(body)
        check()
        up.s3.put_bytes(uri.bucket, uri.join(sname, rank_name(rank), MANIFEST), body,
                        crc.hexdigest())
        out.add(rank)
    return HandedOff(frozenset(out), nbytes)
