"""A restoring node gets the parts of a step it lacks from the job's other nodes.

Used where S3 can't give a step: it is down, or it does not have the newest step because
the node that saved a part died before uploading it. Two moments:

* stage-in (a node that joined at a relaunch, or any stage-in whose S3 failed): the
  node asks every other node of its job for the newest step it committed (its manifests,
  and ``.metadata`` where rank 0 is), takes the nodes that don't answer within
  ``checkpoint.buddy_wait_s`` as lost, and asks the others for the copies they hold of
  the lost nodes (the ring puts each node's copy on the next node). buddy_source.choose
  then picks the newest step every rank of which can be had; its commit marker, every
  rank's manifest and ``.metadata`` are written into the job's step dir, as stage-in does
  for a step in S3, and the stage-in says where each part is;
* ``ckpt.fetch`` of a step that S3 can't give: the ranks whose files are not on this node
  are pulled whole (a live node's own part from it, a lost node's from the buddy that
  holds its copy), verified on arrival (buddy_store.py), and copied into the job's step
  dir for the job's user, where the fetch verifies every block it serves as usual.

Nothing older is taken quietly: a newer step that can't be had is named, with its missing
ranks, in the stage-in's fallbacks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slurm_resilience import safefs
from slurm_resilience.checkpoint.commit import (
    MANIFEST,
    CheckpointError,
    Manifest,
    check_save_ids,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.staging import open_dir_at
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.buddy_proto import PullPiece
from slurm_resilience.uploader.buddy_ring import buddy_of
from slurm_resilience.uploader.buddy_source import Choice, Copy, Where, choose
from slurm_resilience.uploader.buddy_store import METADATA, HeldCopy, Refused
from slurm_resilience.uploader.rootfs import committed_steps_at, read_step
from slurm_resilience.uploader.stagein import RemoteStep, place_metadata

if TYPE_CHECKING:
    from slurm_resilience.uploader.buddy_service import BuddyService, LocalJob

log = get_logger("checkpoint.buddy")
COPY_CHUNK = 8 * 1024 * 1024


class PullWait:
    """The answers to one round of pulls: each asked node's transfers, then its end."""

    def __init__(self, job_id: int, asked: set[str], meta: bool, sources: set[str]):
        self.job_id, self.asked, self.meta = job_id, set(asked), meta
        self.sources = set(sources) | set(asked)
        self.cond = threading.Condition()
        self.done: set[str] = set()
        self.copies: dict[str, HeldCopy] = {}  # source → the copy received

    def wants(self, job_id: int, source: str, meta: bool) -> bool:
        return job_id == self.job_id and meta == self.meta and source in self.sources

    def __call__(self, job_id: int, sender: str, meta: bool, copy: HeldCopy | None) -> None:
        if job_id != self.job_id or meta != self.meta or sender not in self.asked:
            return
        with self.cond:
            if copy is None:
                self.done.add(sender)
            else:
                self.copies[copy.source] = copy
            self.cond.notify_all()

    def wait(self, senders: set[str], deadline: float) -> None:
        with self.cond:
            while not senders <= self.done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)


