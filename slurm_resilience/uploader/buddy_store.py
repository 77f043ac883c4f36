"""The receiving side of buddy copies: a root-owned area on this node's staging NVMe.

Layout (every level owned by the agent's uid, mode 0700, opened with O_NOFOLLOW and
checked with fstat; anything else there, a link included, is refused, never followed)::

    <staging_root>/.buddy/job-<id>/from-<node>/step-N/            a verified copy
        COMMIT.json, rank-R/MANIFEST.json, rank-R/<files>        the staging layout
    <staging_root>/.buddy/job-<id>/from-<node>/.incoming-step-N/  a transfer in progress
    <staging_root>/.buddy/job-<id>/meta-<node>/step-N/            a node's manifests (and
                                                                 .metadata) a restore here
                                                                 asked for

A copy is accepted only from a node of the same job whose buddy this node is (the ring of
buddy_ring.py over the job's nodes as this agent knows them, never as the sender says),
only for a step newer than the one held from that node, only up to the step's declared
size (the sum of its manifests, which must match) and within the job's buddy quota on
this disk, one transfer per source at a time (a newer step's offer replaces an
unfinished older one). Bytes arrive in order; a chunk out of order or past its file's
size aborts the transfer. At the end every file is checked against its manifest (size,
CRC32C, every block's CRC32C) before the directory is renamed into place; then the older
copy from that node is removed. A torn or partial copy is never renamed, so a
``step-N`` directory here is always a verified copy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from dataclasses import dataclass, field

from slurm_resilience import safefs
from slurm_resilience.checkpoint.blocks import file_checksums
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CommitMarker,
    Manifest,
    check_save_ids,
    parse_step,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.dcp_verify import check_manifest
from slurm_resilience.checkpoint.quota import Quota
from slurm_resilience.uploader.buddy_ring import buddy_of
from slurm_resilience.uploader.rootfs import read_small

AREA = ".buddy"
METADATA = ".metadata"  # DCP's metadata, in rank 0's part: every restoring node needs it
INCOMING = ".incoming-"
SMALL_LIMIT = 16 * 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """A buddy transfer (or one chunk of it) this node does not take; says why."""


@dataclass(frozen=True)
class JobFacts:
    """What this agent itself knows of a job running here (from Slurm, not the sender)."""

    job_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Offer:
    """The start of a transfer: the source's commit marker and the manifests of its ranks."""

    job_id: int
    source: str
    step: int
    marker: CommitMarker
    manifests: dict[int, Manifest]
    total_bytes: int  # declared: must equal the sum of the files sent
    meta: bool = False  # the step's metadata only (``.metadata``), pulled by a restore

    def files(self) -> list[tuple[str, int]]:
        """(path relative to the step, size) in the order the bytes are sent."""
        return [(f"{rank_name(r)}/{f.path}", f.size)
                for r, m in sorted(self.manifests.items()) for f in m.files
                if not self.meta or f.path == METADATA]


@dataclass(frozen=True)
class HeldCopy:
    """A verified copy of ``source``'s part of ``step`` kept here."""

    job_id: int
    source: str
    step: int
    marker: CommitMarker
    manifests: dict[int, Manifest]
    meta: bool = False  # only the manifests and ``.metadata`` are here

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(self.manifests)

    @property
    def total_bytes(self) -> int:
        """The bytes of the files kept here."""
        return sum(f.size for m in self.manifests.values() for f in m.files
                   if not self.meta or f.path == METADATA)


@dataclass
class _Transfer:
    offer: Offer
    files: list[tuple[str, int]]
    index: int = 0  # the file the next chunk belongs to
    offset: int = 0  # its offset there
    received: int = 0
    fds: dict[str, int] = field(default_factory=dict)


def _refuse_unsafe(what: str, exc: OSError) -> Refused:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return Refused(f"{what} is a symlink or not a directory; refusing it")
    return Refused(f"{what}: {exc.strerror or exc}")


