"""Stage-in: bring the newest committed step of a run to a job's node (root side).

The agent picks the newest committed step: a local one whose ranks are all here
and verify, one with COMMIT.json in S3, or one that S3 shows only by an intent
record (committed, still uploading from other nodes: waited for, bounded). For a
DCP step it writes only COMMIT.json, every rank's MANIFEST.json and
``rank-00000/.metadata`` into ``step-N/``; the ranks then ask for the byte ranges
they read (``ckpt.fetch``, see fetch.py). Older formats are downloaded whole.
Transient S3 errors are retried (bounded) and never taken for corruption; only a
failed verification falls back to an older step, and every fallback is reported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from slurm_resilience import safefs
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CommitMarker,
    Crc32c,
    Manifest,
    check_save_ids,
    parse_rank,
    parse_step,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.dcp_verify import check_manifest
from slurm_resilience.checkpoint.optin import ENV_ALLOW_OLDER
from slurm_resilience.checkpoint.prefix import S3Uri
from slurm_resilience.checkpoint.staging import open_dir_at, remove_at
from slurm_resilience.log import get_logger
from slurm_resilience.progress import BarFactory, quiet
from slurm_resilience.uploader.deadline import endpoint_name
from slurm_resilience.uploader.intent import PREFIX, Intent, is_intent
from slurm_resilience.uploader.rootfs import (
    committed_steps_at,
    read_small,
    read_step,
    verify_step_at,
)
from slurm_resilience.uploader.s3 import S3, S3Error, error_code
from slurm_resilience.uploader.stagein_retry import Clock as Clock
from slurm_resilience.uploader.stagein_retry import StageinFailed as StageinFailed
from slurm_resilience.uploader.stagein_retry import StageinPolicy as StageinPolicy
from slurm_resilience.uploader.stagein_retry import SystemClock as SystemClock
from slurm_resilience.uploader.stagein_retry import retrying as retrying

log = get_logger("checkpoint.stagein")
METADATA = ".metadata"  # DCP's Metadata, written by the coordinator into rank-00000/
METADATA_LIMIT = 1024**3  # held in the agent's memory while it is checked and written


def remote_steps(s3: S3, uri: S3Uri) -> dict[int, dict[str, int]]:
    """Steps with a COMMIT.json in S3 → their object keys (relative to the step) and sizes."""
    return list_run(s3, uri).committed


def read_remote_step(s3: S3, uri: S3Uri, step: int) -> tuple[CommitMarker, dict[int, Manifest]]:
    sname = step_name(step)
    marker = CommitMarker.from_json(s3.get_bytes(uri.bucket, uri.join(sname, COMMIT)),
                                    f"{uri}/{sname}/{COMMIT}")
    manifests = {}
    for rank in range(marker.world_size):
        rel = f"{rank_name(rank)}/{MANIFEST}"
        m = Manifest.from_json(s3.get_bytes(uri.bucket, uri.join(sname, rel)),
                               f"{uri}/{sname}/{rel}")
        if m.step != step or m.rank != rank:
            raise CheckpointError(f"checkpoint: {uri}/{sname}/{rel}: says step {m.step} "
                                  f"rank {m.rank}")
        manifests[rank] = check_manifest(m, f"{uri}/{sname}/{rank_name(rank)}")
    check_save_ids(step, marker, manifests, f"{uri}/{sname}")
    return marker, manifests


def download_step(s3: S3, uri: S3Uri, step: int, job_fd: int, uid: int, gid: int,
                  bar: BarFactory = quiet) -> None:
    """Download every rank of ``step`` into ``.stagein-step-N/``, verify, rename into place;
    ``bar``: progress a person watches (``ckpt pull``)."""
    sname = step_name(step)
    tmp = f".stagein-{sname}"
    with contextlib.suppress(FileNotFoundError):
        remove_at(job_fd, tmp)
    marker, manifests = read_remote_step(s3, uri, step)
    tfd = safefs.make_owned_dir(job_fd, tmp, uid, gid)
    advance = bar(sum(f.size for m in manifests.values() for f in m.files), sname)
    try:
        for rank, m in manifests.items():
            rfd = safefs.make_owned_dir(tfd, rank_name(rank), uid, gid)
            try:
                for f in m.files:
                    head, _, name = f.path.rpartition("/")
                    pfd = safefs.makedirs_owned_at(rfd, head, uid, gid)
                    try:
                        fd = safefs.create_owned(pfd, name, uid, gid)
                    finally:
                        os.close(pfd)
                    try:
                        crc = s3.download_fd(uri.bucket, uri.join(sname, rank_name(rank), f.path),
                                             f.size, fd, advance)
                        if crc != f.crc32c or os.fstat(fd).st_size != f.size:
                            raise CheckpointError(
                                f"checkpoint: stage-in: {uri}/{sname}/{rank_name(rank)}/{f.path}: "
                                f"crc32c {crc}, manifest says {f.crc32c}")
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                safefs.write_new(rfd, MANIFEST, m.to_json(), uid=uid, gid=gid, durable=True)
            finally:
                os.close(rfd)
        safefs.write_new(tfd, COMMIT, marker.to_json(), uid=uid, gid=gid, durable=True)
        os.fsync(tfd)
    except BaseException:
        os.close(tfd)
        remove_at(job_fd, tmp)
        raise
    finally:
        advance.close()
    os.close(tfd)
    with contextlib.suppress(FileNotFoundError):
        remove_at(job_fd, sname)  # a local copy that did not verify
    os.rename(tmp, sname, src_dir_fd=job_fd, dst_dir_fd=job_fd)
    os.fsync(job_fd)


class StepStillUploading(StageinFailed):
    """The wait for a step still uploading ran out and nothing allowed an older step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class Fallback:
    """A newer step stage-in passed over, and why (shown in ckpt.status and the log);
    ``opt_in`` names what let it take an older step instead of failing, if anything did."""

    step: int
    reason: str
    opt_in: str = ""


