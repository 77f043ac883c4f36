"""The agent's ``buddy`` service: send this node's newest step part to its buddy, keep the
copies other nodes send here, and answer a restoring node's pulls.

* Sending: each tick, for every job running here (the hang watcher's job records: owner
  and node list from the prolog), the newest step committed in the job's staging dir
  that was not yet sent goes to the job's ring buddy (buddy_ring.py), one transfer per
  job at a time, on a thread at nice 19, at most ``checkpoint.buddy_rate`` bytes a second
  (buddy_send.py). A newer commit while one is under way is sent next.
* Receiving: ``buddy`` messages on the agents' exchange (munge-authenticated, bound to the
  job, the sender and this node) go to the store (buddy_store.py) with this node's own
  view of the job; every refusal is answered, logged and counted.
* Pulls: a restoring node asks for parts it lacks (buddy_peers.py); this node pushes its
  own part of the step (manifests and ``.metadata``, or every file) and the buddy copies it
  holds of the nodes named, or an empty answer when it has none.
* Hand-off: a step whose own part this node uploaded and that waits for ranks held here,
  from a node no longer in the job, gets them uploaded from the copy (buddy_handoff.py,
  called from the upload's commit).
* The job's end (no longer running here): its transfers are dropped and its buddy area
  removed, once the uploader has no step of the job left to upload (a copy held here may
  be what completes it; the uploader gives such a step up after an hour).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from slurm_resilience import events
from slurm_resilience.checkpoint.commit import CheckpointError, step_name
from slurm_resilience.checkpoint.quota import job_quota
from slurm_resilience.checkpoint.staging import open_dir_at, open_job_dir, open_owned_file
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text
from slurm_resilience.transport.reach import connect_errors
from slurm_resilience.transport.wire import Kind, Message
from slurm_resilience.uploader import buddy_peers as peers
from slurm_resilience.uploader.buddy_handoff import HandOffs
from slurm_resilience.uploader.buddy_peers import Staged
from slurm_resilience.uploader.buddy_proto import (
    MAX_OFFER_BYTES,
    DataPiece,
    EndPiece,
    OfferPiece,
    Piece,
    ProtoError,
    PullPiece,
    decode,
    encode,
    parse_offer,
)
from slurm_resilience.uploader.buddy_rate import RateLimiter
from slurm_resilience.uploader.buddy_ring import buddy_of
from slurm_resilience.uploader.buddy_send import Opener, Sent, lower_priority, push
from slurm_resilience.uploader.buddy_store import BuddyStore, HeldCopy, JobFacts, Offer, Refused
from slurm_resilience.uploader.journal import pending_steps
from slurm_resilience.uploader.rootfs import committed_steps_at, read_step
from slurm_resilience.uploader.space import disk_space

log = get_logger("checkpoint.buddy")
RESULTS = ("sent", "received", "used", "refused", "failed", "uploaded")
MAX_PUSHES = 4  # pull answers pushed at once
STALE_TRANSFER_S = 600.0  # a transfer with no message for this long is dropped
GONE_AFTER_S = 30.0  # a job not running here for this long: its buddy area is removed


class Waiter(Protocol):
    """A restoring node's wait for the answers to its pulls (buddy_peers.PullWait)."""

    def wants(self, job_id: int, source: str, meta: bool) -> bool: ...

    def __call__(self, job_id: int, sender: str, meta: bool, copy: HeldCopy | None) -> None: ...


@dataclass(frozen=True)
class LocalJob:
    """A job running here, as this agent knows it (never as a peer says)."""

    job_id: int
    uid: int
    nodes: tuple[str, ...]


@dataclass
class JobBuddy:
    """What this node did for one job: the newest step sent and where, and the last error."""

    sent_step: int = -1
    sent_to: str = ""
    sending: threading.Thread | None = None
    last_error: str = ""
    sent: Sent | None = None


@dataclass
class _Pending:
    """An offer arriving in pieces, and the transfer a sender's pieces go to."""

    pieces: dict[int, str] = field(default_factory=dict)
    count: int = 0
    step: int = -1
    source: str = ""  # the source of the transfer under way ("" none)
    touched: float = 0.0