def _own_dir(parent_fd: int, name: str, what: str) -> int:
    """``name`` under ``parent_fd``, created if missing: a real directory owned by this
    process's uid with mode 0700, else Refused."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise _refuse_unsafe(what, exc) from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise Refused(f"{what} is owned by uid {st.st_uid} with mode "
                      f"{stat.S_IMODE(st.st_mode):o}, not this agent's 0700; refusing it")
    return fd


class BuddyStore:
    """This node's buddy area under ``staging_root`` (see the module doc)."""

    def __init__(self, staging_root: str, node: str):
        self.staging_root = staging_root
        self.node = node
        self.lock = threading.Lock()
        self.transfers: dict[tuple[int, str, bool], _Transfer] = {}

    # -- directories ---------------------------------------------------------------------------

    def _open_source(self, job_id: int, source: str, meta: bool = False) -> int:
        try:
            root = safefs.open_dir(self.staging_root)
        except OSError as exc:
            raise _refuse_unsafe(f"staging root {self.staging_root}", exc) from None
        fds = [root]
        try:
            fds.append(_own_dir(fds[-1], AREA, f"{self.staging_root}/{AREA}"))
            fds.append(_own_dir(fds[-1], f"job-{job_id}", f"{AREA}/job-{job_id}"))
            name = f"{'meta' if meta else 'from'}-{source}"
            return _own_dir(fds[-1], name, f"{AREA}/job-{job_id}/{name}")
        finally:
            for fd in fds:
                os.close(fd)

    # -- receiving -----------------------------------------------------------------------------

    def begin(self, job: JobFacts | None, offer: Offer, quota: Quota, used: int,
              asked: bool = False) -> None:
        """Accept ``offer`` or raise Refused; ``used``: bytes the job's buddy area holds;
        ``asked``: this node asked the source for it (a restore's pull), so it need not be
        the source's buddy."""
        if job is None or job.job_id != offer.job_id:
            raise Refused(f"job {offer.job_id} is not running on {self.node}")
        if offer.source not in job.nodes:
            raise Refused(f"{offer.source} is not a node of job {offer.job_id}")
        buddy = buddy_of(offer.source, job.nodes)
        if offer.meta and not asked:
            raise Refused(f"metadata of step {offer.step} from {offer.source} that "
                          f"{self.node} did not ask for")
        if buddy != self.node and not asked:
            raise Refused(f"{offer.source}'s buddy in job {offer.job_id} is {buddy}, "
                          f"not {self.node}")
        _check_offer(offer)
        key = (offer.job_id, offer.source, offer.meta)
        held = self.held(offer.job_id, offer.meta).get(offer.source)
        if held is not None and held.step > offer.step:
            raise Refused(f"{self.node} already holds step {held.step} of {offer.source}; "
                          f"step {offer.step} is older")
        if used + offer.total_bytes > quota.limit:
            raise Refused(f"step {offer.step} of {offer.source} ({offer.total_bytes:,} bytes) "
                          f"would take job {offer.job_id}'s buddy area past its quota "
                          f"({used:,} of {quota.limit:,} bytes used; "
                          f"checkpoint.buddy_quota_fraction={quota.fraction:g})")
        with self.lock:
            running = self.transfers.get(key)
            if running is not None and running.offer.step >= offer.step:
                raise Refused(f"a transfer of step {running.offer.step} from {offer.source} "
                              "is under way")
            if running is not None:
                self._drop(running)
            self.transfers[key] = _Transfer(offer, offer.files())
        try:
            self._make_incoming(offer)
        except BaseException:
            with self.lock:
                self.transfers.pop(key, None)
            raise

    def _make_incoming(self, offer: Offer) -> None:
        sfd = self._open_source(offer.job_id, offer.source, offer.meta)
        try:
            name = INCOMING + step_name(offer.step)
            safefs.remove_tree_at(sfd, name, missing_ok=True)
            os.mkdir(name, 0o700, dir_fd=sfd)
        finally:
            os.close(sfd)

    def chunk(self, job_id: int, source: str, step: int, relpath: str, offset: int,
              data: bytes, meta: bool = False) -> None:
        """Write the next bytes of the transfer; out of order or oversized: Refused (and the
        transfer is dropped)."""
        with self.lock:
            t = self.transfers.get((job_id, source, meta))
            if t is None or t.offer.step != step:
                raise Refused(f"no transfer of step {step} from {source} for job {job_id} "
                              "is under way")
            try:
                self._write(t, relpath, offset, data)
            except Refused:
                self.transfers.pop((job_id, source, meta), None)
                self._drop(t)
                raise

    def _write(self, t: _Transfer, relpath: str, offset: int, data: bytes) -> None:
        step, source = t.offer.step, t.offer.source
        if not data:
            return  # nothing to place (empty files are made at the end)
        while t.index < len(t.files) and t.files[t.index][1] == t.offset:
            t.index, t.offset = t.index + 1, 0  # files done (empty ones too)
        if t.index >= len(t.files):
            raise Refused(f"step {step} from {source}: more bytes than its manifests list")
        path, size = t.files[t.index]
        if (relpath, offset) != (path, t.offset):
            raise Refused(f"step {step} from {source}: got {relpath}@{offset}, expected "
                          f"{path}@{t.offset}")
        if offset + len(data) > size:
            raise Refused(f"step {step} from {source}: {relpath} would grow past its "
                          f"{size:,} bytes")
        fd = t.fds.get(path) or self._create(t, path)
        os.pwrite(fd, data, offset)
        t.offset += len(data)
        t.received += len(data)

    def _create(self, t: _Transfer, path: str) -> int:
        sfd = self._open_source(t.offer.job_id, t.offer.source, t.offer.meta)
        try:
            ifd = os.open(INCOMING + step_name(t.offer.step), _DIR_FLAGS, dir_fd=sfd)
        finally:
            os.close(sfd)
        try:
            head, _, name = path.rpartition("/")
            pfd = safefs.makedirs_owned_at(ifd, head, os.geteuid(), os.getegid())
            try:
                fd = safefs.create_owned(pfd, name, os.geteuid(), os.getegid())
            finally:
                os.close(pfd)
        finally:
            os.close(ifd)
        t.fds[path] = fd
        return fd

    def finish(self, job_id: int, source: str, step: int, meta: bool = False) -> HeldCopy:
        """Verify the whole copy and put it in place (dropping older copies from
        ``source``); a torn copy is removed and Refused."""
        with self.lock:
            t = self.transfers.pop((job_id, source, meta), None)
        if t is None or t.offer.step != step:
            raise Refused(f"no transfer of step {step} from {source} for job {job_id} is "
                          "under way")
        try:
            _verify(t)
        except Refused:
            self._drop(t)
            raise
        offer = t.offer
        for path, size in t.files:
            if size == 0 and path not in t.fds:
                self._create(t, path)
        _close_all(t)
        sfd = self._open_source(job_id, source, meta)
        try:
            name = INCOMING + step_name(step)
            ifd = os.open(name, _DIR_FLAGS, dir_fd=sfd)
            try:
                for rank, m in offer.manifests.items():
                    rfd = safefs.makedirs_owned_at(ifd, rank_name(rank), os.geteuid(),
                                                   os.getegid())
                    try:
                        safefs.write_new(rfd, MANIFEST, m.to_json(), durable=True)
                    finally:
                        os.close(rfd)
                safefs.write_new(ifd, COMMIT, offer.marker.to_json(), durable=True)
                os.fsync(ifd)
            finally:
                os.close(ifd)
            # The same step again (a restore's second pull): the new copy verified too.
            safefs.remove_tree_at(sfd, step_name(step), missing_ok=True)
            os.rename(name, step_name(step), src_dir_fd=sfd, dst_dir_fd=sfd)
            os.fsync(sfd)
            for other in os.listdir(sfd):  # keep only the newest verified copy
                old = parse_step(other.removeprefix(INCOMING))
                if old is not None and old < step:
                    safefs.remove_tree_at(sfd, other, missing_ok=True)
        finally:
            os.close(sfd)
        return HeldCopy(job_id, source, step, offer.marker, dict(offer.manifests), meta)

    def abort(self, job_id: int, source: str, meta: bool = False) -> None:
        with self.lock:
            t = self.transfers.pop((job_id, source, meta), None)
        if t is not None:
            self._drop(t)

    def _drop(self, t: _Transfer) -> None:
        _close_all(t)
        with contextlib.suppress(OSError, Refused):
            sfd = self._open_source(t.offer.job_id, t.offer.source, t.offer.meta)
            try:
                safefs.remove_tree_at(sfd, INCOMING + step_name(t.offer.step), missing_ok=True)
            finally:
                os.close(sfd)

    # -- what is held --------------------------------------------------------------------------

    def held(self, job_id: int, meta: bool = False) -> dict[str, HeldCopy]:
        """The verified copies kept for ``job_id``: source node → its newest step here
        (``meta``: the metadata pulled from each node instead)."""
        out: dict[str, HeldCopy] = {}
        try:
            root = safefs.open_dir(self.staging_root)
        except OSError:
            return out
        try:
            try:
                afd = os.open(AREA, _DIR_FLAGS, dir_fd=root)
            except FileNotFoundError:
                return out
            except OSError as exc:
                raise _refuse_unsafe(f"{self.staging_root}/{AREA}", exc) from None
            try:
                try:
                    jfd = os.open(f"job-{job_id}", _DIR_FLAGS, dir_fd=afd)
                except FileNotFoundError:
                    return out
                except OSError as exc:
                    raise _refuse_unsafe(f"{AREA}/job-{job_id}", exc) from None
                try:
                    prefix = "meta-" if meta else "from-"
                    for name in os.listdir(jfd):
                        if name.startswith(prefix):
                            copy = self._read_held(jfd, job_id, name, meta)
                            if copy is not None:
                                out[copy.source] = copy
                finally:
                    os.close(jfd)
            finally:
                os.close(afd)
        finally:
            os.close(root)
        return out

    def _read_held(self, jfd: int, job_id: int, name: str, meta: bool) -> HeldCopy | None:
        source = name.partition("-")[2]
        sfd = os.open(name, _DIR_FLAGS, dir_fd=jfd)
        try:
            steps = sorted(s for s in map(parse_step, os.listdir(sfd)) if s is not None)
            if not steps:
                return None
            step = steps[-1]
            stfd = os.open(step_name(step), _DIR_FLAGS, dir_fd=sfd)
            try:
                marker = CommitMarker.from_json(read_small(stfd, COMMIT, os.geteuid()))
                manifests = {}
                for name in os.listdir(stfd):
                    if name.startswith("rank-"):
                        m = Manifest.from_json(read_small(stfd, f"{name}/{MANIFEST}", os.geteuid()))
                        manifests[m.rank] = m
                return HeldCopy(job_id, source, step, marker, manifests, meta)
            finally:
                os.close(stfd)
        finally:
            os.close(sfd)

    def used(self, job_id: int) -> int:
        """Bytes of verified copies and transfers under way for ``job_id``."""
        total = sum(c.total_bytes for c in self.held(job_id).values())
        with self.lock:
            total += sum(t.offer.total_bytes for (j, _, _), t in self.transfers.items()
                         if j == job_id)
        return total

    def open_file(self, job_id: int, source: str, step: int, relpath: str,
                  meta: bool = False) -> int:
        """An fd of a file of a verified copy (for a restore that reads it)."""
        head, _, name = f"{step_name(step)}/{relpath}".rpartition("/")
        sfd = self._open_source(job_id, source, meta)
        try:
            pfd = safefs.open_dir_at(sfd, head)
        finally:
            os.close(sfd)
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        finally:
            os.close(pfd)

    def remove_job(self, job_id: int) -> None:
        """The job ended: drop its transfers and its whole buddy area on this node."""
        with self.lock:
            mine = [k for k in self.transfers if k[0] == job_id]
            ts = [self.transfers.pop(k) for k in mine]
        for t in ts:
            _close_all(t)
        try:
            root = safefs.open_dir(self.staging_root)
        except OSError:
            return
        try:
            try:
                afd = os.open(AREA, _DIR_FLAGS, dir_fd=root)
            except FileNotFoundError:
                return
            try:
                safefs.remove_tree_at(afd, f"job-{job_id}", missing_ok=True)
            finally:
                os.close(afd)
        finally:
            os.close(root)

    def jobs(self) -> list[int]:
        """Jobs with a buddy area here (for the cleanup of ended jobs)."""
        try:
            root = safefs.open_dir(self.staging_root)
        except OSError:
            return []
        try:
            try:
                afd = os.open(AREA, _DIR_FLAGS, dir_fd=root)
            except FileNotFoundError:
                return []
            try:
                names = os.listdir(afd)
            finally:
                os.close(afd)
        finally:
            os.close(root)
        return sorted(int(n[4:]) for n in names if n.startswith("job-") and n[4:].isdigit())


