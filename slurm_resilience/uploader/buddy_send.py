"""The sending side of buddy copies: one transfer of a step part to one node, bounded.

A transfer reads the part's files (a job's staging dir: through directory fds, O_NOFOLLOW,
regular files owned by the job's user with one link; the buddy area: root's own) in
chunks that fit one exchange piece, waits on the rate limiter before each, and sends each
as its own message, the next only once the receiver answered ``ok``. A refusal or a
message that can't be delivered ends the transfer with the cause.

Priority: the thread that sends lowers its own CPU priority (nice 19, per thread on
Linux), so its reads, CRC checks and munge calls yield to the training's own threads. The
bound that holds whatever the scheduler does is the rate (``checkpoint.buddy_rate``):
an I/O priority (``ionice`` idle) would promise nothing on NVMe, whose usual schedulers
(none, mq-deadline) ignore it, and a DSCP mark (SO_PRIORITY, IP_TOS) only where the
site's switches are configured for it.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from slurm_resilience.log import get_logger
from slurm_resilience.transport.wire import Kind, Message
from slurm_resilience.uploader.buddy_proto import (
    DataPiece,
    EndPiece,
    OfferPiece,
    Piece,
    data_room,
    encode,
    offer_text,
)
from slurm_resilience.uploader.buddy_rate import RateLimiter
from slurm_resilience.uploader.buddy_store import Offer

log = get_logger("checkpoint.buddy")

Opener = Callable[[str], int]
"""Opens a file of the part (path relative to the step) and returns its fd."""


class Transport(Protocol):
    """The agents' exchange (hang.netrendezvous.NetworkRendezvous), as used here."""

    def send(self, msg: Message, targets: Any) -> str: ...


@dataclass(frozen=True)
class Sent:
    """What a transfer did: bytes of file data sent, messages, seconds waited on the rate."""

    ok: bool
    data_bytes: int
    messages: int
    waited_s: float
    error: str = ""
    seconds: float = 0.0  # from the offer to the receiver's answer to the end


def lower_priority() -> None:
    """This thread at nice 19 (Linux: per thread); never fails the transfer."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def push(transport: Transport, *, node: str, to: str, job_id: int, nodes: tuple[str, ...],
         offer: Offer, opener: Opener, rate: RateLimiter, max_piece_bytes: int,
         stop: threading.Event | None = None) -> Sent:
    """Send ``offer`` and the bytes of its files to ``to``; ``Sent.ok`` when it verified."""
    files = offer.files()
    room = data_room(max_piece_bytes - max((len(p) for p, _ in files), default=0))
    messages = 0

    def one(piece: Piece) -> str:
        nonlocal messages
        if stop is not None and stop.is_set():
            return "the agent is stopping"
        msg = Message(Kind.BUDDY, job_id, 0, node, to, node, nodes,
                      {node: encode(piece)})
        messages += 1
        return "" if transport.send(msg, [to]) == to else \
            f"{to} refused or couldn't be reached (message {messages}; its log says why)"

    started = time.monotonic()
    text = offer_text(offer, tuple(p for p, _ in files))
    count = max(1, math.ceil(len(text) / room))
    sent = 0
    for i in range(count):
        err = one(OfferPiece(offer.step, offer.meta, i, count, text[i * room:(i + 1) * room]))
        if err:
            return Sent(False, sent, messages, rate.waited_s, err)
    for path, size in files:
        fd = opener(path)
        try:
            if os.fstat(fd).st_size != size:
                return Sent(False, sent, messages, rate.waited_s,
                            f"{path} is {os.fstat(fd).st_size:,} bytes, its manifest says "
                            f"{size:,}")
            offset = 0
            while offset < size:
                data = os.pread(fd, min(room, size - offset), offset)
                if not data:
                    return Sent(False, sent, messages, rate.waited_s,
                                f"{path} ended at {offset:,} of {size:,} bytes")
                rate.wait(len(data))
                err = one(DataPiece(offer.step, offer.meta, path, offset, data))
                if err:
                    return Sent(False, sent, messages, rate.waited_s, err)
                offset += len(data)
                sent += len(data)
        finally:
            os.close(fd)
    err = one(EndPiece(offer.step, offer.meta))
    return Sent(not err, sent, messages, rate.waited_s, err,
                round(time.monotonic() - started, 3))