@dataclass(frozen=True)
class RemoteStep:
    """A step's commit marker and every rank's manifest, as read from S3 (root-side facts)."""

    marker: CommitMarker
    manifests: dict[int, Manifest]


@dataclass(frozen=True)
class StageinResult:
    step: int | None
    source: str  # local | s3 | none
    mode: str  # metadata: data stays in S3 until ckpt.fetch; whole: every file is local
    fetched_bytes: int
    fallbacks: tuple[Fallback, ...]
    remote: RemoteStep | None


@dataclass(frozen=True)
class RunListing:
    """The run in S3: steps with COMMIT.json (keys → sizes), and steps with only intents."""

    committed: dict[int, dict[str, int]]
    uploading: dict[int, tuple[str, ...]]


def list_run(s3: S3, uri: S3Uri) -> RunListing:
    """The run's steps from one S3 listing: committed ones (with their objects and sizes)
    and ones S3 shows only by intent records (still uploading)."""
    keys = s3.list_keys(uri.bucket, uri.join() + "/" if uri.key else "")
    steps: dict[int, dict[str, int]] = {}
    base = len(uri.key) + 1 if uri.key else 0
    for key, size in keys.items():
        sname, _, rest = key[base:].partition("/")
        step = parse_step(sname)
        if step is not None and rest:
            steps.setdefault(step, {})[rest] = size
    committed = {s: objs for s, objs in steps.items() if COMMIT in objs}
    uploading = {s: tuple(sorted(k for k in objs if is_intent(k)))
                 for s, objs in steps.items() if COMMIT not in objs}
    return RunListing(committed, {s: v for s, v in uploading.items() if v})


def _missing(exc: BaseException) -> bool:
    return error_code(exc.__cause__ or exc) in ("NoSuchKey", "404", "NotFound")


def _is_dcp(manifests: dict[int, Manifest]) -> bool:
    """A DCP step (rank 0 lists ``.metadata``): restored by ranges, so only metadata moves."""
    return 0 in manifests and any(f.path == METADATA for f in manifests[0].files)


SetAside = Callable[[int, str], None]
"""Moves a local step (by number) that stage-in passed over out of the job's staging dir,
given why (root side: into ``.stale/``, see staging.set_aside_step)."""


