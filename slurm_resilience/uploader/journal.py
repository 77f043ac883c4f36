"""The agent's durable upload journal: one JSON file per job, replaced atomically.

A record holds the job's owner, staging dir and run URI, whether the job ended,
the stage-in result, and per step the upload state of every file: the multipart
upload id and each completed part with its MD5 and ETag. It is rewritten
(temp file, fsync, rename, fsync dir) after every change, so a SIGKILLed agent
restarts exactly where it stopped.

Records are checked when read (``check_record``): states are the enums below and
every field has its type. A record that is not JSON, or whose owner, job or
staging dir is unusable, is moved to ``quarantine/`` with a log line and left
out. A record whose identity is sound but whose stage-in or step entries are
mis-shaped keeps its identity (the job's steps are then looked at again from the
staging dir); the original is quarantined all the same. Nothing read here can
stop the agent from starting.
"""

from __future__ import annotations

import enum
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import TypedDict, cast

from slurm_resilience.checkpoint.commit import write_durable
from slurm_resilience.log import get_logger

log = get_logger("checkpoint.journal")
_NAME = re.compile(r"^job-(\d+)\.json$")
MAX_RECORD_BYTES = 64 * 1024**2

class _Value(str, enum.Enum):
    """A state stored in JSON as its value; str() and f-strings give the value too."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class JobState(_Value):
    ACTIVE = "active"
    ENDED = "ended"
    FAILED = "failed"  # the uploader hit an unexpected error on this job; see "error"


class StepState(_Value):
    PENDING = "pending"
    WAITING_PEERS = "waiting-peers"
    COMMITTED = "committed"
    REJECTED = "rejected"  # never uploaded: unsafe or mismatched content
    FAILED = "failed"  # S3 refused it for good (4xx); see "reason"
    PRUNED = "pruned"


class StageinState(_Value):
    PENDING = "pending"  # to run (again, after an agent restart)
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # see "error"


DONE_STATES = frozenset({StepState.COMMITTED, StepState.REJECTED, StepState.FAILED,
                         StepState.PRUNED})


class PartDoc(TypedDict):
    etag: str
    size: int
    crc32c: str


class FileDoc(TypedDict, total=False):
    done: bool
    upload_id: str
    part_size: int
    checksums: bool
    parts: dict[str, PartDoc]


class StepDoc(TypedDict, total=False):
    state: StepState
    intent: bool  # this node's intent record is in S3 (intent.py)
    files: dict[str, FileDoc]
    since: float
    world_size: int
    bytes: int  # the step's size on this node, once its manifests were read
    reason: str
    committed_at: float
    staged_in: bool
    save_id: str  # the save being uploaded (commit.py); "" for steps without one


class _FallbackBase(TypedDict):
    step: int
    reason: str


class FallbackDoc(_FallbackBase, total=False):
    opt_in: str  # the opt-in that let stage-in take an older step (a config key or env var)


class StageinDoc(TypedDict, total=False):
    """The stage-in result (restore.run_stagein); ``state`` is always there."""

    state: StageinState
    started: float
    finished: float  # when it ended, for the metrics (stage-in time) and goodput
    step: int | None
    source: str
    mode: str
    fetched_bytes: int
    fallbacks: list[FallbackDoc]
    seconds: float
    error: str
    still_uploading: int  # failed: the step whose upload never completed within the wait


class _JobRecordBase(TypedDict):
    job_id: int
    uid: int
    gid: int
    user: str
    staging_root: str
    uri: str | None
    state: JobState
    ended_at: float | None
    stagein: StageinDoc
    steps: dict[str, StepDoc]


class JobRecord(_JobRecordBase, total=False):
    """One job's journal record, as written to ``job-<id>.json`` (enums as their values)."""

    failed_from: JobState | None  # the state before FAILED, restored on the retry
    error: str
    failed_at: float
    stagein_excluded: dict[str, str]  # step -> why the restore passed it over
    stagein_wanted: int  # the step the job's ranks agreed on (ckpt.stage): staged, no other
    allow_older_step: bool  # the job's opt-in (ckpt.register): see stagein.StepStillUploading
    unreachable_nodes: list[str]  # the job's other nodes whose agent its ranks couldn't reach


JobRecordDoc = JobRecord  # the name older code and tests use


