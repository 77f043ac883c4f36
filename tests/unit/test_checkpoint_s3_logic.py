"""Pure decisions of the S3 upload path: part sizes, error classes, CRC32C combination,
fair scheduling, retention over a run's listing, and journal record checks."""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path

import google_crc32c
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from slurm_resilience.checkpoint.crc_combine import combine_parts, crc32c_combine
from slurm_resilience.config import Config, ConfigError, load_text
from slurm_resilience.uploader.fairpool import FairPool
from slurm_resilience.uploader.journal import (
    JobState,
    Journal,
    StageinState,
    StepState,
    new_record,
)
from slurm_resilience.uploader.retention import plan_remote_retention
from slurm_resilience.uploader.s3 import (
    MAX_OBJECT_SIZE,
    MAX_PARTS,
    MiB,
    PermanentS3Error,
    is_transient,
    plan_part_size,
)

TiB = 1024**4


def test_part_size_grows_to_stay_within_the_part_limit() -> None:
    """Small files keep the configured part size; 5 TiB fits in 10,000 whole-MiB parts."""
    assert plan_part_size(100 * MiB, 5 * MiB) == 5 * MiB
    assert plan_part_size(5 * MiB * MAX_PARTS, 5 * MiB) == 5 * MiB  # exactly at the limit
    big = plan_part_size(5 * MiB * MAX_PARTS + 1, 5 * MiB)
    assert big == 6 * MiB and -(-(5 * MiB * MAX_PARTS + 1) // big) <= MAX_PARTS
    part = plan_part_size(MAX_OBJECT_SIZE, 5 * MiB)
    assert part % MiB == 0 and -(-MAX_OBJECT_SIZE // part) <= MAX_PARTS
    assert plan_part_size(30 * MiB, 5 * MiB, max_parts=4) == 8 * MiB  # a lowered limit
    with pytest.raises(PermanentS3Error, match="5 TiB"):
        plan_part_size(MAX_OBJECT_SIZE + 1, 5 * MiB)


def test_config_refuses_parts_below_the_s3_minimum_and_says_why() -> None:
    """part_size 4MiB is refused with the range and the reason (S3's 5MiB minimum)."""
    with pytest.raises(ConfigError, match=r"out of range \[5242880.*5MiB to 5GiB.*10,000"):
        load_text(Config, "checkpoint:\n  part_size: 4MiB\n")


def _client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(("status", "code", "transient"), [
    (503, "SlowDown", True), (500, "InternalError", True), (429, "TooManyRequests", True),
    (400, "RequestTimeout", True), (400, "ThrottlingException", True), (400, "BadDigest", True),
    (403, "AccessDenied", False), (404, "NoSuchBucket", False), (400, "InvalidArgument", False),
    (400, "EntityTooSmall", False), (412, "PreconditionFailed", False),
])
def test_errors_are_classified(status: int, code: str, transient: bool) -> None:
    """5xx, throttling, timeouts and in-flight corruption are transient; other 4xx are not."""
    assert is_transient(_client_error(status, code)) is transient


def test_connection_errors_are_transient() -> None:
    """An unreachable endpoint or a read timeout is worth retrying."""
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert not is_transient(ValueError("bad parameter"))


def test_crc32c_of_parts_combines_to_the_whole() -> None:
    """The whole-file CRC32C rebuilt from part CRCs equals the CRC32C of the bytes."""
    data = os.urandom(3 * 1024 * 1024 + 17)
    cuts = [0, 5, 1024 * 1024, 2 * 1024 * 1024 + 3, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(cuts)]
    assert combine_parts([(google_crc32c.value(p), len(p)) for p in pieces]) == \
        google_crc32c.value(data)
    assert crc32c_combine(123, 0, 0) == 123


def test_fair_pool_alternates_between_owners() -> None:
    """With one worker, a 2-task owner is served between the 5 tasks of a bigger one."""
    pool = FairPool(1)
    gate = threading.Event()
    order: list[str] = []
    pool.submit("gate", gate.wait)  # holds the worker until everything is queued
    futs = [pool.submit("big", lambda i=i: order.append(f"big{i}")) for i in range(5)]
    futs += [pool.submit("small", lambda i=i: order.append(f"small{i}")) for i in range(2)]
    gate.set()
    for f in futs:
        f.result(timeout=10)
    pool.close()
    assert order == ["big0", "small0", "big1", "small1", "big2", "big3", "big4"]


def test_fair_pool_hands_errors_to_the_caller() -> None:
    """A failing task's exception reaches its future; the worker goes on."""
    pool = FairPool(1)

    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        pool.submit("a", boom).result(timeout=10)
    assert pool.submit("a", lambda: 7).result(timeout=10) == 7
    pool.close()


def _listing(steps: dict[int, float], extra: dict[str, float] | None = None
             ) -> dict[str, tuple[int, float]]:
    out = {}
    for step, t in steps.items():
        out[f"step-{step:08d}/rank-00000/data.distcp"] = (10, t)
        out[f"step-{step:08d}/COMMIT.json"] = (40, t)
    for key, t in (extra or {}).items():
        out[key] = (10, t)
    return out


def test_retention_counts_every_job_of_the_run() -> None:
    """The run's listing decides: [3,4] + [7,8] + [11,12] with keep 2 leaves [11,12]."""
    objs = _listing({3: 1.0, 4: 2.0, 7: 3.0, 8: 4.0, 11: 5.0, 12: 6.0})
    assert plan_remote_retention(objs, 2, 0, 86400, now=10.0) == [3, 4, 7, 8]
    assert plan_remote_retention(objs, 0, 0, 86400, now=10.0) == []
    assert plan_remote_retention(objs, 6, 0, 86400, now=10.0) == []


def test_retention_spares_steps_still_uploading_or_just_superseded() -> None:
    """A step without COMMIT.json (still uploading, an intent record) stays until abandoned;
    a committed step goes only grace_s after a newer one was committed."""
    objs = _listing({5: 100.0, 9: 200.0, 10: 290.0}, {
        "step-00000002/INTENT-node3.json": 150.0,  # another job's upload in progress
        "step-00000002/rank-00001/data.distcp": 150.0,
        "step-00000001/rank-00000/data.distcp": 0.0})  # abandoned long ago
    assert plan_remote_retention(objs, 1, grace_s=60, abandoned_s=1000, now=300.0) == [5]
    assert plan_remote_retention(objs, 1, grace_s=60, abandoned_s=100, now=300.0) == [1, 2, 5]
    assert plan_remote_retention(objs, 1, grace_s=0, abandoned_s=1000, now=300.0) == [5, 9]


def _journal_with(tmp_path: Path, files: dict[str, str]) -> Journal:
    d = tmp_path / "journal"
    d.mkdir(mode=0o700)
    for name, text in files.items():
        (d / name).write_text(text)
    return Journal(d)


def test_misshaped_journal_records_are_quarantined_never_fatal(tmp_path: Path) -> None:
    """Not JSON, a wrong identity or wrong types: moved to quarantine/; good records load;
    a record whose identity is sound keeps it, with the broken parts dropped."""
    good = new_record(1, 1000, 1000, "alice", "/nvme")
    salvaged = {**new_record(2, 1001, 1001, "bob", "/nvme"), "uri": "s3://b/bob/r",
                "stagein": None, "ended_at": "yesterday", "other_service": {"kept": 1},
                "steps": {"5": {"state": "pending", "files": []}, "6": {"state": "committed"}}}
    journal = _journal_with(tmp_path, {
        "job-1.json": json.dumps(good),
        "job-2.json": json.dumps(salvaged),
        "job-3.json": "{not json",
        "job-4.json": json.dumps({"job_id": 4}),  # missing keys
        "job-5.json": json.dumps({**new_record(5, 1, 1, "c", "/nvme"), "uid": "root"}),
        "job-6.json": json.dumps([1, 2]),
        "job-7.json": json.dumps({**new_record(8, 1, 1, "c", "/nvme")}),  # id mismatch
    })
    recs = journal.load_all()
    assert sorted(recs) == [1, 2]
    assert recs[1] == good
    assert recs[2]["stagein"] == {"state": "pending"} and recs[2]["uri"] == "s3://b/bob/r"
    assert list(recs[2]["steps"]) == ["6"]
    assert recs[2]["ended_at"] is None and dict(recs[2])["other_service"] == {"kept": 1}
    quarantined = sorted(p.name.split(".")[0] for p in (journal.dir / "quarantine").iterdir())
    assert quarantined == ["job-2", "job-3", "job-4", "job-5", "job-6", "job-7"]
    assert json.loads((journal.dir / "job-2.json").read_text())["steps"] == {
        "6": {"state": "committed"}}
    assert Journal(journal.dir).load_all().keys() == {1, 2}  # the rewrite is clean


def test_journal_states_load_as_enums_and_keep_their_json(tmp_path: Path) -> None:
    """A record written with bare strings (as every agent so far wrote it) loads with
    JobState/StepState/StageinState members, and is written back byte for byte the same
    shape; a stage-in state no version ever wrote is quarantined and stage-in redone."""
    old = {**new_record(3, 1000, 1000, "alice", "/nvme"), "uri": "s3://b/alice/r",
           "state": "failed", "failed_from": "ended", "failed_at": 5.0, "error": "boom",
           "stagein": {"state": "done", "step": 6, "seconds": 1.5},
           "steps": {"6": {"state": "waiting-peers", "files": {}, "since": 1.0}}}
    odd = {**new_record(4, 1000, 1000, "alice", "/nvme"), "uri": "s3://b/alice/r",
           "stagein": {"state": "exploded"}}
    journal = _journal_with(tmp_path, {"job-3.json": json.dumps(old),
                                       "job-4.json": json.dumps(odd)})
    recs = journal.load_all()
    rec = recs[3]
    assert rec["state"] is JobState.FAILED and rec.get("failed_from") is JobState.ENDED
    assert rec["stagein"]["state"] is StageinState.DONE
    assert rec["steps"]["6"]["state"] is StepState.WAITING_PEERS
    journal.write(rec)
    assert json.loads((journal.dir / "job-3.json").read_text()) == old
    assert recs[4]["stagein"] == {"state": StageinState.PENDING}
    assert [p.name.split(".")[0] for p in (journal.dir / "quarantine").iterdir()] == ["job-4"]


def test_job_start_refuses_a_bool_or_float_job_id(tmp_path: Path) -> None:
    """ckpt.job_start types each field: True is not job 1 and 7.9 is not job 7 (int()
    took both); the refusal names the field, and nothing is journaled."""
    from slurm_resilience.agent.service import Peer, RequestError
    from slurm_resilience.config import Config, load_text
    from slurm_resilience.uploader.service import Uploader

    cfg = load_text(Config, f"node:\n  state_dir: {tmp_path}/state\ncheckpoint:\n"
                            f"  staging_root: {tmp_path}/nvme\n")
    up = Uploader(cfg, "n1")
    root = Peer(pid=1, uid=0, gid=0)
    for bad in (True, 7.9):
        with pytest.raises(RequestError, match="job_id must be a non-negative integer"):
            up.on_job_start({"job_id": bad, "uid": 0, "gid": 0, "user": "root"}, root)
    with pytest.raises(RequestError, match="user must be a string"):
        up.on_job_start({"job_id": 7, "uid": 0, "gid": 0, "user": ["root"]}, root)
    assert up.jobs == {} and list(up.journal.dir.glob("job-*.json")) == []