def stage_in(s3: S3 | None, uri: S3Uri | None, job_fd: int, uid: int, gid: int,
             policy: StageinPolicy | None = None, clock: Clock | None = None,
             upload_local: Callable[[int], None] | None = None,
             exclude: Mapping[int, str] | None = None, *,
             set_aside: SetAside, allow_older: Callable[[], bool] | None = None
             ) -> StageinResult:
    """Choose the newest committed step of the run and bring what a restore needs to start.

    Candidates are local steps, S3 steps with COMMIT.json and S3 steps with only an
    intent record (still uploading: waited for, bounded). A DCP step gets COMMIT.json,
    every rank's MANIFEST.json and ``rank-00000/.metadata``; data stays in S3 until a
    rank asks for ranges (``ckpt.fetch``). Other steps are downloaded whole. Only a
    failed verification falls back to an older step, and each fallback is reported.
    ``upload_local(step)`` uploads this node's part of a step still uploading, which may
    be the part the other nodes' upload waits for (a requeue onto the same node).
    ``exclude`` maps steps a restore found corrupt (block CRC32C) to why: passed over,
    each as a fallback. A local step passed over (partial, failing verification, excluded)
    goes to ``set_aside``: its COMMIT.json must not stay where the job's ``save()`` of
    that step number would take it for committed and skip writing it.
    ``allow_older()`` is the job's own opt-in (asked when the wait for a step still
    uploading runs out): true takes the newest complete older step, loudly.
    """
    policy = policy or StageinPolicy()
    if s3 is not None and not policy.endpoint:
        policy = replace(policy, endpoint=endpoint_name(s3.settings.endpoint,
                                                        s3.settings.region))
    clock = clock or SystemClock()
    local = committed_steps_at(job_fd)
    fallbacks: list[Fallback] = []

    def fall_back(step: int, reason: str, opt_in: str = "") -> None:
        log.error("stage-in: step does not verify, falling back", step=step, error=reason)
        fallbacks.append(Fallback(step, reason, opt_in))
        if _has_marker(job_fd, step):
            try:
                set_aside(step, reason)
            except (CheckpointError, OSError) as exc:
                raise StageinFailed(
                    f"checkpoint: stage-in: step {step} was passed over ({reason}) but its "
                    f"local copy couldn't be set aside ({exc}); a save of step {step} would "
                    "take it for committed") from None

    excluded = dict(exclude or {})
    if s3 is None or uri is None:
        for step in reversed(local):
            if step in excluded:
                fall_back(step, excluded[step])
                continue
            try:
                verify_step_at(job_fd, step, uid)
            except (CheckpointError, OSError) as exc:
                fall_back(step, str(exc))
                continue
            return StageinResult(step, "local", "whole", 0, tuple(fallbacks), None)
        return StageinResult(None, "none", "", 0, tuple(fallbacks), None)

    listing = retrying(f"list {uri}", lambda: list_run(s3, uri), policy, clock)
    for step in sorted(set(local) | set(listing.committed) | set(listing.uploading),
                       reverse=True):
        if step in excluded:
            fall_back(step, excluded[step])
            continue
        if step not in listing.committed and step in local:
            why = _local_incomplete(job_fd, step, uid)
            if why is None:
                _say_older(step, fallbacks)
                return StageinResult(step, "local", "whole", 0, tuple(fallbacks), None)
            if step not in listing.uploading:
                fall_back(step, f"checkpoint: stage-in: step {step}: {why}, and S3 has neither "
                                "its COMMIT.json nor an intent record")
                continue
        if step not in listing.committed and step in local and upload_local is not None:
            upload_local(step)
            listing = retrying(f"list {uri}", lambda: list_run(s3, uri), policy, clock)
        if step not in listing.committed:
            listing = _wait_for_commit(s3, uri, step, listing, policy, clock)
            if step not in listing.committed:
                msg = (f"checkpoint: stage-in: step {step} is committed but still uploading from "
                       f"{_never_arrived(s3, uri, step, listing, policy, clock)} (intent record, "
                       f"no COMMIT.json) after {policy.intent_wait_s:.0f}s "
                       "(checkpoint.stagein_intent_wait_s)")
                if policy.intent_fallback:
                    fall_back(step, msg + "; checkpoint.stagein_intent_fallback takes an older "
                              "step", "checkpoint.stagein_intent_fallback")
                    continue
                if allow_older is not None and allow_older():
                    log.warning("stage-in: the job opted in to an older step; passing over a "
                                "step that never finished uploading", step=step,
                                opt_in=ENV_ALLOW_OLDER, error=msg)
                    fall_back(step, msg + f"; the job set {ENV_ALLOW_OLDER}, so the newest "
                              "complete older step is taken", ENV_ALLOW_OLDER)
                    continue
                raise StepStillUploading(
                    msg + f"; if those node(s) are gone, set {ENV_ALLOW_OLDER}=1 in the job's "
                    "environment to take the newest complete older step after this wait",
                    step)
        try:
            remote, mode, nbytes = stage_remote(s3, uri, step, listing.committed[step], job_fd,
                                                 uid, gid, policy, clock)
        except StageinFailed:
            raise
        except S3Error as exc:
            if not _missing(exc):
                raise StageinFailed(f"checkpoint: stage-in: step {step}: {exc}") from None
            fall_back(step, str(exc))
            continue
        except CheckpointError as exc:
            fall_back(step, str(exc))
            continue
        log.info("stage-in: staged step from S3", step=step, uri=str(uri), mode=mode,
                 bytes=nbytes)
        _say_older(step, fallbacks)
        return StageinResult(step, "s3", mode, nbytes, tuple(fallbacks), remote)
    _say_older(None, fallbacks)
    return StageinResult(None, "none", "", 0, tuple(fallbacks), None)