def _check_offer(offer: Offer) -> None:
    m0 = offer.marker
    if m0.step != offer.step:
        raise Refused(f"offer of step {offer.step} carries the commit marker of step {m0.step}")
    if not offer.manifests:
        raise Refused(f"offer of step {offer.step} from {offer.source} has no rank parts")
    try:
        for rank, m in offer.manifests.items():
            if m.step != offer.step or m.rank != rank or not 0 <= rank < m0.world_size:
                raise Refused(f"offer of step {offer.step}: the manifest of rank {rank} says "
                              f"step {m.step} rank {m.rank} (world size {m0.world_size})")
            check_manifest(m, f"buddy offer {step_name(offer.step)}/{rank_name(rank)}")
        check_save_ids(offer.step, m0, offer.manifests, f"buddy offer from {offer.source}")
    except CheckpointError as exc:
        raise Refused(str(exc)) from None
    declared = sum(size for _, size in offer.files())
    if declared != offer.total_bytes:
        raise Refused(f"offer of step {offer.step} declares {offer.total_bytes:,} bytes, its "
                      f"manifests list {declared:,}")


def _verify(t: _Transfer) -> None:
    offer = t.offer
    if t.received != offer.total_bytes:
        raise Refused(f"step {offer.step} from {offer.source}: torn copy, {t.received:,} of "
                      f"{offer.total_bytes:,} bytes arrived")
    sent = {p for p, _ in t.files}
    for rank, m in offer.manifests.items():
        for f in m.files:
            path = f"{rank_name(rank)}/{f.path}"
            if path not in sent:
                continue  # metadata only: the data stays on its node
            fd = t.fds.get(path)
            if fd is None and f.size == 0:
                continue  # created empty at the end
            if fd is None:
                raise Refused(f"step {offer.step} from {offer.source}: {path} never arrived")
            size, crc, blocks = file_checksums(fd, f.block_size)
            if size != f.size or crc != f.crc32c or (f.blocks and blocks != f.blocks):
                bad = [i for i, (a, b) in enumerate(zip(blocks, f.blocks, strict=False))
                       if a != b][:4]
                raise Refused(f"step {offer.step} from {offer.source}: {path} does not verify "
                              f"(size {size:,}, crc32c {crc}; manifest: size {f.size:,}, "
                              f"crc32c {f.crc32c}; bad blocks {bad})")
            os.fsync(fd)


def _close_all(t: _Transfer) -> None:
    for fd in t.fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    t.fds.clear()