class BadRecord(ValueError):
    """A journal record that does not have the shape above."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise BadRecord(what)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_identity(doc: object, job_id: int) -> None:
    """The fields that say whose job this is and where its files are."""
    _need(isinstance(doc, dict), "not a JSON object")
    assert isinstance(doc, dict)
    _need(doc.get("job_id") == job_id and _is_int(doc.get("job_id")),
          f"job_id {doc.get('job_id')!r} does not match the file name")
    for key in ("uid", "gid"):
        _need(_is_int(doc.get(key)) and doc[key] >= 0, f"{key} {doc.get(key)!r} is not a uid")
    for key in ("user", "staging_root"):
        _need(isinstance(doc.get(key), str) and bool(doc[key]), f"{key} is not a string")
    _need(doc.get("uri") is None or isinstance(doc.get("uri"), str), "uri is not a string")


def check_step(st: object) -> None:
    _need(isinstance(st, dict), "step entry is not an object")
    assert isinstance(st, dict)
    _need(st.get("state") in set(StepState), f"step state {st.get('state')!r} is unknown")
    st["state"] = StepState(st["state"])
    files = st.get("files", {})
    _need(isinstance(files, dict), "files is not an object")
    for key, f in files.items():
        _need(isinstance(f, dict), f"file {key!r} is not an object")
        _need(isinstance(f.get("done", False), bool), f"file {key!r}: done is not a bool")
        _need(f.get("upload_id") is None or isinstance(f["upload_id"], str),
              f"file {key!r}: upload_id is not a string")
        _need(f.get("part_size") is None or _is_int(f["part_size"]),
              f"file {key!r}: part_size is not an integer")
        parts = f.get("parts", {})
        _need(isinstance(parts, dict), f"file {key!r}: parts is not an object")
        for n, part in parts.items():
            _need(n.isdigit() and isinstance(part, dict) and isinstance(part.get("etag"), str)
                  and _is_int(part.get("size")) and isinstance(part.get("crc32c", ""), str),
                  f"file {key!r}: part {n!r} is mis-shaped")
    for key in ("since", "committed_at"):
        _need(st.get(key) is None or _is_num(st[key]), f"{key} is not a number")
    _need(st.get("world_size") is None or _is_int(st["world_size"]),
          "world_size is not an integer")
    _need(st.get("save_id") is None or isinstance(st["save_id"], str),
          "save_id is not a string")


def check_record(doc: object, job_id: int) -> tuple[JobRecord, list[str]]:
    """A usable record from ``doc`` and what had to be dropped from it.

    Raises BadRecord when even the identity is unusable.
    """
    check_identity(doc, job_id)
    assert isinstance(doc, dict)
    problems: list[str] = []
    # Fields this module does not know (added by other services) are kept as they are.
    rec = cast(JobRecord, {**doc, **new_record(job_id, doc["uid"], doc["gid"], doc["user"],
                                               doc["staging_root"])})
    rec["uri"] = doc.get("uri")
    if doc.get("state") in set(JobState):
        rec["state"] = JobState(doc["state"])
    else:
        problems.append(f"job state {doc.get('state')!r} is unknown")
    if doc.get("ended_at") is not None:
        if _is_num(doc["ended_at"]):
            rec["ended_at"] = float(doc["ended_at"])
        else:
            problems.append("ended_at is not a number")
    if doc.get("failed_at") is not None and not _is_num(doc["failed_at"]):
        rec.pop("failed_at", None)
        problems.append("failed_at is not a number")
    if rec.get("failed_from") not in (None, *set(JobState)):
        rec.pop("failed_from")
        problems.append("failed_from is not a job state")
    elif rec.get("failed_from") is not None:
        rec["failed_from"] = JobState(rec["failed_from"])
    if not isinstance(doc.get("allow_older_step", False), bool):
        rec.pop("allow_older_step", None)
        problems.append("allow_older_step is not a bool")
    wanted = doc.get("stagein_wanted", 0)
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 0:
        rec.pop("stagein_wanted", None)
        problems.append("stagein_wanted is not a step number")
    lost = doc.get("unreachable_nodes", [])
    if not isinstance(lost, list) or not all(isinstance(n, str) for n in lost):
        rec.pop("unreachable_nodes", None)
        problems.append("unreachable_nodes is not a list of node names")
    if doc.get("error") is not None and not isinstance(doc["error"], str):
        rec["error"] = str(doc["error"])
    if rec["state"] == JobState.ENDED and rec.get("ended_at") is None:
        rec["ended_at"] = time.time()
    si = doc.get("stagein")
    if isinstance(si, dict) and si.get("state") in set(StageinState):
        rec["stagein"] = cast(StageinDoc, {**si, "state": StageinState(si["state"])})
    else:
        problems.append(f"stagein {si!r} is mis-shaped")
        # Nothing to redo for a job without a URI; else stage-in runs again.
        rec["stagein"] = {"state": StageinState.PENDING if rec["uri"] else StageinState.DONE}
    steps = doc.get("steps")
    if not isinstance(steps, dict):
        problems.append("steps is not an object")
        steps = {}
    for name, st in steps.items():
        try:
            _need(isinstance(name, str) and name.isdigit(), f"step name {name!r}")
            check_step(st)
        except BadRecord as exc:
            problems.append(f"step {name!r}: {exc}")
            continue  # looked at again from the staging dir
        rec["steps"][name] = cast(StepDoc, st)
    return rec, problems


class Journal:
    """Records keyed by job id, stored under a root-owned directory."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if stat.S_IMODE(self.dir.stat().st_mode) != 0o700:  # a read-only disk can't chmod
            os.chmod(self.dir, 0o700)

    def path(self, job_id: int) -> Path:
        return self.dir / f"job-{int(job_id)}.json"

    def load_all(self) -> dict[int, JobRecord]:
        """Every record that can be used; mis-shaped ones are quarantined, never fatal."""
        out: dict[int, JobRecord] = {}
        for name in sorted(os.listdir(self.dir)):
            m = _NAME.match(name)
            if not m:
                continue
            job_id = int(m.group(1))
            try:
                with open(self.dir / name, "rb") as fh:
                    data = fh.read(MAX_RECORD_BYTES + 1)
                if len(data) > MAX_RECORD_BYTES:
                    raise BadRecord(f"larger than {MAX_RECORD_BYTES} bytes")
                rec, problems = check_record(json.loads(data), job_id)
            except (OSError, ValueError) as exc:  # BadRecord and JSON errors are ValueErrors
                self.quarantine(name, f"unusable, left out: {exc}")
                continue
            if problems:
                self.quarantine(name, "mis-shaped parts dropped: " + "; ".join(problems))
                self.write(rec)
            out[job_id] = rec
        return out

    def quarantine(self, name: str, why: str) -> None:
        """Move a record aside (``quarantine/<name>.<time>``) and say why."""
        qdir = self.dir / "quarantine"
        qdir.mkdir(mode=0o700, exist_ok=True)
        dest = qdir / f"{name}.{time.time_ns()}"
        try:
            os.rename(self.dir / name, dest)
        except OSError as exc:
            log.error("checkpoint: journal: couldn't quarantine record", file=name,
                      error=str(exc), reason=why)
            return
        log.error("checkpoint: journal: quarantined a mis-shaped record", file=name,
                  moved_to=str(dest), reason=why)

    # One writer: the uploader's record owner thread (owner.py) writes and deletes.
    def write(self, rec: JobRecord) -> None:
        write_durable(self.path(int(rec["job_id"])), json.dumps(rec, sort_keys=True).encode())

    def delete(self, job_id: int) -> None:
        try:
            os.unlink(self.path(job_id))
        except FileNotFoundError:
            return


def new_record(job_id: int, uid: int, gid: int, user: str, staging_root: str) -> JobRecord:
    return {"job_id": job_id, "uid": uid, "gid": gid, "user": user,
            "staging_root": staging_root, "uri": None, "state": JobState.ACTIVE,
            "ended_at": None, "stagein": {"state": StageinState.PENDING}, "steps": {}}


def pending_steps(rec: JobRecord) -> list[int]:
    """Steps committed locally but not yet safe (committed and verified) in S3."""
    return sorted(int(s) for s, st in rec.get("steps", {}).items()
                  if st.get("state") not in DONE_STATES)


def failed_steps(rec: JobRecord) -> dict[int, str]:
    """Steps that will never reach S3 (refused by S3, or by us), with the reason."""
    return {int(s): str(st.get("reason", "")) for s, st in rec.get("steps", {}).items()
            if st.get("state") in (StepState.FAILED, StepState.REJECTED)}