def _say_older(step: int | None, fallbacks: list[Fallback]) -> None:
    """One log event naming both steps when an opt-in let stage-in take an older one."""
    for f in fallbacks:
        if f.opt_in:
            log.warning("stage-in: took an OLDER step because of an opt-in", step=step,
                        passed_over=f.step, opt_in=f.opt_in, reason=f.reason)


def _never_arrived(s3: S3, uri: S3Uri, step: int, listing: RunListing, policy: StageinPolicy,
                   clock: Clock) -> str:
    """The node(s) of a step still uploading whose ranks' parts are not in S3, from their
    intent records ("node(s) n7 (ranks [1])"); every announcing node when all parts are
    there but no COMMIT.json, and ranks no intent covers as such."""
    intents = listing.uploading.get(step, ())
    names = [n.removeprefix(PREFIX).removesuffix(".json") for n in intents]
    plain = f"node(s) {', '.join(names) or '?'}"
    prefix = uri.join(step_name(step))
    try:
        keys = retrying(f"list {uri}/{step_name(step)}",
                        lambda: s3.list_keys(uri.bucket, prefix + "/"), policy, clock)
        records = [_read_intent(s3, uri.bucket, f"{prefix}/{n}", policy, clock)
                   for n in intents]
    except (CheckpointError, OSError) as exc:  # the error still names the nodes
        log.warning("stage-in: couldn't read the intent records of a step still uploading",
                    step=step, error=str(exc))
        return plain
    have = {parse_rank(k[len(prefix) + 1:].partition("/")[0]) for k in keys
            if k.endswith(f"/{MANIFEST}")}
    world = max((r.world_size for r in records), default=0)
    missing = sorted(set(range(world)) - have)
    late = [f"{r.node} (ranks {sorted(set(r.ranks) & set(missing))} never arrived)"
            for r in records if set(r.ranks) & set(missing)]
    unowned = sorted(set(missing) - {x for r in records for x in r.ranks})
    if unowned:
        late.append(f"no node (ranks {unowned} announced by none)")
    return f"node(s) {', '.join(late)}" if late else plain


def _read_intent(s3: S3, bucket: str, key: str, policy: StageinPolicy, clock: Clock) -> Intent:
    data = retrying(f"get {key}", lambda: s3.get_bytes(bucket, key, limit=1 << 20), policy,
                    clock)
    return Intent.from_json(data, key)


