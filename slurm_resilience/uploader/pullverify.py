"""``ckpt pull`` and ``ckpt verify``: what a person runs against a run's S3 steps, with a
progress bar on a terminal (the stage-in algorithm they share is in :mod:`.stagein`)."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_resilience.checkpoint.commit import (
    CheckpointError,
    Manifest,
    fsync_dir,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.prefix import S3Uri
from slurm_resilience.progress import Advance, BarFactory, quiet
from slurm_resilience.uploader.s3 import S3
from slurm_resilience.uploader.stagein import download_step, read_remote_step, remote_steps


def pull(s3: S3, uri: S3Uri, dest: Path, step: int | None = None,
         bar: BarFactory = quiet) -> int:
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
                download_step(s3, uri, s, dfd, os.getuid(), os.getgid(), bar)
            except CheckpointError as exc:
                print(f"checkpoint: pull: step {s} does not verify ({exc}); trying the previous")
                continue
            fsync_dir(dest)
            return s
    finally:
        os.close(dfd)
    raise CheckpointError(f"checkpoint: pull: no step of {uri} verifies")


def verify_remote(s3: S3, uri: S3Uri, step: int, scratch: Path,
                  bar: BarFactory = quiet) -> list[str]:
    """Download-free structural check plus a full CRC check via a scratch download."""
    _, manifests = read_remote_step(s3, uri, step)
    total = sum(f.size for m in manifests.values() for f in m.files)
    with bar(total, step_name(step)) as advance:
        return _verify_files(s3, uri, step, scratch, manifests, advance)


def _verify_files(s3: S3, uri: S3Uri, step: int, scratch: Path,
                  manifests: dict[int, Manifest], advance: Advance) -> list[str]:
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
                crc = s3.download_fd(uri.bucket, uri.join(step_name(step), rel), f.size, fd,
                                     advance)
            finally:
                os.close(fd)
                os.unlink(path)
            if crc != f.crc32c:
                problems.append(f"{rel}: crc32c {crc} in S3, manifest says {f.crc32c}")
    return problems
