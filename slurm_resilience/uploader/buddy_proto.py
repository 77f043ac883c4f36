"""Buddy copies on the agents' exchange: the pieces a transfer is made of.

A transfer is a run of ``buddy`` exchange messages, each a munge credential sealed by the
sending agent (transport/credentials.py), bound to the job, the sender and the receiver
(transport/wire.py, netrendezvous.py), answered before the next is sent:

* ``offer``: the start, with the commit marker, the manifests of the source's ranks and
  the files whose bytes follow (all of them for a copy, only ``.metadata`` for the
  step's metadata a restoring node asked for); long offers come in several pieces;
* ``data``: the next bytes of the next file, base64 (a piece stays under the exchange's
  ``max_piece_bytes``);
* ``end``: the receiver verifies and keeps the copy, or refuses it;
* ``pull``: a restoring node asks a node of its job for the step's metadata (its own
  part's manifests and, on rank 0's node, ``.metadata``) and for the copies it holds of
  the nodes named in ``copies_of``; that node pushes them as transfers of their own.

Every field is checked here before anything is done with it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from slurm_resilience.checkpoint.commit import (
    CheckpointError,
    CommitMarker,
    Manifest,
    check_relpath,
)
from slurm_resilience.uploader.buddy_store import Offer

MAX_OFFER_BYTES = 16 * 1024 * 1024  # an offer's JSON, over all its pieces
MAX_NAMES = 4096
OVERHEAD = 512  # a data piece's JSON around its base64


class ProtoError(ValueError):
    """A piece that is not a buddy message this node takes."""


@dataclass(frozen=True)
class OfferPiece:
    step: int
    meta: bool  # metadata only (pulled), not a copy
    index: int
    count: int
    text: str


@dataclass(frozen=True)
class DataPiece:
    step: int
    meta: bool
    path: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class EndPiece:
    step: int
    meta: bool


@dataclass(frozen=True)
class PullPiece:
    step: int  # -1: the newest each node has
    own: bool  # the asked node's own part of the step
    meta: bool  # only manifests and ``.metadata`` (else every file)
    copies_of: tuple[str, ...]  # the lost nodes whose buddy copies it should send


Piece = OfferPiece | DataPiece | EndPiece | PullPiece


def data_room(max_piece_bytes: int) -> int:
    """Bytes of file data one data piece carries."""
    return max(1024, (max_piece_bytes - OVERHEAD) * 3 // 4)


def encode(piece: Piece) -> bytes:
    doc: dict[str, Any]
    if isinstance(piece, OfferPiece):
        doc = {"op": "offer", "step": piece.step, "meta": piece.meta, "index": piece.index,
               "count": piece.count, "text": piece.text}
    elif isinstance(piece, DataPiece):
        doc = {"op": "data", "step": piece.step, "meta": piece.meta, "path": piece.path,
               "offset": piece.offset, "data": base64.b64encode(piece.data).decode("ascii")}
    elif isinstance(piece, EndPiece):
        doc = {"op": "end", "step": piece.step, "meta": piece.meta}
    else:
        doc = {"op": "pull", "step": piece.step, "own": piece.own, "meta": piece.meta,
               "copies_of": list(piece.copies_of)}
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


def _int(doc: dict[str, Any], key: str, low: int = 0) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**62:
        raise ProtoError(f"{key} is not an integer of at least {low}")
    return value


def _bool(doc: dict[str, Any], key: str) -> bool:
    value = doc.get(key)
    if not isinstance(value, bool):
        raise ProtoError(f"{key} is not true or false")
    return value


def decode(data: bytes) -> Piece:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ProtoError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtoError("not a JSON object")
    op = doc.get("op")
    if op not in ("pull", "offer", "data", "end"):
        raise ProtoError(f"unknown op {str(op)[:20]!r}")
    if op == "pull":
        names = doc.get("copies_of")
        if not isinstance(names, list) or len(names) > MAX_NAMES or \
                not all(isinstance(n, str) and 0 < len(n) <= 64 for n in names):
            raise ProtoError("copies_of is not a list of node names")
        return PullPiece(_int(doc, "step", -1), _bool(doc, "own"), _bool(doc, "meta"),
                         tuple(names))
    step, meta = _int(doc, "step"), _bool(doc, "meta")
    if op == "offer":
        count = _int(doc, "count", 1)
        index = _int(doc, "index")
        text = doc.get("text")
        if index >= count or not isinstance(text, str) or not text.isascii():
            raise ProtoError("offer piece out of range or not ASCII text")
        return OfferPiece(step, meta, index, count, text)
    if op == "data":
        path = doc.get("path")
        raw = doc.get("data")
        if not isinstance(path, str) or not isinstance(raw, str):
            raise ProtoError("data piece without a path or data")
        try:
            check_relpath(path)
            blob = base64.b64decode(raw, validate=True)
        except (CheckpointError, binascii.Error) as exc:
            raise ProtoError(f"data piece: {exc}") from None
        return DataPiece(step, meta, path, _int(doc, "offset"), blob)
    return EndPiece(step, meta)


def offer_text(offer: Offer, send: tuple[str, ...]) -> str:
    """The offer as the JSON the receiver rebuilds it from."""
    return json.dumps({"step": offer.step, "total": offer.total_bytes, "source": offer.source,
                       "marker": json.loads(offer.marker.to_json()),
                       "manifests": {str(r): json.loads(m.to_json())
                                     for r, m in sorted(offer.manifests.items())},
                       "send": list(send)}, separators=(",", ":"), ensure_ascii=True)


def parse_offer(text: str, job_id: int, meta: bool) -> tuple[Offer, tuple[str, ...]]:
    """An offer's JSON (every piece joined) → the Offer and the files whose bytes follow."""
    if len(text) > MAX_OFFER_BYTES:
        raise ProtoError(f"offer of {len(text):,} bytes, over {MAX_OFFER_BYTES:,}")
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        marker = CommitMarker.from_json(json.dumps(doc["marker"]).encode(), "offer marker")
        raw = doc["manifests"]
        if not isinstance(raw, dict) or len(raw) > MAX_NAMES:
            raise ValueError("manifests is not an object of at most 4096 ranks")
        manifests = {int(r): Manifest.from_json(json.dumps(m).encode(), f"offer rank {r}")
                     for r, m in raw.items()}
        send = doc["send"]
        if not isinstance(send, list) or not all(isinstance(p, str) for p in send):
            raise ValueError("send is not a list of paths")
        step, total, source = doc["step"], doc["total"], doc["source"]
        if not isinstance(step, int) or not isinstance(total, int):
            raise ValueError("step or total is not an integer")
        if not isinstance(source, str) or not 0 < len(source) <= 64:
            raise ValueError("source is not a node name")
    except (ValueError, KeyError, TypeError, CheckpointError) as exc:
        raise ProtoError(f"offer: {exc}") from None
    return Offer(job_id, source, step, marker, manifests, total, meta), tuple(send)