def _has_marker(job_fd: int, step: int) -> bool:
    """Whether the job dir has ``step-N/COMMIT.json`` (whatever it is: never followed)."""
    try:
        sfd = open_dir_at(job_fd, step_name(step))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True  # a link or worse where the step dir should be: set it aside too
    try:
        os.stat(COMMIT, dir_fd=sfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(sfd)


def _local_incomplete(job_fd: int, step: int, uid: int) -> str | None:
    """None when every rank of a local step is here and verifies; else what is wrong."""
    try:
        marker, manifests = read_step(job_fd, step, uid)
        if set(manifests) != set(range(marker.world_size)):
            return (f"only ranks {sorted(manifests)} of 0..{marker.world_size - 1} are on "
                    "this node")
        verify_step_at(job_fd, step, uid, need_all=True)
    except (CheckpointError, OSError) as exc:
        return f"the local copy does not verify ({exc})"
    return None


def _wait_for_commit(s3: S3, uri: S3Uri, step: int, listing: RunListing,
                     policy: StageinPolicy, clock: Clock) -> RunListing:
    deadline = clock.monotonic() + policy.intent_wait_s
    log.info("stage-in: waiting for a step still uploading", step=step,
             intents=list(listing.uploading.get(step, ())), wait_s=policy.intent_wait_s)
    while step not in listing.committed:
        left = deadline - clock.monotonic()
        if left <= 0:
            break
        clock.sleep(min(policy.poll_s, left))
        listing = retrying(f"list {uri}", lambda: list_run(s3, uri), policy, clock)
    return listing


def stage_remote(s3: S3, uri: S3Uri, step: int, objs: dict[str, int], job_fd: int, uid: int,
                  gid: int, policy: StageinPolicy, clock: Clock
                  ) -> tuple[RemoteStep, str, int]:
    marker, manifests = retrying(f"read the manifests of step {step}",
                                 lambda: read_remote_step(s3, uri, step), policy, clock)
    for rank, m in manifests.items():
        for f in m.files:
            rel = f"{rank_name(rank)}/{f.path}"
            if objs.get(rel) != f.size:
                raise CheckpointError(f"checkpoint: stage-in: step {step}: {rel} is "
                                      f"{objs.get(rel)} bytes in S3, its manifest says {f.size}")
    remote = RemoteStep(marker, manifests)
    small = sum(len(m.to_json()) for m in manifests.values()) + len(marker.to_json())
    if not _is_dcp(manifests):
        if _local_incomplete(job_fd, step, uid) is None:
            return remote, "whole", 0
        retrying(f"download step {step}",
                 lambda: download_step(s3, uri, step, job_fd, uid, gid), policy, clock,
                 bounded=False)
        verify_step_at(job_fd, step, uid, need_all=True)
        return remote, "whole", small + sum(m.total_bytes for m in manifests.values())
    meta = next(f for f in manifests[0].files if f.path == METADATA)
    key = uri.join(step_name(step), rank_name(0), METADATA)
    if meta.size > METADATA_LIMIT:
        raise CheckpointError(f"checkpoint: stage-in: step {step}: {rank_name(0)}/{METADATA} is "
                              f"{meta.size} bytes, more than the agent reads ({METADATA_LIMIT})")
    data = retrying(f"get {key}", lambda: s3.get_bytes(uri.bucket, key, limit=meta.size),
                    policy, clock)
    crc = Crc32c()
    crc.update(data)
    if (len(data), crc.hexdigest()) != (meta.size, meta.crc32c):
        raise CheckpointError(f"checkpoint: stage-in: step {step}: {rank_name(0)}/{METADATA}: "
                              f"size {len(data)} crc32c {crc.hexdigest()} in S3, manifest says "
                              f"size {meta.size} crc32c {meta.crc32c}")
    place_metadata(job_fd, step, remote, data, uid, gid)
    return remote, "metadata", small + len(data)


def place_metadata(job_fd: int, step: int, remote: RemoteStep, metadata: bytes, uid: int,
                   gid: int) -> None:
    """Write COMMIT.json (last), every rank's MANIFEST.json and rank-00000/.metadata into
    ``step-N/``, keeping rank parts already here that match S3's manifests."""
    sfd = open_or_make_dir(job_fd, step_name(step), uid, gid)
    try:
        for rank, m in remote.manifests.items():
            rname = rank_name(rank)
            try:
                here = Manifest.from_json(read_small(sfd, f"{rname}/{MANIFEST}", uid))
            except FileNotFoundError:
                here = None
            except (CheckpointError, OSError):
                here = m.__class__(step=-1, rank=-1, files=())  # unreadable: replace the part
            if here is not None and here != m:
                log.info("stage-in: replacing a local rank part that differs from S3",
                         step=step, rank=rank)
                remove_at(sfd, rname)
            rfd = open_or_make_dir(sfd, rname, uid, gid)
            try:
                if here != m:
                    replace_owned(rfd, MANIFEST, m.to_json(), uid, gid)
                if rank == 0:
                    replace_owned(rfd, METADATA, metadata, uid, gid)
            finally:
                os.close(rfd)
        replace_owned(sfd, COMMIT, remote.marker.to_json(), uid, gid)
        os.fsync(sfd)
    finally:
        os.close(sfd)
    os.fsync(job_fd)


def open_or_make_dir(dir_fd: int, name: str, uid: int, gid: int) -> int:
    """A subdirectory (created owned by uid:gid) that is a real dir owned by uid."""
    try:
        return safefs.open_or_make_owned_dir(dir_fd, name, uid, gid)
    except safefs.UnsafePath as exc:
        raise CheckpointError(f"checkpoint: {exc.strerror}") from None


def replace_owned(dir_fd: int, name: str, data: bytes, uid: int, gid: int) -> None:
    """Write a small file owned by uid:gid atomically (temp name, fsync, rename)."""
    safefs.replace_file(dir_fd, name, data, uid=uid, gid=gid, durable=True,
                        tmp=f".{name}.stagein")
