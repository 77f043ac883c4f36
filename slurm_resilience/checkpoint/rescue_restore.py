"""A relaunch resumes from the rescue (rescue.py) when it is newer than every committed step.

``latest_step`` folds each node's newest rescue of this run into its first all-reduce.
When one is newer than the newest committed step, every rank loads a rescue of that step
from its own node: the nodes that lack it (a spare that just joined, a node whose rescue
was refused) get one whole from a node that has it, over the checkpoint group's gloo
(point-to-point, each receiving node from one holder, in turn among the holders), verify
it against its manifest, then every rank loads it alone (``no_dist``: the nodes' rescues
are separate saves of the same replicated state). When any node could not get it, every
rank says so and the restore takes the committed step as before: never silent.

Cost at a relaunch: the state once per node that lacks it (a spare: the whole replicated
state, as a regular restore of its ranks' share would be for DDP), sent by a holder.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_resilience.checkpoint.catch_up import this_node
from slurm_resilience.checkpoint.commit import (
    CheckpointError,
    check_relpath,
    step_name,
    verify_step,
)
from slurm_resilience.checkpoint.dcp_state import tensor_view
from slurm_resilience.checkpoint.rescue import newest_of_this_run, rescue_root
from slurm_resilience.log import get_logger

if TYPE_CHECKING:
    from slurm_resilience.checkpoint.manager import CheckpointManager

log = get_logger("checkpoint.rescue")
CHUNK = 16 * 1024 * 1024
MAX_FILES = 16  # a rescue is one part: COMMIT.json, the manifest, the data, .metadata


def local_step(mgr: CheckpointManager) -> int:
    """This node's newest rescue of this run, not rejected by this restore (-1: none)."""
    if mgr._rescue is None:
        return -1
    return newest_of_this_run(rescue_root(mgr.job_dir), mgr._rescue_rejected)


def take(mgr: CheckpointManager, step: int) -> bool:
    """Give every node a verified rescue of ``step``; True when every rank can load it.
    A collective: every rank calls it with the same step."""
    import torch.distributed as dist

    root = rescue_root(mgr.job_dir)
    if mgr.group is None:  # one process: its own node's rescue or none
        return local_step(mgr) == step
    node = this_node()
    has = local_step(mgr) == step
    views: list[Any] = [None] * mgr.world_size
    dist.all_gather_object(views, (node, has), group=mgr.group)
    holders = [r for r, (_, h) in enumerate(views) if h]
    lacking = sorted({n for n, h in views if not h})
    receivers = [min(r for r, (n, _) in enumerate(views) if n == lack) for lack in lacking]
    error = ""
    for i, receiver in enumerate(receivers):
        sender = holders[i % len(holders)]
        try:
            if mgr.rank == sender:
                _send(mgr, root, step, receiver)
            elif mgr.rank == receiver:
                _receive(mgr, root, step, sender)
        except (CheckpointError, OSError, RuntimeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("rescue transfer failed", step=step, sender=sender,
                        receiver=receiver, error=error)
    outcomes: list[Any] = [None] * mgr.world_size
    dist.all_gather_object(outcomes, (node, error), group=mgr.group)
    failed = "; ".join(sorted({f"{n}: {e}" for n, e in outcomes if e}))
    if failed:
        mgr._rescue_rejected.add(step)
        if mgr.rank == 0:
            print(f"checkpoint: load: WARNING: the rescue of step {step} (saved at the fault) "
                  f"couldn't be given to every node ({failed}); resuming from the newest "
                  "committed step instead", file=sys.stderr, flush=True)
        return False
    if mgr.rank == 0:
        print(f"checkpoint: load: resuming from step {step}, saved at the fault by "
              f"{len(holders)} rank(s); sent to {', '.join(lacking) or 'no node'}",
              file=sys.stderr, flush=True)
    log.info("resuming from the rescue", step=step, holders=len(holders),
             sent_to=lacking, rank=mgr.rank)
    return True


def _files(step_dir: Path) -> list[tuple[str, int]]:
    out = []
    for dirpath, _dirs, names in os.walk(step_dir, followlinks=False):
        for name in names:
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                raise CheckpointError(f"checkpoint: rescue: {full} is not a regular file")
            out.append((str(full.relative_to(step_dir)), full.stat().st_size))
    return sorted(out)


def _send(mgr: CheckpointManager, root: Path, step: int, to: int) -> None:
    import torch
    import torch.distributed as dist

    step_dir = root / step_name(step)
    files = _files(step_dir)
    header = json.dumps(files).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64), to, group=mgr.group)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), to, group=mgr.group)
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    for rel, size in files:
        with open(step_dir / rel, "rb", buffering=0) as fh:
            left = size
            while left:
                n = min(left, CHUNK)
                view = buf[:n]
                got = fh.readinto(tensor_view(view, "rescue send"))
                if got != n:
                    raise CheckpointError(f"checkpoint: rescue: {step_dir / rel} shrank "
                                          "while it was sent")
                dist.send(view, to, group=mgr.group)
                left -= n


def _receive(mgr: CheckpointManager, root: Path, step: int, sender: int) -> None:
    import torch
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, sender, group=mgr.group)
    if not 0 < int(n) <= 1 << 20:
        raise CheckpointError(f"checkpoint: rescue: a header of {int(n)} bytes")
    raw = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(raw, sender, group=mgr.group)
    files = [(check_relpath(str(rel)), int(size)) for rel, size in json.loads(bytes(raw.numpy()))]
    if not files or len(files) > MAX_FILES or any(size < 0 for _, size in files):
        raise CheckpointError(f"checkpoint: rescue: {len(files)} files in a rescue")
    root.mkdir(mode=0o700, exist_ok=True)
    tmp = root / f".received-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    target = tmp / step_name(step)
    target.mkdir(mode=0o700, parents=True)
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    try:
        for rel, size in files:
            path = target / rel
            path.parent.mkdir(mode=0o700, exist_ok=True, parents=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                left = size
                while left:
                    k = min(left, CHUNK)
                    view = buf[:k]
                    dist.recv(view, sender, group=mgr.group)
                    mv = tensor_view(view, "rescue receive")
                    while mv:
                        mv = mv[os.write(fd, mv):]
                    left -= k
                os.fsync(fd)
            finally:
                os.close(fd)
        marker = verify_step(tmp, step, ranks=[0])  # every file against its manifest's CRC32C
        if marker.world_size != 1:
            raise CheckpointError(f"checkpoint: rescue: the received step {step} was saved "
                                  f"at world size {marker.world_size}, not by one rank")
        final = root / step_name(step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(target, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["local_step", "take"]
