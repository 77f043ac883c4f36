"""Intent records: a step committed on some node, whose upload to S3 is under way.

When the agent learns that a step committed locally, it writes a small
``step-N/INTENT-<node>.json`` to S3 before it uploads any data. COMMIT.json only
appears once every rank's part is in S3, which may take a while, or never happen
when a node dies first. A later job's stage-in that finds an intent record but no
COMMIT.json knows the step exists and is newer than what S3 holds complete: it
waits for it (bounded) instead of silently taking an older step.

Each intent record names its save (commit.py: save ids), and before it the agent writes
``step-N/SAVE-<save id>`` (empty): one LIST of ``step-N/SAVE-`` tells an agent which
saves of the step exist, without reading any record. An upload whose save is older
than another one listed there stops (service.py), so a node that comes back with an
old upload of step N never writes into a newer save of N.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from slurm_resilience.checkpoint.commit import (
    CheckpointError,
    CommitMarker,
    Crc32c,
    check_save_id,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri, parse_uri
from slurm_resilience.log import get_logger
from slurm_resilience.uploader.journal import JobRecord, StepDoc
from slurm_resilience.uploader.s3 import S3, S3Error, error_code

log = get_logger("checkpoint.intent")

PREFIX = "INTENT-"
SAVE_PREFIX = "SAVE-"  # step-N/SAVE-<save id>: a save of the step exists (empty object)
_NODE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_NAME = re.compile(r"^INTENT-([A-Za-z0-9._-]{1,128})\.json$")


@dataclass(frozen=True)
class Intent:
    """What one node wrote when its ranks committed ``step`` locally."""

    step: int
    job_id: int
    node: str
    ranks: tuple[int, ...]
    world_size: int
    time: float
    save_id: str = ""  # the save being uploaded ("": written before save ids)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"step": self.step, "job_id": self.job_id, "node": self.node,
                               "ranks": list(self.ranks), "world_size": self.world_size,
                               "time": self.time}
        if self.save_id:
            doc["save_id"] = self.save_id
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Intent:
        try:
            doc: Any = json.loads(data)
            return cls(step=int(doc["step"]), job_id=int(doc["job_id"]), node=str(doc["node"]),
                       ranks=tuple(int(r) for r in doc["ranks"]),
                       world_size=int(doc["world_size"]), time=float(doc["time"]),
                       save_id=check_save_id(doc.get("save_id"), where))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint: {where}: not a valid intent record: {exc}"
                                  ) from None


def intent_name(node: str) -> str:
    if not _NODE.match(node):
        raise CheckpointError(f"checkpoint: intent: node name {node!r} can't be used in a key")
    return f"{PREFIX}{node}.json"


def is_intent(name: str) -> bool:
    """Whether a key relative to the step dir is an intent record."""
    return _NAME.match(name) is not None


def save_key(uri: S3Uri, step: int, save_id: str) -> str:
    return uri.join(step_name(step), f"{SAVE_PREFIX}{check_save_id(save_id, 'save key')}")


def saves_of(s3: S3, uri: S3Uri, step: int) -> set[str]:
    """The save ids of ``step`` announced in S3 (one LIST of ``step-N/SAVE-``)."""
    prefix = uri.join(step_name(step), SAVE_PREFIX)
    out = set()
    for key in s3.list_keys(uri.bucket, prefix):
        try:
            out.add(check_save_id(key[len(prefix):], key))
        except CheckpointError:
            continue  # not ours to judge: never a reason to stop an upload
    out.discard("")
    return out


def announce(s3: S3, uri: S3Uri, rec: JobRecord, step_record: StepDoc,
             marker: CommitMarker, ranks: list[int], node: str) -> None:
    """Write this node's intent record for the marker's step once, before any of its data
    (and, first, the save's ``SAVE-<id>`` key)."""
    if step_record.get("intent"):
        return
    if marker.save_id:
        s3.put_bytes(uri.bucket, save_key(uri, marker.step, marker.save_id), b"", "00000000")
    body = Intent(marker.step, int(rec["job_id"]), node, tuple(sorted(ranks)),
                  marker.world_size, time.time(), marker.save_id).to_json()
    crc = Crc32c()
    crc.update(body)
    s3.put_bytes(uri.bucket, uri.join(step_name(marker.step), intent_name(node)), body,
                 crc.hexdigest())
    step_record["intent"] = True


def withdraw(s3: S3, rec: JobRecord, step_record: StepDoc, step: int,
             node: str) -> None:
    """Delete this node's intent record of a step that will never commit (rejected or
    abandoned), so no later stage-in waits for it. Best effort: a failure is logged."""
    if not step_record.get("intent") or not rec.get("uri"):
        return
    uri = parse_uri(str(rec["uri"]))
    key = uri.join(step_name(step), intent_name(node))
    try:
        ours = step_record.get("save_id", "")
        if ours:  # the key may hold another save's record by now (a new job on this node)
            try:
                data = s3.get_bytes(uri.bucket, key, limit=1 << 20)
            except S3Error as exc:
                if error_code(exc.__cause__ or exc) in ("NoSuchKey", "404", "NotFound"):
                    step_record["intent"] = False
                    return
                raise
            try:
                theirs: Intent | None = Intent.from_json(data, key)
            except CheckpointError:
                theirs = None  # not a record anyone can use: it goes
            if theirs is not None and theirs.save_id != ours:
                log.info("intent record now belongs to another save; left in place", key=key,
                         ours=ours, theirs=theirs.save_id)
                step_record["intent"] = False
                return
        s3.delete_keys(uri.bucket, [key])
    except CheckpointError as exc:
        log.warning("couldn't withdraw the intent record of an abandoned step", key=key,
                    error=str(exc))
        return
    step_record["intent"] = False
