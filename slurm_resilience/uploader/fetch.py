"""``ckpt.fetch``: the agent makes byte ranges of a step present and verified on the node.

A restoring rank names the ranges it will read (``rank-00003/data.distcp`` at an
offset, a length). The agent widens them to whole manifest blocks, and for each
block not yet known present either verifies the bytes already on the node (a
part this node saved) or fetches it with ranged GETs (parallel across blocks,
jobs taking turns, each GET at most ``fetch_request_bytes``), writes it at its offset into a file
created at full size, and checks its CRC32C against the manifest. Which blocks
are present is kept in the agent's memory, never in the user-writable staging
dir; after an agent restart a block is verified again from the local bytes.

The staging dir belongs to the job's user: every path is walked through
directory fds with O_NOFOLLOW, files are checked with fstat (regular, one link,
owned by the job's user), and manifests come from S3 (what stage-in read), not
from the staging dir, so a user can't steer a GET outside their run's URI.
"""

from __future__ import annotations

import functools
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.checkpoint.blocks import BlockCrcs, bad_blocks, block_span, covering
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    CorruptStep,
    FileEntry,
    crc32c_extend,
    crc_hex,
    parse_rank,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri
from slurm_resilience.checkpoint.ranges import ByteRange
from slurm_resilience.checkpoint.staging import open_job_dir
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.fairpool import FairPool
from slurm_resilience.uploader.rootfs import read_step
from slurm_resilience.uploader.s3 import S3, S3Error, TransientS3Error
from slurm_resilience.uploader.s3_stream import direct_stream, pwrite_all, read_into
from slurm_resilience.uploader.stagein import (
    RemoteStep,
    StageinFailed,
    StageinPolicy,
    SystemClock,
    open_or_make_dir,
    read_remote_step,
    retrying,
)

log = get_logger("checkpoint.fetch")

MAX_RANGES = 4096  # per request; AgentRanges batches below this
_CHUNK = 256 * 1024  # bytes read from a GET's body at a time: in cache (s3._STREAM_CHUNK)
_FILE_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class FetchError(CheckpointError):
    """A fetch that can't complete; the message names the step and the cause."""


class CorruptBlock(FetchError, CorruptStep):
    """A block fetched twice from S3 doesn't match its manifest."""


@dataclass(frozen=True)
class FetchSettings:
    concurrency: int = 16
    request_bytes: int = 8 * 1024**2
    max_per_job: int = 8
    slot_wait_s: float = 600.0
    retry_s: float = 120.0


@dataclass(frozen=True)
class FetchJob:
    """Root-side facts about the job (from the agent's journal record)."""

    job_id: int
    uid: int
    gid: int
    staging_root: str
    uri: S3Uri | None


@dataclass
class FetchCounters:
    """Per job: bytes and blocks this node fetched from S3 or found already here."""

    requests: int = 0
    fetched_bytes: int = 0
    fetched_blocks: int = 0
    get_requests: int = 0
    local_blocks: int = 0
    refetched_blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _File:
    relpath: str
    entry: FileEntry

    @property
    def block_size(self) -> int:
        # Format-1 entries have no block CRCs: the whole file is one block.
        return self.entry.block_size if self.entry.blocks else max(self.entry.size, 1)

    @property
    def crcs(self) -> tuple[str, ...]:
        if self.entry.blocks:
            return self.entry.blocks
        return (self.entry.crc32c,) if self.entry.size else ()


@dataclass
class _StepFiles:
    source: str  # s3: blocks may be fetched; local: verify only
    files: dict[str, _File] = field(default_factory=dict)


def parse_ranges(raw: Any) -> list[ByteRange]:
    """The request's ``ranges`` as ByteRanges; refuses anything mis-shaped or too many."""
    if not isinstance(raw, list) or len(raw) > MAX_RANGES:
        raise FetchError(f"checkpoint: fetch: ranges must be a list of at most {MAX_RANGES} "
                         "[relpath, offset, length] items")
    out = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str)
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in item[1:])):
            raise FetchError(f"checkpoint: fetch: range {item!r} is not [relpath, offset, length]")
        out.append(ByteRange(item[0], item[1], item[2]))
    return out