class BuddyService:
    """The agent's ``buddy`` service (see the module doc)."""

    name = "buddy"

    def __init__(self, cfg: Config, node: str, events_path: str, watcher: Any,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.node = node
        self.events_path = events_path
        self.watcher = watcher  # hang.watcher.HangWatcher: job records, exchange, live config
        self.clock = clock
        self.interval_s = 1.0
        self.store = BuddyStore(node_path(cfg.checkpoint.staging_root, node), node)
        self.lock = threading.Lock()
        self.jobs: dict[int, JobBuddy] = {}
        self.pending: dict[tuple[int, str, bool], _Pending] = {}
        self.waiters: list[Waiter] = []
        self.pushes = threading.BoundedSemaphore(MAX_PUSHES)
        self.transport: Any = None
        self.stopping = threading.Event()
        self.refusals = LogBudget(log, "refused buddy pieces")
        self.restores: dict[int, str] = {}  # job → where the parts of its restore came from
        self.absent: dict[int, float] = {}  # job with a buddy area here → first seen gone
        self.uploader: Any = None  # service.Uploader: a job's area stays while it uploads
        self.kept: set[int] = set()  # jobs whose area is kept for the uploader (logged once)
        self.handoffs = HandOffs(node, self.store, self._job_nodes, lambda: self.clock())

    # -- configuration and jobs ----------------------------------------------------------------

    @property
    def live_cfg(self) -> Config:
        return self.watcher.cfg if self.watcher is not None else self.cfg

    def enabled(self) -> bool:
        return bool(self.live_cfg.checkpoint.buddy_copies)

    def local_jobs(self) -> dict[int, LocalJob]:
        if self.watcher is None:
            return {}
        out = {}
        for job_id, view in self.watcher.snapshot().jobs.items():
            rec = view.record
            out[int(job_id)] = LocalJob(int(job_id), int(rec.uid), tuple(rec.nodes))
        return out

    def _job_nodes(self) -> dict[int, tuple[str, ...]]:
        return {j: job.nodes for j, job in self.local_jobs().items()}

    def facts(self, job_id: int) -> JobFacts | None:
        job = self.local_jobs().get(job_id)
        return JobFacts(job.job_id, job.nodes) if job is not None else None

    def count(self, result: str, nbytes: int = 0, direction: str = "") -> None:
        events.count(self.events_path, events.BUDDY, result)
        if nbytes and direction:
            events.count(self.events_path, events.BUDDY_BYTES, direction, nbytes)

    # -- the tick ------------------------------------------------------------------------------

    def tick(self) -> None:
        self._attach()
        jobs = self.local_jobs()
        now = self.clock()
        for job_id in self.store.jobs():
            if job_id in jobs:
                self.absent.pop(job_id, None)
                continue
            # Gone for a while, not just unseen by a watcher that is still starting up.
            since = self.absent.setdefault(job_id, now)
            if now - since < GONE_AFTER_S:
                continue
            waiting = self._uploading(job_id)
            if waiting:
                if job_id not in self.kept:
                    self.kept.add(job_id)
                    log.info("buddy: the job ended; its buddy area here is kept while its "
                             "steps upload (a copy held here may complete them)",
                             job_id=job_id, steps=waiting)
                continue
            self.store.remove_job(job_id)
            self.absent.pop(job_id, None)
            self.kept.discard(job_id)
            self.handoffs.forget(job_id)
            log.info("buddy: the job ended; its buddy area here is removed", job_id=job_id)
        with self.lock:
            for gone in [j for j in self.jobs if j not in jobs]:
                del self.jobs[gone]
            for gone in [j for j in self.restores if j not in jobs]:
                del self.restores[gone]
            for key in [k for k, p in self.pending.items()
                        if now - p.touched > STALE_TRANSFER_S]:
                p = self.pending.pop(key)
                if p.source:
                    self.store.abort(key[0], p.source, key[2])
                log.warning("buddy: a transfer stopped arriving; dropped", job_id=key[0],
                            sender=key[1], step=p.step)
        if not self.enabled() or self.transport is None:
            return
        for job in jobs.values():
            self._maybe_send(job)

    def _uploading(self, job_id: int) -> list[int]:
        """The job's steps the uploader here has yet to finish ([] when it has none or no
        record of the job)."""
        rec = self.uploader.current(job_id) if self.uploader is not None else None
        return pending_steps(rec) if rec is not None else []

    def _attach(self) -> None:
        exchange = getattr(self.watcher, "exchange", None)
        transport = exchange() if exchange is not None else None
        if transport is not self.transport:
            self.transport = transport
            if transport is not None:
                transport.on(Kind.BUDDY, self.on_message)
            elif self.enabled():
                log.warning("buddy: no exchange between agents (heartbeat.rendezvous none): "
                            "no buddy copies are sent or received")

    def _maybe_send(self, job: LocalJob) -> None:
        to = buddy_of(self.node, job.nodes)
        if to is None:
            return
        root = node_path(self.live_cfg.checkpoint.staging_root, self.node)
        try:
            with open_job_dir(root, job.job_id) as jfd:
                steps = committed_steps_at(jfd)
        except (CheckpointError, OSError):
            return  # no staging dir (yet, or any more) for this job here
        if not steps:
            return
        with self.lock:
            state = self.jobs.setdefault(job.job_id, JobBuddy())
            if steps[-1] <= state.sent_step or (state.sending and state.sending.is_alive()):
                return
            thread = threading.Thread(target=self._send_copy, args=(job, steps[-1], to, root),
                                      name=f"buddy-send-{job.job_id}", daemon=True)
            state.sending = thread
        thread.start()

    def _send_copy(self, job: LocalJob, step: int, to: str, root: str) -> None:
        lower_priority()
        result = self.push_own(job, step, to, root, meta=False)
        with self.lock:
            state = self.jobs.setdefault(job.job_id, JobBuddy())
            state.sent = result
            if result.ok:
                state.sent_step, state.sent_to, state.last_error = step, to, ""
            else:
                state.sent_step, state.last_error = step, result.error  # next commit tries again
        if result.ok:
            self.count("sent", result.data_bytes, "sent")
            log.info("buddy: sent this node's part of the newest step to its buddy",
                     job_id=job.job_id, step=step, buddy=to, bytes=result.data_bytes,
                     messages=result.messages, seconds=result.seconds,
                     rate_wait_s=round(result.waited_s, 3))
        else:
            self.count("failed")
            log.warning("buddy: couldn't send this node's part to its buddy", job_id=job.job_id,
                        step=step, buddy=to, error=result.error)

    # -- pushing (a copy, or a pull's answer) ----------------------------------------------------

    def _rate(self) -> RateLimiter:
        return RateLimiter(int(self.live_cfg.checkpoint.buddy_rate))

    def _max_piece(self) -> int:
        return int(self.live_cfg.heartbeat.exchange.max_piece_bytes)

    def push_own(self, job: LocalJob, step: int, to: str, root: str, *, meta: bool) -> Sent:
        """This node's own part of ``step`` (from the job's staging dir) to ``to``."""
        try:
            with open_job_dir(root, job.job_id) as jfd:
                marker, manifests = read_step(jfd, step, job.uid)
                # Only the ranks whose files are here: a restore may have written other
                # ranks' manifests (their data elsewhere) into this node's step dir.
                manifests = {r: m for r, m in manifests.items()
                             if peers.has_files(jfd, step, r, m)}
                if not manifests:
                    return Sent(False, 0, 0, 0.0, f"no rank of step {step} is whole here")
                offer = Offer(job.job_id, self.node, step, marker, manifests, 0, meta)
                offer = dataclasses.replace(offer, total_bytes=sum(s for _, s in offer.files()))
                sfd = open_dir_at(jfd, step_name(step))
                try:
                    def opener(rel: str) -> int:
                        return open_owned_file(sfd, rel, job.uid)
                    return self._push(job, to, offer, opener)
                finally:
                    os.close(sfd)
        except (CheckpointError, OSError) as exc:
            return Sent(False, 0, 0, 0.0, f"couldn't read step {step} here: {exc}")

    def push_held(self, job: LocalJob, copy: HeldCopy, to: str, *, meta: bool) -> Sent:
        """A buddy copy held here (of ``copy.source``) to ``to``."""
        offer = Offer(job.job_id, copy.source, copy.step, copy.marker, copy.manifests, 0, meta)
        offer = dataclasses.replace(offer, total_bytes=sum(s for _, s in offer.files()))

        def opener(rel: str) -> int:
            return self.store.open_file(job.job_id, copy.source, copy.step, rel)
        return self._push(job, to, offer, opener)

    def _push(self, job: LocalJob, to: str, offer: Offer, opener: Opener) -> Sent:
        if self.transport is None:
            return Sent(False, 0, 0, 0.0, "no exchange between agents")
        return push(self.transport, node=self.node, to=to, job_id=job.job_id, nodes=job.nodes,
                    offer=offer, opener=opener, rate=self._rate(),
                    max_piece_bytes=self._max_piece(), stop=self.stopping)

    def refusing(self, nodes: Sequence[str]) -> dict[str, str]:
        """Nodes whose agent takes no TCP connection now (nothing listens, or nothing
        answers in a second) → what a connect said: a pull asks them nothing, instead of
        retrying them for ``heartbeat.exchange.send_timeout_s``."""
        book = getattr(self.transport, "addresses", None)
        if book is None or not nodes:
            return {}
        found = book.lookup(list(nodes))
        names = [n for n in nodes if n in found]
        errors = connect_errors([found[n] for n in names])
        return {n: e for n, e in zip(names, errors, strict=True) if e}

    def send_piece(self, job: LocalJob, to: str, piece: Piece) -> bool:
        """One piece (a pull, or an empty answer) to ``to``; True when it was taken."""
        if self.transport is None:
            return False
        msg = Message(Kind.BUDDY, job.job_id, 0, self.node, to, self.node, job.nodes,
                      {self.node: encode(piece)})
        return bool(self.transport.send(msg, [to]) == to)

    # -- receiving -----------------------------------------------------------------------------

    def on_message(self, msg: Message) -> str:
        """An authenticated ``buddy`` message; "" accepts, anything else refuses."""
        raw = msg.pieces.get(msg.sender)
        if raw is None or len(msg.pieces) != 1:
            return self._refuse(msg, "a buddy message carries one piece, the sender's own")
        try:
            piece = decode(raw)
        except ProtoError as exc:
            return self._refuse(msg, f"malformed: {exc}")
        job = self.local_jobs().get(msg.job_id)
        if job is None or msg.sender not in job.nodes or self.node not in job.nodes:
            return self._refuse(msg, f"{msg.sender} is not a node of job {msg.job_id} "
                                     f"running on {self.node}")
        try:
            if isinstance(piece, PullPiece):
                return self._on_pull(job, msg.sender, piece)
            if isinstance(piece, OfferPiece):
                self._on_offer(job, msg.sender, piece)
            elif isinstance(piece, DataPiece):
                src = self._route(job.job_id, msg.sender, piece.meta, piece.step)
                self.store.chunk(job.job_id, src, piece.step, piece.path, piece.offset,
                                 piece.data, piece.meta)
            elif isinstance(piece, EndPiece):
                self._on_end(job, msg.sender, piece)
        except (Refused, ProtoError) as exc:
            return self._refuse(msg, str(exc))
        return ""

    def _refuse(self, msg: Message, why: str) -> str:
        self.count("refused")
        self.refusals.log(f"{msg.job_id}/{msg.sender}", "buddy: refused a piece",
                          job_id=msg.job_id, sender=msg.sender, reason=user_text(why))
        return why[:150]

    def _route(self, job_id: int, sender: str, meta: bool, step: int) -> str:
        with self.lock:
            p = self.pending.get((job_id, sender, meta))
            if p is None or not p.source or p.step != step:
                raise Refused(f"no transfer of step {step} from {sender} is under way")
            p.touched = self.clock()
            return p.source

    def _on_offer(self, job: LocalJob, sender: str, piece: OfferPiece) -> None:
        key = (job.job_id, sender, piece.meta)
        with self.lock:
            p = self.pending.get(key)
            if p is not None and p.source:
                # A sender pushes one transfer at a time: a new offer means it gave the
                # last one up (it could not read a file, or its agent restarted).
                self.store.abort(job.job_id, p.source, piece.meta)
            if p is None or p.step != piece.step or p.count != piece.count or p.source:
                p = self.pending[key] = _Pending(count=piece.count, step=piece.step)
            p.pieces[piece.index] = piece.text
            p.touched = self.clock()
            if sum(map(len, p.pieces.values())) > MAX_OFFER_BYTES:
                del self.pending[key]
                raise Refused(f"offer of step {piece.step} from {sender} is over "
                              f"{MAX_OFFER_BYTES:,} bytes")
            if len(p.pieces) < p.count:
                return
            text = "".join(p.pieces[i] for i in range(p.count))
            p.pieces.clear()
        offer, send = parse_offer(text, job.job_id, piece.meta)
        if offer.step != piece.step or tuple(path for path, _ in offer.files()) != send:
            raise Refused(f"offer of step {offer.step} from {sender} names other files than "
                          "its manifests")
        asked = self.asked(job.job_id, offer.source, piece.meta)
        if offer.source != sender and not asked:
            raise Refused(f"{sender} offered {offer.source}'s part, which {self.node} did not "
                          "ask for")
        ck = self.live_cfg.checkpoint
        disk = disk_space(self.store.staging_root, 0)
        quota = job_quota(disk.total, ck.buddy_quota_fraction)
        self.store.begin(JobFacts(job.job_id, job.nodes), offer, quota,
                         self.store.used(job.job_id), asked=asked)
        with self.lock:
            p.source = offer.source

    def _on_end(self, job: LocalJob, sender: str, piece: EndPiece) -> None:
        key = (job.job_id, sender, piece.meta)
        with self.lock:
            p = self.pending.pop(key, None)
        if p is None or not p.source:
            # A pulled node with nothing to send says so with an end alone.
            self._tell(job.job_id, sender, piece.meta, None)
            return
        copy = self.store.finish(job.job_id, p.source, piece.step, piece.meta)
        self.count("received", copy.total_bytes, "received")
        log.info("buddy: received a verified copy", job_id=job.job_id, source=p.source,
                 sender=sender, step=copy.step, ranks=sorted(copy.ranks),
                 bytes=copy.total_bytes, metadata_only=piece.meta)
        self._tell(job.job_id, sender, piece.meta, copy)

    # -- pulls ---------------------------------------------------------------------------------

    def asked(self, job_id: int, source: str, meta: bool) -> bool:
        with self.lock:
            return any(w.wants(job_id, source, meta) for w in self.waiters)

    def _tell(self, job_id: int, sender: str, meta: bool, copy: HeldCopy | None) -> None:
        with self.lock:
            waiters = list(self.waiters)
        for w in waiters:
            w(job_id, sender, meta, copy)

    def _on_pull(self, job: LocalJob, sender: str, piece: PullPiece) -> str:
        if not self.pushes.acquire(blocking=False):
            return "busy: answering other pulls"
        threading.Thread(target=self._answer_pull, args=(job, sender, piece),
                         name=f"buddy-pull-{job.job_id}", daemon=True).start()
        return ""

    def _answer_pull(self, job: LocalJob, to: str, piece: PullPiece) -> None:
        try:
            lower_priority()
            sent_any = False  # for the log only
            root = node_path(self.live_cfg.checkpoint.staging_root, self.node)
            if piece.own:
                try:
                    with open_job_dir(root, job.job_id) as jfd:
                        steps = committed_steps_at(jfd)
                except (CheckpointError, OSError):
                    steps = []
                step = steps[-1] if piece.step < 0 and steps else piece.step
                if step in steps:
                    res = self.push_own(job, step, to, root, meta=piece.meta)
                    self._pushed(job, to, step, self.node, res, piece.meta)
                    sent_any = sent_any or res.ok
            held = self.store.held(job.job_id)
            for lost in piece.copies_of:
                copy = held.get(lost)
                if copy is not None and (piece.step < 0 or copy.step == piece.step):
                    res = self.push_held(job, copy, to, meta=piece.meta)
                    self._pushed(job, to, copy.step, lost, res, piece.meta)
                    if res.ok and not piece.meta:
                        self.count("used")
                    sent_any = sent_any or res.ok
            # The answer ends with an end piece of no transfer: "that is all I have".
            if not self.send_piece(job, to, EndPiece(0, piece.meta)) and sent_any:
                log.warning("buddy: couldn't tell a restoring node a pull's answer is done",
                            job_id=job.job_id, to=to)
        finally:
            self.pushes.release()

    def _pushed(self, job: LocalJob, to: str, step: int, source: str, res: Sent,
                meta: bool) -> None:
        if res.ok:
            self.count("sent", res.data_bytes, "sent")
            log.info("buddy: answered a restore's pull", job_id=job.job_id, to=to, step=step,
                     source=source, bytes=res.data_bytes, metadata_only=meta)
        else:
            self.count("failed")
            log.warning("buddy: couldn't answer a restore's pull", job_id=job.job_id, to=to,
                        step=step, source=source, error=res.error)

    # -- restores (buddy_peers.py) --------------------------------------------------------------

    def stage(self, job_id: int, jfd: int, gid: int, s3_steps: set[int],
              s3_error: str, *, force: bool = False) -> Staged | None:
        """Stage-in through the job's nodes; None when they can't do better than S3.
        ``force``: ask them even if nothing of the run is here (ckpt.stage of a step the
        job's ranks agreed on)."""
        job = self.local_jobs().get(job_id)
        if job is None or not self.enabled() or self.transport is None:
            return None
        if not force and job_id not in self.store.jobs() and not committed_steps_at(jfd):
            # Nothing of this job's run was committed or copied here: a job just started
            # (no node holds anything yet), so no node is asked; S3's answer stands.
            return None
        staged = peers.stage(self, job, jfd, gid, s3_steps, s3_error)
        if staged is not None:
            with self.lock:
                self.restores[job_id] = staged.choice.summary()
        return staged

    def newer_held(self, job_id: int, step: int | None) -> bool:
        """A buddy copy here is of a step newer than ``step`` (what S3 gave stage-in)."""
        try:
            return any(c.step > (-1 if step is None else step)
                       for c in self.store.held(job_id).values())
        except Refused:
            return False

    def complete(self, job_id: int, jfd: int, gid: int, step: int) -> bool:
        """Bring the parts of ``step`` this node lacks from the job's nodes (ckpt.fetch of a
        step S3 can't give); whether every part is here now. A part that can't be had
        stays missing, and the fetch says so."""
        job = self.local_jobs().get(job_id)
        if job is None or not self.enabled() or self.transport is None:
            return False
        try:
            got = peers.complete(self, job, jfd, gid, step)
            whole = not peers.missing_ranks(jfd, step, job.uid)
        except (CheckpointError, OSError, Refused) as exc:
            log.error("buddy: couldn't bring the parts a restore lacks", job_id=job_id,
                      step=step, error=str(exc))
            return False
        if got:
            with self.lock:
                self.restores[job_id] = f"step {step}: " + "; ".join(got)
        return whole

    # -- the agent's service protocol ----------------------------------------------------------

    def status(self, job_id: int) -> dict[str, Any]:
        """For ``ckpt.status``: the copy this node sent and the copies it holds."""
        with self.lock:
            state = self.jobs.get(job_id)
        out: dict[str, Any] = {}
        with self.lock:
            restored = self.restores.get(job_id)
        if restored:
            out["parts"] = restored
        if state is not None and state.sent_step >= 0:
            out["sent"] = {"step": state.sent_step, "to": state.sent_to,
                           "error": state.last_error or None}
        try:
            out["held"] = {src: c.step for src, c in self.store.held(job_id).items()}
        except Refused as exc:
            out["held_error"] = str(exc)
        return out

    def handlers(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.stopping.set()


def factory(ctx: Any) -> BuddyService | None:
    """The agent's service factory: None when checkpoint staging is off (or its service
    could not start)."""
    if not ctx.cfg.checkpoint.enabled:
        return None
    services = ctx.extra.get("services", {})
    uploader = services.get("checkpoint")
    if uploader is None:
        # The checkpoint service did not start (its own error says why): no staging to
        # copy from, no restore to serve.
        log.error("buddy: not started: the agent's checkpoint service is not running")
        return None
    svc = BuddyService(ctx.cfg, ctx.node, ctx.adapter.events_path, services.get("heartbeat"))
    uploader.buddy = svc  # its stage-in and fetch ask for parts through it; its commit
    svc.uploader = uploader  # hands off the parts held here
    uploader.fetcher.peers = svc.complete
    return svc
