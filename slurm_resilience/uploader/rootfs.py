"""Root-side reads of a job's staging dir, all through directory fds (see staging.py)."""

from __future__ import annotations

import os
import stat

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    CommitMarker,
    Manifest,
    check_save_ids,
    file_crc32c,
    parse_rank,
    parse_step,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.dcp_verify import check_manifest
from slurm_resilience.checkpoint.staging import open_dir_at, open_owned_file

SMALL_LIMIT = 16 * 1024 * 1024


def read_small(dir_fd: int, relpath: str, uid: int, limit: int = SMALL_LIMIT) -> bytes:
    fd = open_owned_file(dir_fd, relpath, uid)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"checkpoint: {relpath} is {size} bytes, more than {limit}")
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def _is_dir_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def committed_steps_at(job_fd: int) -> list[int]:
    """Steps of a job dir with a commit marker (a regular file, not a link), oldest first."""
    out = []
    for name in os.listdir(job_fd):
        step = parse_step(name)
        if step is None or not _is_dir_at(job_fd, name):
            continue
        sfd = open_dir_at(job_fd, name)
        try:
            st = os.stat(COMMIT, dir_fd=sfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                out.append(step)
        except FileNotFoundError:
            continue
        finally:
            os.close(sfd)
    return sorted(out)


def local_ranks_at(step_fd: int) -> list[int]:
    out = []
    for name in os.listdir(step_fd):
        rank = parse_rank(name)
        if rank is not None and _is_dir_at(step_fd, name):
            out.append(rank)
    return sorted(out)


def read_step(job_fd: int, step: int, uid: int) -> tuple[CommitMarker, dict[int, Manifest]]:
    """The marker and the manifests of the ranks committed on this node."""
    sfd = open_dir_at(job_fd, step_name(step))
    try:
        marker = CommitMarker.from_json(read_small(sfd, COMMIT, uid), f"{step_name(step)}/{COMMIT}")
        if marker.step != step:
            raise CheckpointError(f"checkpoint: {step_name(step)}: marker says step {marker.step}")
        manifests = {}
        for rank in local_ranks_at(sfd):
            rel = f"{rank_name(rank)}/{MANIFEST}"
            m = Manifest.from_json(read_small(sfd, rel, uid), f"{step_name(step)}/{rel}")
            if m.step != step or m.rank != rank:
                raise CheckpointError(f"checkpoint: {step_name(step)}/{rel}: manifest says step "
                                      f"{m.step} rank {m.rank}")
            manifests[rank] = check_manifest(m, f"{step_name(step)}/{rank_name(rank)}")
        return marker, manifests
    finally:
        os.close(sfd)


def verify_step_at(job_fd: int, step: int, uid: int, need_all: bool = False) -> CommitMarker:
    """Every local rank part verifies (and, with need_all, every rank is present)."""
    marker, manifests = read_step(job_fd, step, uid)
    if need_all and set(manifests) != set(range(marker.world_size)):
        raise CheckpointError(f"checkpoint: {step_name(step)}: has ranks {sorted(manifests)}, "
                              f"expected 0..{marker.world_size - 1}")
    if not manifests:
        raise CheckpointError(f"checkpoint: {step_name(step)}: no rank parts on this node")
    check_save_ids(step, marker, manifests)
    sfd = open_dir_at(job_fd, step_name(step))
    try:
        for rank, m in manifests.items():
            for f in m.files:
                fd = open_owned_file(sfd, f"{rank_name(rank)}/{f.path}", uid)
                try:
                    size, crc = file_crc32c(fd)
                finally:
                    os.close(fd)
                if (size, crc) != (f.size, f.crc32c):
                    raise CheckpointError(
                        f"checkpoint: {step_name(step)}/{rank_name(rank)}/{f.path}: size {size} "
                        f"crc32c {crc}, expected size {f.size} crc32c {f.crc32c}")
    finally:
        os.close(sfd)
    return marker
