"""The exchange's messages and their framing on a TCP connection.

On the wire: a 4-byte big-endian length, then a munge credential whose payload is one JSON
object (ASCII). The receiver answers one line (``ok`` or ``refused: <why>``), unauthenticated
and only informative. Nothing is trusted before munge vouched for the credential; then the
payload is checked field by field against what this node expects (:func:`parse_message`).
"""

from __future__ import annotations

import errno
import json
import re
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

VERSION = 1
LENGTH = struct.Struct(">I")
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_NONCE = re.compile(r"^[0-9a-f]{32}$")
MAX_NODES = 65536
# Source ports an agent sends from: below 1024 only root (or CAP_NET_BIND_SERVICE) may
# bind, so a listener can drop a user's connection before reading a byte. 512-1023, as
# rresvport(3) uses, leaves the well-known services below alone.
PRIVILEGED_PORTS = range(512, 1024)
_PORT_TRIES = 64


class Kind(str, Enum):
    """What a message carries."""

    PIECES = "pieces"  # per-node pieces of a run, travelling up the tree
    COLLECT = "collect"  # the batch host asks the run's nodes for their pieces (down the tree)
    # Straggler nodes (slurm_resilience.stragglers.nodeexchange): nodes' step-time summaries
    # travelling up the job's tree to its judge, and the judge telling a node it was named.
    STEPS = "steps"
    NAMED = "named"
    # Buddy copies of checkpoint parts (slurm_resilience.uploader.buddy_proto): a node's
    # newest step to its buddy in chunks, and a restoring node's requests for what it lacks.
    BUDDY = "buddy"


class MessageError(ValueError):
    """A payload that is not a message this node accepts."""


@dataclass(frozen=True)
class Message:
    """One exchange message, bound to its job run, sender, receiver, nonce and time."""

    kind: Kind
    job_id: int
    run: int
    sender: str
    receiver: str
    batch_host: str
    nodes: tuple[str, ...]
    pieces: dict[str, bytes] = field(default_factory=dict)
    nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    sent_at: float = field(default_factory=time.time)

    def to_payload(self) -> bytes:
        body: dict[str, Any] = {
            "v": VERSION, "kind": self.kind.value, "job": self.job_id, "run": self.run,
            "from": self.sender, "to": self.receiver, "batch_host": self.batch_host,
            "nodes": list(self.nodes), "nonce": self.nonce, "time": self.sent_at,
            "pieces": {n: p.decode("utf-8") for n, p in self.pieces.items()},
        }
        return json.dumps(body, separators=(",", ":")).encode("ascii")


def _node(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NODE.match(value):
        raise MessageError(f"{what} is not a node name")
    return value


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise MessageError(f"{what} is not a non-negative integer")
    return value


def parse_message(payload: bytes, *, max_piece_bytes: int) -> Message:
    """A payload munge vouched for, checked for shape and sizes (not yet for binding)."""
    try:
        body = json.loads(payload)
    except ValueError as exc:
        raise MessageError(f"payload is not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise MessageError(f"payload is not a version {VERSION} message")
    try:
        kind = Kind(body.get("kind"))
    except ValueError:
        raise MessageError(f"unknown message kind {body.get('kind')!r}") from None
    nodes = body.get("nodes")
    if not isinstance(nodes, list) or not 0 < len(nodes) <= MAX_NODES:
        raise MessageError("nodes is not a list of node names")
    names = tuple(_node(n, "a node") for n in nodes)
    nonce, sent_at = body.get("nonce"), body.get("time")
    if not isinstance(nonce, str) or not _NONCE.match(nonce):
        raise MessageError("nonce is not 32 hex digits")
    if isinstance(sent_at, bool) or not isinstance(sent_at, (int, float)):
        raise MessageError("time is not a number")
    raw = body.get("pieces")
    if not isinstance(raw, dict):
        raise MessageError("pieces is not an object")
    pieces: dict[str, bytes] = {}
    for node, text in raw.items():
        _node(node, "a piece's node")
        if not isinstance(text, str):
            raise MessageError(f"piece of {node} is not text")
        data = text.encode("utf-8")
        if len(data) > max_piece_bytes:
            raise MessageError(f"piece of {node} is {len(data)} bytes, over {max_piece_bytes}")
        try:
            if not isinstance(json.loads(data), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise MessageError(f"piece of {node} is not a JSON object: {exc}") from None
        pieces[node] = data
    return Message(kind, _count(body.get("job"), "job"), _count(body.get("run"), "run"),
                   _node(body.get("from"), "sender"), _node(body.get("to"), "receiver"),
                   _node(body.get("batch_host"), "batch host"), names, pieces, nonce,
                   float(sent_at))


def recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    """Read ``size`` bytes before the monotonic ``deadline`` (a slow sender is cut off)."""
    chunks: list[bytes] = []
    left = size
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("connection deadline passed")
        sock.settimeout(remaining)
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("peer closed the connection early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, *, max_bytes: int, deadline: float) -> bytes:
    (size,) = LENGTH.unpack(recv_exact(sock, LENGTH.size, deadline))
    if size > max_bytes:
        raise MessageError(f"frame of {size} bytes, over {max_bytes}")
    return recv_exact(sock, size, deadline)


def send_frame(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(LENGTH.pack(len(data)) + data)


def connect(addr: tuple[str, int], deadline: float, *, privileged: bool) -> socket.socket:
    """A TCP connection to ``addr`` made before ``deadline``; ``privileged``: from a source
    port below 1024 (tried from a random start; one taken is skipped)."""
    if not privileged:
        return socket.create_connection(addr, timeout=max(0.01, deadline - time.monotonic()))
    infos = socket.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)
    start = secrets.randbelow(len(PRIVILEGED_PORTS))
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        for i in range(_PORT_TRIES):
            port = PRIVILEGED_PORTS[(start + i) % len(PRIVILEGED_PORTS)]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))  # noqa: S104 - the route picks the address
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
                if exc.errno == errno.EACCES:
                    raise OSError(exc.errno, "couldn't bind a source port below 1024 (only "
                                  "root may): run the agents as root, or set "
                                  "heartbeat.exchange.privileged_ports: false") from exc
                if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    break  # refused, unreachable, timed out: not the port's fault
            if time.monotonic() >= deadline:
                break
    raise last or OSError(errno.EADDRNOTAVAIL, f"couldn't resolve {addr[0]}")
