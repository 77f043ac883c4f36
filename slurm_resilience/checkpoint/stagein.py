"""Stage-in: bring the newest verified step into a job's staging dir (root side).

A local step is used when its manifests and checksums verify. Otherwise the
newest step whose COMMIT.json is in S3 is downloaded (files in parallel ranges),
every file checked against its manifest's CRC32C, and renamed into place; a
corrupt step falls back to the one before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CommitMarker,
    Manifest,
    crc_hex,
    fsync_dir,
    parse_rank,
    parse_step,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri
from slurm_resilience.checkpoint.rootfs import committed_steps_at, verify_step_at
from slurm_resilience.checkpoint.s3 import S3
from slurm_resilience.checkpoint.staging import open_dir_at, remove_at
from slurm_resilience.log import get_logger

log = get_logger("checkpoint.stagein")


def remote_steps(s3: S3, uri: S3Uri) -> dict[int, dict[str, int]]:
    """Steps with a COMMIT.json in S3 → their object keys (relative to the step) and sizes."""
    keys = s3.list_keys(uri.bucket, uri.join() + "/" if uri.key else "")
    steps: dict[int, dict[str, int]] = {}
    base = len(uri.key) + 1 if uri.key else 0
    for key, size in keys.items():
        sname, _, rest = key[base:].partition("/")
        step = parse_step(sname)
        if step is not None and rest:
            steps.setdefault(step, {})[rest] = size
    return {s: objs for s, objs in steps.items() if COMMIT in objs}


def read_remote_step(s3: S3, uri: S3Uri, step: int) -> tuple[CommitMarker, dict[int, Manifest]]:
    sname = step_name(step)
    marker = CommitMarker.from_json(s3.get_bytes(uri.bucket, uri.join(sname, COMMIT)),
                                    f"{uri}/{sname}/{COMMIT}")
    manifests = {}
    for rank in range(marker.world_size):
        rel = f"{rank_name(rank)}/{MANIFEST}"
        m = Manifest.from_json(s3.get_bytes(uri.bucket, uri.join(sname, rel)),
                               f"{uri}/{sname}/{rel}")
        if m.step != step or m.rank != rank:
            raise CheckpointError(f"checkpoint: {uri}/{sname}/{rel}: says step {m.step} "
                                  f"rank {m.rank}")
        manifests[rank] = m
    return marker, manifests


def _mkdir_owned(dir_fd: int, name: str, uid: int, gid: int) -> int:
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = open_dir_at(dir_fd, name)
    os.fchown(fd, uid, gid)
    return fd


def _makedirs_at(base_fd: int, relpath: str, uid: int, gid: int) -> int:
    fd = os.dup(base_fd)
    for part in [p for p in relpath.split("/") if p]:
        try:
            nfd = _mkdir_owned(fd, part, uid, gid)
        except FileExistsError:
            nfd = open_dir_at(fd, part)
        os.close(fd)
        fd = nfd
    return fd


def _create_owned(dir_fd: int, name: str, uid: int, gid: int) -> int:
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    os.fchown(fd, uid, gid)
    return fd


def download_step(s3: S3, uri: S3Uri, step: int, job_fd: int, uid: int, gid: int) -> None:
    """Download every rank of ``step`` into ``.stagein-step-N/``, verify, rename into place."""
    sname = step_name(step)
    tmp = f".stagein-{sname}"
    with contextlib.suppress(FileNotFoundError):
        remove_at(job_fd, tmp)
    marker, manifests = read_remote_step(s3, uri, step)
    tfd = _mkdir_owned(job_fd, tmp, uid, gid)
    try:
        for rank, m in manifests.items():
            rfd = _mkdir_owned(tfd, rank_name(rank), uid, gid)
            try:
                for f in m.files:
                    head, _, name = f.path.rpartition("/")
                    pfd = _makedirs_at(rfd, head, uid, gid)
                    try:
                        fd = _create_owned(pfd, name, uid, gid)
                    finally:
                        os.close(pfd)
                    try:
                        crc = s3.download_fd(uri.bucket, uri.join(sname, rank_name(rank), f.path),
                                             f.size, fd)
                        if crc != f.crc32c or os.fstat(fd).st_size != f.size:
                            raise CheckpointError(
                                f"checkpoint: stage-in: {uri}/{sname}/{rank_name(rank)}/{f.path}: "
                                f"crc32c {crc}, manifest says {f.crc32c}")
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                _write_owned(rfd, MANIFEST, m.to_json(), uid, gid)
            finally:
                os.close(rfd)
        _write_owned(tfd, COMMIT, marker.to_json(), uid, gid)
        os.fsync(tfd)
    except BaseException:
        os.close(tfd)
        remove_at(job_fd, tmp)
        raise
    os.close(tfd)
    with contextlib.suppress(FileNotFoundError):
        remove_at(job_fd, sname)  # a local copy that did not verify
    os.rename(tmp, sname, src_dir_fd=job_fd, dst_dir_fd=job_fd)
    os.fsync(job_fd)


def _write_owned(dir_fd: int, name: str, data: bytes, uid: int, gid: int) -> None:
    fd = _create_owned(dir_fd, name, uid, gid)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def stage_in(s3: S3 | None, uri: S3Uri | None, job_fd: int, uid: int, gid: int,
             on_bad: Callable[[int, str], None] | None = None) -> tuple[int | None, str]:
    """(step, source) of the newest verified step now in the job dir; source local/s3/none."""
    newest_local: int | None = None
    for step in reversed(committed_steps_at(job_fd)):
        try:
            verify_step_at(job_fd, step, uid)
            newest_local = step
            break
        except (CheckpointError, OSError) as exc:
            log.warning("local step does not verify", step=step, error=str(exc))
            if on_bad:
                on_bad(step, str(exc))
    if s3 is None or uri is None:
        return newest_local, "local" if newest_local is not None else "none"
    for step in sorted(remote_steps(s3, uri), reverse=True):
        if newest_local is not None and step <= newest_local:
            break
        try:
            download_step(s3, uri, step, job_fd, uid, gid)
            verify_step_at(job_fd, step, uid, need_all=True)
        except CheckpointError as exc:
            log.error("stage-in: step does not verify, falling back", step=step, error=str(exc))
            if on_bad:
                on_bad(step, str(exc))
            continue
        log.info("stage-in: staged step from S3", step=step, uri=str(uri))
        return step, "s3"
    return newest_local, "local" if newest_local is not None else "none"


def pull(s3: S3, uri: S3Uri, dest: Path, step: int | None = None) -> int:
    """``ckpt pull``: download the newest (or given) complete step as the calling user."""
    steps = sorted(remote_steps(s3, uri), reverse=True)
    if step is not None:
        steps = [s for s in steps if s == step]
    if not steps:
        raise CheckpointError(f"checkpoint: pull: no complete step in {uri}")
    dest.mkdir(parents=True, exist_ok=True)
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for s in steps:
            try:
                download_step(s3, uri, s, dfd, os.getuid(), os.getgid())
            except CheckpointError as exc:
                print(f"checkpoint: pull: step {s} does not verify ({exc}); trying the previous")
                continue
            fsync_dir(dest)
            return s
    finally:
        os.close(dfd)
    raise CheckpointError(f"checkpoint: pull: no step of {uri} verifies")


def verify_remote(s3: S3, uri: S3Uri, step: int, scratch: Path) -> list[str]:
    """Download-free structural check plus a full CRC check via a scratch download."""
    marker, manifests = read_remote_step(s3, uri, step)
    problems = []
    objs = remote_steps(s3, uri).get(step, {})
    for rank, m in manifests.items():
        for f in m.files:
            rel = f"{rank_name(rank)}/{f.path}"
            if objs.get(rel) != f.size:
                problems.append(f"{rel}: size {objs.get(rel)} in S3, manifest says {f.size}")
                continue
            path = scratch / f"verify-{os.getpid()}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                crc = s3.download_fd(uri.bucket, uri.join(step_name(step), rel), f.size, fd)
            finally:
                os.close(fd)
                os.unlink(path)
            if crc != f.crc32c:
                problems.append(f"{rel}: crc32c {crc} in S3, manifest says {f.crc32c}")
    _ = (marker, parse_rank, crc_hex)
    return problems