def pull(svc: BuddyService, job: LocalJob, targets: list[str], piece: PullPiece,
         sources: set[str], wait_s: float) -> tuple[set[str], dict[str, HeldCopy]]:
    """Ask ``targets``; (the nodes that answered whole, the copies received by source)."""
    refusing = svc.refusing(targets)
    if refusing:
        log.info("buddy: nodes of the job take no connection; not asked", job_id=job.job_id,
                 nodes=refusing)
        targets = [t for t in targets if t not in refusing]
    w = PullWait(job.job_id, set(targets), piece.meta, sources)
    with svc.lock:
        svc.waiters.append(w)
    try:
        delivered: set[str] = set()
        threads = []

        def ask(target: str) -> None:
            if svc.send_piece(job, target, piece):
                with w.cond:
                    delivered.add(target)

        for target in targets:
            t = threading.Thread(target=ask, args=(target,), name="buddy-pull", daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + wait_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with w.cond:
            asked = set(delivered)
        w.wait(asked, deadline)
        with w.cond:
            return set(w.done), dict(w.copies)
    finally:
        with svc.lock:
            svc.waiters.remove(w)


@dataclass
class Peers:
    """What the job's other nodes said: who answered, their parts, the lost nodes' copies."""

    alive: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    own: dict[str, HeldCopy] = field(default_factory=dict)  # node → its part (metadata)
    copies: dict[str, tuple[str, HeldCopy]] = field(default_factory=dict)  # lost → (holder, copy)


def discover(svc: BuddyService, job: LocalJob, step: int = -1) -> Peers:
    """Every other node's part of ``step`` (-1: its newest), and the lost nodes' copies."""
    wait_s = svc.live_cfg.checkpoint.buddy_wait_s
    others = sorted(set(job.nodes) - {svc.node})
    answered, own = pull(svc, job, others, PullPiece(step, True, True, ()), set(), wait_s)
    peers = Peers(alive=answered, lost=set(others) - answered, own=own)
    try:
        here = svc.store.held(job.job_id)
    except Refused as exc:
        log.error("buddy: this node's buddy area can't be read", job_id=job.job_id,
                  error=str(exc))
        here = {}
    for lost in sorted(peers.lost):
        if lost in here:
            peers.copies[lost] = (svc.node, here[lost])
    ask = sorted(peers.lost - set(peers.copies))
    holders = sorted({h for n in ask if (h := buddy_of(n, job.nodes)) in peers.alive})
    if ask and holders:
        _, got = pull(svc, job, holders, PullPiece(step, False, True, tuple(ask)), set(ask),
                      wait_s)
        for lost, copy in got.items():
            holder = buddy_of(lost, job.nodes) or "?"
            peers.copies[lost] = (holder, copy)
    log.info("buddy: asked the job's other nodes for their parts", job_id=job.job_id,
             answered=sorted(peers.alive), lost=sorted(peers.lost),
             copies={n: f"step {c.step} on {h}" for n, (h, c) in peers.copies.items()})
    return peers


def copies_of(svc: BuddyService, job: LocalJob, jfd: int, peers: Peers) -> list[Copy]:
    """Every part the choice can use: this node's own steps, the live nodes' parts (read
    where they are) and the lost nodes' copies (on their buddy)."""
    out = []
    for step in committed_steps_at(jfd)[-4:]:
        try:
            marker, manifests = read_step(jfd, step, job.uid)
        except (CheckpointError, OSError):
            continue
        mine = frozenset(r for r, m in manifests.items() if has_files(jfd, step, r, m))
        if mine:
            out.append(Copy(step, svc.node, mine, marker.world_size, Where.LOCAL, svc.node))
    for node, c in peers.own.items():
        out.append(Copy(c.step, node, c.ranks, c.marker.world_size, Where.LOCAL, node))
    for node, (holder, c) in peers.copies.items():
        out.append(Copy(c.step, node, c.ranks, c.marker.world_size, Where.BUDDY, holder))
    return out


def has_files(jfd: int, step: int, rank: int, m: Manifest) -> bool:
    """Every file of the rank's manifest is on this node at its size (not a stub)."""
    try:
        rfd = open_dir_at(jfd, f"{step_name(step)}/{rank_name(rank)}")
    except (CheckpointError, OSError):
        return False
    try:
        for f in m.files:
            try:
                st = os.stat(f.path, dir_fd=rfd, follow_symlinks=False)
            except OSError:
                return False
            if st.st_size != f.size:
                return False
        return True
    finally:
        os.close(rfd)


@dataclass(frozen=True)
class Staged:
    """A step stage-in takes from the job's nodes, and where each part is."""

    choice: Choice
    nbytes: int


def stage(svc: BuddyService, job: LocalJob, jfd: int, gid: int, s3_steps: set[int],
          s3_error: str) -> Staged | None:
    """Stage-in's path through the job's nodes (see the module doc); None when the choice
    is no better than S3's (S3 has the step, every part not here comes from S3)."""
    peers = discover(svc, job)
    choice = choose(copies_of(svc, job, jfd, peers), s3_steps, s3_error)
    for p in choice.passed_over:
        log.error("buddy: a newer committed step can't be had from any node or S3",
                  job_id=job.job_id, step=p.step, reason=p.reason)
    if choice.step is None or choice.step in s3_steps:
        return None  # nothing here, or S3 has it: stage-in's own path
    step = choice.step
    manifests: dict[int, Manifest] = {}
    marker = None
    metadata = b""
    parts = [c for c in peers.own.values() if c.step == step]
    parts += [c for _, c in peers.copies.values() if c.step == step]
    with contextlib.suppress(CheckpointError, OSError):
        marker, local = read_step(jfd, step, job.uid)
        manifests.update(local)
        if 0 in local:
            metadata = _read_local(jfd, step, job.uid)
    for c in parts:
        marker = marker or c.marker
        for r, m in c.manifests.items():
            manifests.setdefault(r, m)
        if 0 in c.manifests and not metadata:
            metadata = _read_held(svc, job, c)
    if marker is None or set(manifests) != set(range(marker.world_size)) or not metadata:
        return None
    try:  # parts of two saves of one step number (a requeue) never mix
        check_save_ids(step, marker, manifests, f"step {step} from the job's nodes")
    except CheckpointError as exc:
        log.error("buddy: the job's nodes hold parts of different saves of the step",
                  job_id=job.job_id, step=step, error=str(exc))
        return None
    place_metadata(jfd, step, RemoteStep(marker, manifests), metadata, job.uid, gid)
    log.info("buddy: stage-in took the step from the job's nodes", job_id=job.job_id,
             step=step, parts=choice.summary(), passed_over=[p.step for p in choice.passed_over])
    return Staged(choice, len(metadata) + sum(len(m.to_json()) for m in manifests.values()))


def _read_local(jfd: int, step: int, uid: int) -> bytes:
    from slurm_resilience.uploader.rootfs import read_small

    return read_small(jfd, f"{step_name(step)}/{rank_name(0)}/{METADATA}", uid, 1 << 30)


def _read_held(svc: BuddyService, job: LocalJob, c: HeldCopy) -> bytes:
    try:
        fd = svc.store.open_file(job.job_id, c.source, c.step, f"{rank_name(0)}/{METADATA}",
                                 c.meta)
    except (Refused, OSError):
        return b""
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def complete(svc: BuddyService, job: LocalJob, jfd: int, gid: int, step: int) -> list[str]:
    """Bring every rank part of ``step`` this node lacks from the job's nodes into its step
    dir; what came from where (``rank 1 from node3 (buddy copy of node2)``)."""
    missing = missing_ranks(jfd, step, job.uid)
    if not missing:
        return []
    peers = discover(svc, job, step)
    wait_s = svc.live_cfg.checkpoint.buddy_wait_s
    done: list[str] = []
    for node, c in sorted(peers.own.items()):
        want = sorted(set(missing) & c.ranks)
        if not want or c.step != step:
            continue
        _, got = pull(svc, job, [node], PullPiece(step, True, False, ()), {node}, wait_s)
        if node in got:
            done += _place(svc, job, jfd, gid, got[node], want, f"from {node}")
    for lost, (holder, c) in sorted(peers.copies.items()):
        want = sorted(set(missing) & c.ranks)
        if not want or c.step != step:
            continue
        full = svc.store.held(job.job_id).get(lost) if holder == svc.node else None
        if full is None or full.step != step:
            _, got = pull(svc, job, [holder], PullPiece(step, False, False, (lost,)), {lost},
                          wait_s)
            full = got.get(lost)
        if full is not None:
            done += _place(svc, job, jfd, gid, full, want, f"from {holder} (buddy copy of "
                                                           f"{lost})")
            svc.count("used")
            log.info("buddy: a restore used a buddy copy", job_id=job.job_id, step=step,
                     source=lost, holder=holder, ranks=want)
    return done


def missing_ranks(jfd: int, step: int, uid: int) -> list[int]:
    """The ranks of ``step`` whose files are not all on this node."""
    marker, manifests = read_step(jfd, step, uid)
    return sorted(r for r in range(marker.world_size)
                  if r not in manifests or not has_files(jfd, step, r, manifests[r]))


def _place(svc: BuddyService, job: LocalJob, jfd: int, gid: int, c: HeldCopy, ranks: list[int],
           where: str) -> list[str]:
    """Copy the files of ``ranks`` of a verified copy into the job's step dir, owned by the
    job's user (a part already there is left alone)."""
    out: list[str] = []
    marker, _ = read_step(jfd, c.step, job.uid)
    if c.marker.save_id != marker.save_id:
        log.error("buddy: a part of another save of the step is not placed",
                  job_id=job.job_id, step=c.step, source=c.source,
                  save_id=c.marker.save_id, here=marker.save_id)
        return out
    sfd = open_dir_at(jfd, step_name(c.step))
    try:
        for r in ranks:
            m = c.manifests[r]
            rfd = safefs.open_or_make_owned_dir(sfd, rank_name(r), job.uid, gid)
            try:
                for f in m.files:
                    head, _, name = f.path.rpartition("/")
                    pfd = safefs.makedirs_owned_at(rfd, head, job.uid, gid) if head \
                        else os.dup(rfd)
                    try:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(name, dir_fd=pfd)  # a stub a fetch created
                        dst = safefs.create_owned(pfd, name, job.uid, gid)
                    finally:
                        os.close(pfd)
                    src = svc.store.open_file(job.job_id, c.source, c.step,
                                              f"{rank_name(r)}/{f.path}", c.meta)
                    try:
                        _copy(src, dst, f.size)
                        os.fsync(dst)
                    finally:
                        os.close(src)
                        os.close(dst)
                with contextlib.suppress(FileExistsError):
                    safefs.write_new(rfd, MANIFEST, m.to_json(), uid=job.uid, gid=gid,
                                     durable=True)
            finally:
                os.close(rfd)
            out.append(f"rank {r} {where}")
    finally:
        os.close(sfd)
    return out


def _copy(src: int, dst: int, size: int) -> None:
    offset = 0
    while offset < size:
        data = os.pread(src, min(COPY_CHUNK, size - offset), offset)
        if not data:
            raise OSError(f"a buddy copy ended at {offset} of {size} bytes")
        os.pwrite(dst, data, offset)
        offset += len(data)
