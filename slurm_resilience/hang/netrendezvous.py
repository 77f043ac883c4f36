"""``NetworkRendezvous``: the hang watcher's rendezvous over the network, without a shared
filesystem.

Each node sends its piece (a per-node summary, at most ``max_piece_bytes``) to its parent in
the run's fan-in tree (:mod:`.tree`); an inner node stores what it receives and forwards
it, batched, to its own parent; the batch host, at the root, collects every piece. Each
agent therefore receives from at most ``fanout`` peers per incident. A parent that can't be
reached is skipped for the next ancestor, up to the root.

Every message is a munge credential (:mod:`.credentials`) and is accepted only when munged
vouches for it, its uid is the agents' (0 or ``agent_uid``), and its payload is bound to this
receiver, a node of the run, a nonce not seen before and a time near this node's clock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config.heartbeat import ExchangeSection
from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.transport.credentials import (
    CredentialError,
    Credentials,
    MungeCredentials,
)
from slurm_resilience.transport.listener import Listener
from slurm_resilience.transport.tree import Tree
from slurm_resilience.transport.wire import (
    Kind,
    Message,
    MessageError,
    connect,
    parse_message,
    send_frame,
)

log = get_logger("heartbeat.exchange")

# Bounds on what authenticated peers can make this agent keep.
MAX_RUNS = 4096
MAX_NONCES = 1 << 18
MAX_ANNOUNCED = 4096
# How long a message's payload time may differ from munge's own encode time (whole seconds).
PAYLOAD_TIME_SLACK_S = 2.0

Resolver = Callable[[Sequence[str]], dict[str, str]]
# A service's handler of its own message kind: "" accepts, anything else is the refusal.
KindHandler = Callable[[Message], str]
HANG_KINDS = frozenset({Kind.PIECES, Kind.COLLECT})


@dataclass
class _Run:
    """What this node holds of one job run."""

    batch_host: str
    nodes: tuple[str, ...]
    tree: Tree
    pieces: dict[str, bytes] = field(default_factory=dict)
    forwarded: set[str] = field(default_factory=set)
    forwarding: bool = False
    collected: bool = False
    touched: float = 0.0


class AddressBook:
    """Node name → (host, port) of its agent: config first, then Slurm (cached)."""

    def __init__(self, cfg: ExchangeSection, resolver: Resolver | None, *,
                 ttl_s: float = 3600.0):
        self.cfg = cfg
        self.resolver = resolver
        self.ttl_s = ttl_s
        self.cache: dict[str, tuple[str, float]] = {}
        self.lock = threading.Lock()

    def lookup(self, nodes: Sequence[str]) -> dict[str, tuple[str, int]]:
        now = time.monotonic()
        hosts = {n: self.cfg.addresses[n] for n in nodes if n in self.cfg.addresses}
        with self.lock:
            for n in nodes:
                hit = self.cache.get(n)
                if n not in hosts and hit and hit[1] > now:
                    hosts[n] = hit[0]
        missing = [n for n in nodes if n not in hosts]
        if missing and self.resolver is not None:
            try:
                found = self.resolver(missing)
            except (SlurmError, ValueError) as exc:
                log.warning("exchange: address: couldn't look up nodes in Slurm",
                            nodes=missing[:8], error=str(exc))
                found = {}
            with self.lock:
                for n, host in found.items():
                    self.cache[n] = (host, now + self.ttl_s)
            hosts.update(found)
        return {n: (h, self.cfg.port_of(n)) for n, h in hosts.items()}


class NetworkRendezvous:
    """The ``Rendezvous`` of the hang watcher over munge-authenticated TCP (see module doc)."""

    def __init__(self, cfg: ExchangeSection, node: str, *, credentials: Credentials,
                 resolver: Resolver | None = None, listen: bool = True,
                 clock: Clock = SystemClock(), hang: bool = True):
        self.cfg = cfg
        # Hang pieces are accepted only where this is the hang watcher's rendezvous; other
        # services add kinds of their own (:meth:`on`).
        self.hang = hang
        self.handlers: dict[Kind, KindHandler] = {}
        self.node = node
        self.credentials = credentials
        self.addresses = AddressBook(cfg, resolver)
        self.clock = clock  # its wall time: run ages and credential times
        self.lock = threading.Condition()
        self.runs: collections.OrderedDict[tuple[int, int], _Run] = collections.OrderedDict()
        self.nonces: dict[str, float] = {}
        self.announced_q: collections.deque[tuple[int, int, str]] = collections.deque(
            maxlen=MAX_ANNOUNCED)
        self.closing = threading.Event()
        self.sent_bytes = 0
        self.refusals: collections.Counter[str] = collections.Counter()
        self.refusal_log = LogBudget(log, "refused messages")  # anyone can send us frames
        self.senders: collections.Counter[str] = collections.Counter()  # accepted, by sender
        self.listener: Listener | None = None
        if listen:
            self.listener = Listener(
                cfg.bind, cfg.port_of(node), self._receive,
                max_connections=cfg.max_connections,
                max_per_peer=cfg.max_connections_per_peer, io_timeout_s=cfg.io_timeout_s,
                max_frame_bytes=int(cfg.max_message_bytes),
                privileged_only=cfg.privileged_ports).start()
            log.info("exchange: listening", node=node, bind=cfg.bind, port=self.listener.port)

    # -- the Rendezvous protocol -------------------------------------------------------------

    def publish(self, job_id: int, run: int, batch_host: str, nodes: Sequence[str],
                piece: bytes) -> None:
        """Hand this node's piece towards the batch host (in the background; never raises)."""
        if len(piece) > self.cfg.max_piece_bytes:
            log.error("exchange: publish: couldn't publish piece: too large", job_id=job_id,
                      bytes=len(piece), limit=int(self.cfg.max_piece_bytes))
            return
        try:
            st = self._run(job_id, run, batch_host, tuple(nodes))
        except MessageError as exc:
            log.error("exchange: publish: couldn't publish piece", job_id=job_id,
                      error=str(exc))
            return
        self._store(job_id, run, st, {self.node: piece})

    def gather(self, job_id: int, run: int, nodes: Sequence[str], deadline: float,
               wait_for: Sequence[str] | None = None) -> dict[str, bytes]:
        """On the batch host: the other nodes' pieces, waiting until ``deadline`` for those
        of ``wait_for`` (default all of ``nodes``; a launcher's spares run no ranks and send
        none). Pieces of the others that came in time are returned too."""
        wanted = set(nodes if wait_for is None else wait_for) - {self.node}
        try:
            st = self._run(job_id, run, self.node, tuple(nodes))
        except MessageError as exc:
            log.error("exchange: gather: couldn't gather", job_id=job_id, error=str(exc))
            return {}
        collect_at = time.monotonic() + self.cfg.collect_after_s
        with self.lock:
            while not wanted <= st.pieces.keys():
                now = time.monotonic()
                if now >= deadline:
                    break
                if not st.collected and now >= collect_at:
                    st.collected = True
                    self._spawn(self._send_collect, job_id, run, st)
                wait = deadline - now if st.collected else min(deadline, collect_at) - now
                self.lock.wait(max(0.001, wait))
            got = {n: p for n, p in st.pieces.items() if n != self.node}
        if not wanted <= got.keys():
            log.warning("exchange: gather: pieces missing at the deadline", job_id=job_id,
                        run=run, missing=len(wanted - got.keys()), got=len(got))
        return got

    def announced(self) -> list[tuple[int, int, str]]:
        """Runs to join: pieces that reached this batch host, and collect requests for jobs
        this node may run; ``(job_id, run, node that sent it)``."""
        with self.lock:
            out = list(self.announced_q)
            self.announced_q.clear()
        return out

    def cleanup(self, older_than: float) -> int:
        """Forget runs last touched before ``older_than`` (wall time), and old nonces."""
        with self.lock:
            old = [k for k, st in self.runs.items() if st.touched < older_than]
            for k in old:
                del self.runs[k]
            now = self.clock.time()
            for nonce in [n for n, exp in self.nonces.items() if exp < now]:
                del self.nonces[nonce]
        return len(old)

    def on(self, kind: Kind, handler: KindHandler) -> None:
        """Accept messages of ``kind`` (authenticated and bound like every message) and hand
        them to ``handler``, on the connection's thread: it must be quick."""
        if kind in HANG_KINDS:
            raise ValueError(f"{kind.value} messages belong to the hang exchange")
        with self.lock:
            self.handlers[kind] = handler

    def send(self, msg: Message, targets: Sequence[str]) -> str:
        """Deliver ``msg`` (its pieces split over messages below the size limit) to the first
        of ``targets`` that accepts it, each batch within ``send_timeout_s``; blocks, so call
        it from a thread of your own. Returns the node that took the last batch, or ""."""
        deadline = time.monotonic() + self.cfg.send_timeout_s
        took = ""
        for batch in self._batches(msg.pieces) if msg.pieces else [{}]:
            took = ""
            for i, target in enumerate(targets):
                share = (deadline - time.monotonic()) / (len(targets) - i)
                one = Message(msg.kind, msg.job_id, msg.run, self.node, target, msg.batch_host,
                              msg.nodes, batch)
                if self._send(target, one, time.monotonic() + max(share, 0.05)):
                    took = target
                    break
            if not took:
                return ""
        return took

    def close(self) -> None:
        self.closing.set()
        if self.listener is not None:
            self.listener.close()

    # -- state ---------------------------------------------------------------------------------

    def _run(self, job_id: int, run: int, batch_host: str, nodes: tuple[str, ...]) -> _Run:
        key = (job_id, run)
        with self.lock:
            st = self.runs.get(key)
            if st is None:
                if batch_host not in nodes or self.node not in nodes:
                    raise MessageError(f"job {job_id} run {run}: {self.node} or batch host "
                                       f"{batch_host} not among its nodes")
                st = _Run(batch_host, nodes, Tree.of(batch_host, nodes, self.cfg.fanout))
                self.runs[key] = st
                while len(self.runs) > MAX_RUNS:
                    self.runs.popitem(last=False)
            elif st.batch_host != batch_host or set(st.nodes) != set(nodes):
                raise MessageError(f"job {job_id} run {run}: batch host or nodes differ from "
                                   "what this node already holds")
            st.touched = self.clock.time()
            return st

    def _store(self, job_id: int, run: int, st: _Run, pieces: dict[str, bytes],
               sender: str = "") -> int:
        """Keep new pieces (the first of each node wins); forward them or wake gather."""
        with self.lock:
            new = [n for n in pieces if n not in st.pieces and n in st.tree]
            for n in new:
                st.pieces[n] = pieces[n]
            if st.batch_host == self.node:
                for n in new:
                    if n != self.node:
                        self.announced_q.append((job_id, run, n))
                self.lock.notify_all()
                return len(new)
            start = bool(new) and not st.forwarding
            if start:
                st.forwarding = True
        if start:
            self._spawn(self._forward, job_id, run, st)
        return len(new)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        threading.Thread(target=target, args=args, daemon=True,
                         name=f"exchange-send-{args[0]}").start()

    # -- sending ---------------------------------------------------------------------------------

    def _forward(self, job_id: int, run: int, st: _Run) -> None:
        """Send pieces not yet forwarded to the nearest reachable ancestor, in batches."""
        deadline = time.monotonic() + self.cfg.send_timeout_s
        ancestors: list[str] = []
        up = st.tree.parent(self.node)
        while up is not None:
            ancestors.append(up)
            up = st.tree.parent(up)
        while not self.closing.is_set():
            if self.cfg.forward_linger_s:
                self.closing.wait(self.cfg.forward_linger_s)
            with self.lock:
                todo = {n: p for n, p in st.pieces.items() if n not in st.forwarded}
                if not todo:
                    st.forwarding = False
                    return
            for batch in self._batches(todo):
                if not self._deliver(job_id, run, st, ancestors, batch, deadline):
                    log.error("exchange: forward: couldn't deliver pieces to any ancestor",
                              job_id=job_id, run=run, nodes=sorted(batch)[:8],
                              ancestors=ancestors[:4])
                with self.lock:
                    st.forwarded.update(batch)

    def _batches(self, pieces: dict[str, bytes]) -> list[dict[str, bytes]]:
        """Split pieces so each message stays below the limit (base64 and JSON included)."""
        budget = int(self.cfg.max_message_bytes) * 2 // 3
        out: list[dict[str, bytes]] = [{}]
        size = 0
        for n, p in sorted(pieces.items()):
            cost = len(p) * 2 + len(n) + 8  # JSON escaping of a JSON piece at most doubles it
            if out[-1] and size + cost > budget:
                out.append({})
                size = 0
            out[-1][n] = p
            size += cost
        return out

    def _deliver(self, job_id: int, run: int, st: _Run, ancestors: list[str],
                 pieces: dict[str, bytes], deadline: float) -> bool:
        """Try the parent, then each further ancestor, sharing the send deadline."""
        for i, target in enumerate(ancestors):
            share = (deadline - time.monotonic()) / (len(ancestors) - i)
            msg = Message(Kind.PIECES, job_id, run, self.node, target, st.batch_host, st.nodes,
                          pieces)
            if self._send(target, msg, time.monotonic() + max(share, 0.05)):
                return True
        return False

    def _send_collect(self, job_id: int, run: int, st: _Run) -> None:
        """Ask this node's children to send their pieces (they pass the request down)."""
        for child in st.tree.children(self.node):
            msg = Message(Kind.COLLECT, job_id, run, self.node, child, st.batch_host, st.nodes)
            self._spawn(self._send_one, child, msg)

    def _send_one(self, target: str, msg: Message) -> None:
        self._send(target, msg, time.monotonic() + self.cfg.io_timeout_s)

    def _send(self, target: str, msg: Message, deadline: float) -> bool:
        """Deliver one message, retrying with backoff until ``deadline``; True when accepted."""
        addr = self.addresses.lookup([target]).get(target)
        if addr is None:
            log.warning("exchange: send: couldn't find the address of a node", node=target)
            return False
        pause = 0.05
        while not self.closing.is_set():
            attempt = Message(msg.kind, msg.job_id, msg.run, msg.sender, msg.receiver,
                              msg.batch_host, msg.nodes, msg.pieces)  # fresh nonce and time
            try:
                cred = self.credentials.encode(attempt.to_payload())
                answer = self._exchange(addr, cred, deadline)
                if answer == "ok":
                    return True
                log.warning("exchange: send: peer refused a message", node=target,
                            answer=answer[:120])
                if not answer.startswith("busy"):
                    return False
            except (OSError, CredentialError) as exc:
                if time.monotonic() + pause >= deadline:
                    log.warning("exchange: send: couldn't deliver a message", node=target,
                                error=str(exc))
                    return False
            if time.monotonic() + pause >= deadline:
                return False
            self.closing.wait(pause)
            pause = min(pause * 2, 1.0)
        return False

    def _exchange(self, addr: tuple[str, int], cred: bytes, deadline: float) -> str:
        with connect(addr, deadline, privileged=self.cfg.privileged_ports) as sock:
            send_frame(sock, cred, deadline)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            reply = sock.makefile("rb").readline(256)
        with self.lock:
            self.sent_bytes += len(cred) + 4
        if not reply:
            raise ConnectionError("no answer (closed: busy, or not an agent)")
        return reply.decode("ascii", "replace").strip()

    # -- receiving -------------------------------------------------------------------------------

    def _refuse(self, why: str, peer: str) -> str:
        with self.lock:
            self.refusals[why.split(":")[0]] += 1
        self.refusal_log.log(f"peer {peer}", "exchange: receive: refused a message", peer=peer,
                             reason=user_text(why))
        return f"refused: {why}"

    def _receive(self, frame: bytes, peer: str) -> str:
        try:
            decoded = self.credentials.decode(frame)
        except CredentialError as exc:
            return self._refuse(str(exc), peer)
        if decoded.uid not in (0, self.cfg.agent_uid):
            return self._refuse(f"credential of uid {decoded.uid}, not an agent's", peer)
        try:
            msg = parse_message(decoded.payload, max_piece_bytes=int(self.cfg.max_piece_bytes))
        except MessageError as exc:
            return self._refuse(f"malformed: {exc}", peer)
        why = self._check_binding(msg, decoded.encode_time)
        if why:
            return self._refuse(why, peer)
        if msg.kind not in HANG_KINDS:
            with self.lock:
                handler = self.handlers.get(msg.kind)
            if handler is None:
                return self._refuse(f"no service here takes {msg.kind.value} messages", peer)
            why = handler(msg)
            if why:
                return self._refuse(why, peer)
            with self.lock:
                self.senders[msg.sender] += 1
            return "ok"
        if not self.hang:
            return self._refuse("hang pieces go through the shared directory here", peer)
        try:
            st = self._run(msg.job_id, msg.run, msg.batch_host, msg.nodes)
        except MessageError as exc:
            return self._refuse(f"inconsistent: {exc}", peer)
        if msg.kind is Kind.COLLECT:
            with self.lock:
                self.announced_q.append((msg.job_id, msg.run, msg.batch_host))
            self._spawn(self._send_collect, msg.job_id, msg.run, st)
            return "ok"
        below = st.tree.subtree(msg.sender)
        if not msg.pieces.keys() <= below:
            return self._refuse(f"{msg.sender} sent pieces of nodes outside its subtree", peer)
        new = self._store(msg.job_id, msg.run, st, msg.pieces, msg.sender)
        with self.lock:
            self.senders[msg.sender] += 1
        log.info("exchange: received pieces", job_id=msg.job_id, run=msg.run,
                 sender=msg.sender, pieces=len(msg.pieces), new=new)
        return "ok"

    def _check_binding(self, msg: Message, encode_time: int) -> str:
        """The reasons a well-formed, authenticated message is not for this node now."""
        now = self.clock.time()
        if msg.receiver != self.node:
            return f"addressed to {msg.receiver}, this is {self.node}"
        if msg.sender not in msg.nodes or msg.batch_host not in msg.nodes:
            return f"sender {msg.sender} or batch host not among the run's nodes"
        if self.node not in msg.nodes:
            return f"{self.node} is not a node of job {msg.job_id}"
        if abs(now - encode_time) > self.cfg.max_skew_s:
            return f"credential made {now - encode_time:.0f}s from this node's clock"
        if abs(msg.sent_at - encode_time) > PAYLOAD_TIME_SLACK_S:
            return "payload time differs from the credential's"
        with self.lock:
            if msg.nonce in self.nonces:
                return "replayed nonce"
            if len(self.nonces) >= MAX_NONCES:
                for n in [n for n, exp in self.nonces.items() if exp < now]:
                    del self.nonces[n]
                if len(self.nonces) >= MAX_NONCES:
                    return "busy: too many recent messages"
            self.nonces[msg.nonce] = encode_time + self.cfg.max_skew_s + self.cfg.credential_ttl_s
        return ""


def from_config(cfg: ExchangeSection, node: str, resolver: Resolver | None = None,
                *, listen: bool = True, hang: bool = True) -> NetworkRendezvous:
    """The agent's exchange with Debian's munge CLI (``hang=False``: for other services'
    message kinds only, where hang pieces go through a shared directory)."""
    creds = MungeCredentials(socket=cfg.munge_socket, munge=cfg.munge, unmunge=cfg.unmunge,
                             restrict_uid=cfg.agent_uid, ttl_s=cfg.credential_ttl_s,
                             timeout_s=cfg.io_timeout_s)
    return NetworkRendezvous(cfg, node, credentials=creds, resolver=resolver, listen=listen,
                             hang=hang)