class RangeFetcher:
    """Serves ``ckpt.fetch`` for every job on the node (one GET pool shared by all)."""

    def __init__(self, settings: FetchSettings, s3: Callable[[], S3],
                 policy: StageinPolicy | None = None):
        self.settings = settings
        self._s3 = s3
        self.policy = policy or StageinPolicy(retry_s=settings.retry_s)
        self.lock = threading.RLock()  # a done-callback may run inside _schedule
        # Creating a target file is create (root's) + fchown + ftruncate: a second request
        # for the same file (two ranks of a node read the same bytes) must not open it in
        # between, when it is still root's and short.
        self.open_lock = threading.Lock()
        self.steps: dict[tuple[int, int], _StepFiles] = {}
        self.present: dict[tuple[int, int, str], set[int]] = {}
        self.inflight: dict[tuple[int, int, str, int], Future[None]] = {}
        self.slots: dict[int, threading.BoundedSemaphore] = {}
        self.counters: dict[int, FetchCounters] = {}
        self.pool = FairPool(settings.concurrency, "ckpt-fetch")  # jobs take turns
        self._local = threading.local()  # each pool thread's read buffer
        # Brings a step's missing rank parts from the job's other nodes (the buddy service's
        # complete(job_id, job_fd, gid, step)), for a step S3 can't give; None: no service.
        # Returns whether it brought any part.
        self.peers: Callable[[int, int, int, int], bool] | None = None
        # When S3 last couldn't be reached (monotonic; the uploads, a stage-in or a fetch
        # gave up on it): within stagein_retry_s of that, a step's missing parts are asked
        # of the job's nodes first, instead of retrying S3 for that long again.
        self.s3_failed_at: float | None = None

    # -- bookkeeping ------------------------------------------------------------------------

    def remember(self, job_id: int, step: int, remote: RemoteStep) -> None:
        """Stage-in read this step's manifests from S3: keep them as the root-side truth."""
        with self.lock:
            self.steps[(job_id, step)] = _files_of(remote, "s3")

    def note_s3_unreachable(self) -> None:
        self.s3_failed_at = time.monotonic()

    def _s3_recently_unreachable(self) -> bool:
        failed = self.s3_failed_at
        return failed is not None and time.monotonic() - failed < self.policy.retry_s

    def forget(self, job_id: int) -> None:
        with self.lock:
            for sk in [k for k in self.steps if k[0] == job_id]:
                del self.steps[sk]
            for pk in [k for k in self.present if k[0] == job_id]:
                del self.present[pk]
            self.slots.pop(job_id, None)
            self.counters.pop(job_id, None)

    def stats(self, job_id: int) -> dict[str, int]:
        with self.lock:
            return self.counters.get(job_id, FetchCounters()).as_dict()

    def close(self) -> None:
        self.pool.close()

    # -- the request ------------------------------------------------------------------------

    def fetch(self, job: FetchJob, step: int, ranges: list[ByteRange]) -> dict[str, int]:
        with self.lock:
            slot = self.slots.setdefault(job.job_id,
                                         threading.BoundedSemaphore(self.settings.max_per_job))
            counters = self.counters.setdefault(job.job_id, FetchCounters())
            counters.requests += 1
        if not slot.acquire(timeout=self.settings.slot_wait_s):
            raise FetchError(f"checkpoint: fetch: step {step}: job {job.job_id} already has "
                             f"{self.settings.max_per_job} fetches in flight on this node "
                             f"(checkpoint.fetch_max_per_job) for {self.settings.slot_wait_s:.0f}s")
        try:
            return self._fetch(job, step, ranges, counters)
        finally:
            slot.release()

    def _fetch(self, job: FetchJob, step: int, ranges: list[ByteRange],
               counters: FetchCounters) -> dict[str, int]:
        with open_job_dir(job.staging_root, job.job_id) as jfd:
            if os.fstat(jfd).st_uid != job.uid:
                raise FetchError(f"checkpoint: fetch: step {step}: the staging dir of job "
                                 f"{job.job_id} is not owned by uid {job.uid}")
            sf = self._step_files(job, jfd, step)
            needed = _needed_blocks(step, sf, ranges)
            fds: dict[str, tuple[int, bool]] = {}
            futures: list[Future[None]] = []
            errors: list[str] = []
            try:
                sfd = open_or_make_dir(jfd, step_name(step), job.uid, job.gid)
                try:
                    for rel in sorted(needed):
                        fds[rel] = self._open_target(job, sfd, step, sf.files[rel])
                finally:
                    os.close(sfd)
                for rel, indices in sorted(needed.items()):
                    fd, created = fds[rel]
                    futures += self._schedule(job, step, sf, sf.files[rel], fd, not created,
                                              sorted(indices), counters)
            except (CheckpointError, OSError) as exc:
                errors.append(str(exc))
            finally:
                wait(futures)
                for fut in futures:
                    if fut.cancelled():
                        errors.append("the agent is shutting down")
                        continue
                    failure = fut.exception()
                    if failure is not None:
                        errors.append(str(failure))
                for fd, _ in fds.values():
                    os.close(fd)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            msg = errors[0] if f"step {step}" in errors[0] else \
                f"checkpoint: fetch: step {step}: {errors[0]}"
            raise FetchError(msg + more)
        return {"step": step, "blocks": sum(len(v) for v in needed.values()),
                **self.stats(job.job_id)}

    def _step_files(self, job: FetchJob, jfd: int, step: int) -> _StepFiles:
        with self.lock:
            known = self.steps.get((job.job_id, step))
        if known is not None:
            return known
        sf: _StepFiles | None = None
        if job.uri is not None and self.peers is not None and self._s3_recently_unreachable():
            sf = self._from_peers_first(job, jfd, step)
        if sf is None and job.uri is not None:
            uri = job.uri
            s3 = self._s3()
            try:
                present = retrying(f"look for step {step} in {uri}", lambda: s3.head(
                    uri.bucket, uri.join(step_name(step), COMMIT)), self.policy, SystemClock())
                if present is not None:
                    marker, manifests = retrying(
                        f"read the manifests of step {step}",
                        lambda: read_remote_step(s3, uri, step), self.policy, SystemClock())
                    sf = _files_of(RemoteStep(marker, manifests), "s3")
            except StageinFailed as exc:
                self.note_s3_unreachable()
                # S3 down: the parts this node lacks may come from the job's nodes (buddy
                # copies, verified on arrival); if none came, S3's error stands.
                if self.peers is None or not self.peers(job.job_id, jfd, job.gid, step):
                    raise FetchError(f"checkpoint: fetch: step {step}: {exc}") from None
                log.warning("fetch: S3 can't be reached; took the parts this node lacked "
                            "from the job's nodes", job_id=job.job_id, step=step,
                            error=str(exc))
            else:
                if sf is None and self.peers is not None:
                    # Not in S3 (a node died before its upload): the same from its buddy.
                    self.peers(job.job_id, jfd, job.gid, step)
        if sf is None:
            # Not in S3 (a local-only run, or not uploaded yet): only the local bytes count,
            # and nothing is ever fetched on the word of a manifest the user could edit.
            try:
                marker, manifests = read_step(jfd, step, job.uid)
            except (CheckpointError, OSError) as exc:
                raise FetchError(f"checkpoint: fetch: step {step} is neither in S3 nor "
                                 f"committed on this node: {exc}") from None
            sf = _files_of(RemoteStep(marker, manifests), "local")
        with self.lock:
            self.steps[(job.job_id, step)] = sf
        return sf

    def _from_peers_first(self, job: FetchJob, jfd: int, step: int) -> _StepFiles | None:
        """S3 couldn't be reached moments ago: the parts this node lacks from the job's nodes
        (verified on arrival), and the step as this node now holds it; None when they
        couldn't make it whole here (S3 is tried as usual)."""
        assert self.peers is not None
        if not self.peers(job.job_id, jfd, job.gid, step):
            return None
        try:
            marker, manifests = read_step(jfd, step, job.uid)
        except (CheckpointError, OSError):
            return None
        log.info("fetch: S3 couldn't be reached moments ago; took the parts this node lacked "
                 "from the job's nodes first", job_id=job.job_id, step=step)
        return _files_of(RemoteStep(marker, manifests), "local")

    def _open_target(self, job: FetchJob, sfd: int, step: int, f: _File) -> tuple[int, bool]:
        """An fd of the file (created owned by the user, at full size); (fd, created)."""
        with self.open_lock:
            return self._open_target_locked(job, sfd, step, f)

    def _open_target_locked(self, job: FetchJob, sfd: int, step: int, f: _File
                            ) -> tuple[int, bool]:
        parts = f.relpath.split("/")
        dfd = os.dup(sfd)
        try:
            for part in parts[:-1]:
                nfd = open_or_make_dir(dfd, part, job.uid, job.gid)
                os.close(dfd)
                dfd = nfd
            created = True
            try:
                fd = os.open(parts[-1], _FILE_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
                os.fchown(fd, job.uid, job.gid)
            except FileExistsError:
                created = False
                try:
                    fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dfd)
                except OSError as exc:
                    raise FetchError(f"checkpoint: fetch: step {step}: couldn't open "
                                     f"{f.relpath}: {os.strerror(exc.errno or 0)} (a symlink?)"
                                     ) from None
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != job.uid or st.st_nlink != 1:
            os.close(fd)
            raise FetchError(f"checkpoint: fetch: step {step}: refusing {f.relpath}: not a "
                             f"regular file with one link owned by uid {job.uid}")
        os.set_blocking(fd, True)
        key = (job.job_id, step, f.relpath)
        if created or st.st_size != f.entry.size:
            os.ftruncate(fd, f.entry.size)  # sparse: blocks land at their offsets
            with self.lock:
                self.present.pop(key, None)
        return fd, created

    def _schedule(self, job: FetchJob, step: int, sf: _StepFiles, f: _File, fd: int,
                  check_local: bool, indices: list[int], counters: FetchCounters
                  ) -> list[Future[None]]:
        out: list[Future[None]] = []
        # Consecutive missing blocks go in one task and one GET (up to request_bytes), so
        # small blocks keep the bytes fetched close to what was asked without small GETs.
        per_get = max(1, self.settings.request_bytes // max(f.block_size, 1))
        with self.lock:
            have = self.present.setdefault((job.job_id, step, f.relpath), set())
            run: list[int] = []

            def flush() -> None:
                if not run:
                    return
                keys = [(job.job_id, step, f.relpath, i) for i in run]
                fut = self.pool.submit(f"job-{job.job_id}", functools.partial(
                    self._blocks, job, step, sf, f, fd, check_local, list(run), counters))
                for key in keys:
                    self.inflight[key] = fut
                fut.add_done_callback(functools.partial(self._done, keys))
                out.append(fut)
                run.clear()

            for i in sorted(set(indices)):
                if i in have:
                    continue
                fut = self.inflight.get((job.job_id, step, f.relpath, i))
                if fut is not None:  # another request is fetching it already
                    flush()
                    out.append(fut)
                    continue
                if run and (i != run[-1] + 1 or len(run) >= per_get):
                    flush()
                run.append(i)
            flush()
        return out

    def _done(self, keys: list[tuple[int, int, str, int]], _fut: Future[None]) -> None:
        with self.lock:
            for key in keys:
                self.inflight.pop(key, None)

    def _blocks(self, job: FetchJob, step: int, sf: _StepFiles, f: _File, fd: int,
                check_local: bool, run: list[int], counters: FetchCounters) -> None:
        """Consecutive blocks ``run``: those already here and verifying are kept, the rest
        come in one ranged GET, each checked against its own CRC32C as it streams in."""
        size, bs, crcs = f.entry.size, f.block_size, f.crcs
        missing = run
        if check_local:
            bad = set(bad_blocks(fd, size, crcs, run, bs))
            for i in run:
                if i not in bad:
                    self._mark(job, step, f, i)
            with self.lock:
                counters.local_blocks += len(run) - len(bad)
            missing = [i for i in run if i in bad]
        if not missing:
            return
        if sf.source != "s3" or job.uri is None:
            raise FetchError(f"checkpoint: fetch: step {step}: {f.relpath} block {missing[0]} "
                             "is not on this node (or does not verify) and the step is not "
                             "in S3")
        # ``missing`` may have holes (blocks verified in place): one GET per consecutive part.
        parts: list[list[int]] = []
        for i in missing:
            if parts and i == parts[-1][-1] + 1:
                parts[-1].append(i)
            else:
                parts.append([i])
        for part in parts:
            start = block_span(part[0], size, bs)[0]
            end = sum(block_span(part[-1], size, bs))
            blocks = BlockCrcs(bs)
            self._get_range(job.uri, step, f.relpath, fd, start, end - start, counters,
                            blocks=blocks)
            got = blocks.finish()
            for n, i in enumerate(part):
                if got[n] == crcs[i]:
                    with self.lock:
                        counters.fetched_blocks += 1
                    self._mark(job, step, f, i)
                else:
                    self._block(job, step, f, fd, i, counters, first_crc=got[n])

    def _block(self, job: FetchJob, step: int, f: _File, fd: int, i: int,
               counters: FetchCounters, first_crc: str) -> None:
        """One block whose bytes arrived wrong: GET it once more, then call it corrupt."""
        assert job.uri is not None
        size, bs, crcs = f.entry.size, f.block_size, f.crcs
        start, length = block_span(i, size, bs)
        log.warning("fetched block does not match its manifest", job_id=job.job_id,
                    step=step, file=f.relpath, block=i, crc32c=first_crc, expected=crcs[i],
                    attempt=1)
        got = self._get_range(job.uri, step, f.relpath, fd, start, length, counters)
        if got == crcs[i]:
            with self.lock:
                counters.fetched_blocks += 1
                counters.refetched_blocks += 1
            self._mark(job, step, f, i)
            return
        log.warning("fetched block does not match its manifest", job_id=job.job_id,
                    step=step, file=f.relpath, block=i, crc32c=got, expected=crcs[i],
                    attempt=2)
        raise CorruptBlock(f"checkpoint: fetch: step {step}: {f.relpath} block {i} (bytes "
                           f"{start}-{start + length - 1}): crc32c {got} from S3, the manifest "
                           f"says {crcs[i]}: the object is corrupt ({CorruptStep.MARK})")

    def _mark(self, job: FetchJob, step: int, f: _File, i: int) -> None:
        with self.lock:
            self.present.setdefault((job.job_id, step, f.relpath), set()).add(i)

    def _buffer(self) -> memoryview:
        """This thread's reused read buffer: a GET's bytes pass through it, in cache for
        the CRC32C and the pwrite, with no allocation per chunk."""
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(_CHUNK))
        return buf

    def _get_range(self, uri: S3Uri, step: int, relpath: str, fd: int, start: int, length: int,
                   counters: FetchCounters, blocks: BlockCrcs | None = None) -> str:
        """GET ``length`` bytes at ``start`` (in requests of at most request_bytes), write
        them at their offset; the CRC32C of what arrived (``blocks``, when given, gets the
        bytes too, for per-block CRC32Cs)."""
        s3 = self._s3()
        key = uri.join(step_name(step), relpath)
        crc, pos, end = 0, start, start + length
        while pos < end:
            last = min(end, pos + self.settings.request_bytes) - 1
            first = pos

            def get(first: int = first, last: int = last) -> Any:
                def one() -> Any:
                    return s3.client.get_object(Bucket=uri.bucket, Key=key,
                                                Range=f"bytes={first}-{last}")

                return s3.call(f"get {key} bytes {first}-{last}", one)

            try:
                resp = retrying(f"get {key} bytes {first}-{last}", get, self.policy,
                                SystemClock())
                body = resp["Body"]
                direct = direct_stream(body)
                buf = self._buffer()
                try:
                    while pos <= last:
                        n = read_into(body, buf[:min(len(buf), last + 1 - pos)], direct)
                        if not n:
                            break
                        chunk = buf[:n]
                        crc = crc32c_extend(crc, chunk)
                        if blocks is not None:
                            blocks.update(chunk)
                        pwrite_all(fd, chunk, pos)
                        pos += n
                finally:
                    body.close()
            except StageinFailed as exc:
                raise FetchError(f"checkpoint: fetch: step {step}: {exc}") from None
            except S3Error as exc:
                raise FetchError(f"checkpoint: fetch: step {step}: {exc}") from None
            except (OSError, TransientS3Error) as exc:
                raise FetchError(f"checkpoint: fetch: step {step}: couldn't get {key}: {exc}"
                                 ) from None
            if pos != last + 1:
                raise FetchError(f"checkpoint: fetch: step {step}: {key}: short answer at "
                                 f"byte {pos}")
            with self.lock:
                counters.get_requests += 1
                counters.fetched_bytes += last + 1 - first
        return crc_hex(crc)


def _files_of(remote: RemoteStep, source: str) -> _StepFiles:
    sf = _StepFiles(source)
    for rank, m in remote.manifests.items():
        for entry in m.files:
            rel = f"rank-{rank:05d}/{entry.path}"
            sf.files[rel] = _File(rel, entry)
    return sf


def _needed_blocks(step: int, sf: _StepFiles, ranges: list[ByteRange]) -> dict[str, set[int]]:
    needed: dict[str, set[int]] = {}
    for r in ranges:
        f = sf.files.get(r.relpath)
        if f is None:
            head = r.relpath.partition("/")[0]
            why = "no such rank" if parse_rank(head) is None else "not in its rank's manifest"
            raise FetchError(f"checkpoint: fetch: step {step}: {r.relpath}: {why}")
        try:
            blocks = covering(r.offset, r.length, f.entry.size, f.block_size)
        except ValueError as exc:
            raise FetchError(f"checkpoint: fetch: step {step}: {r.relpath}: {exc}") from None
        needed.setdefault(r.relpath, set()).update(blocks)
    return {k: v for k, v in needed.items() if v}
