"""Rank processes for the no-dead-ends tests: ranks that disagree on the newest step, and a
save() that only some ranks call. Real gloo on CPU, run by ``dcp_ranks.run_ranks``."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from dcp_ranks import _dshard

from slurm_resilience.checkpoint.commit import committed_steps
from slurm_resilience.checkpoint.manager import CheckpointManager


def older_everywhere(rank: int, world: int, job: Path) -> None:
    """Steps 1 and 2 saved whole and copied to each rank's own 'node' dir; rank 1's node
    then lacks step 2's marker (its local leader died before writing it). Step 1 is
    loaded, and a later save(2) replaces node 0's stale step 2."""
    ckpt = CheckpointManager(job)
    for step in (1, 2):
        ckpt.save(step, _dshard(rank, world, float(step)))
    ckpt.close()
    node = job.parent / f"node{rank}"
    shutil.copytree(job, node)
    if rank == 1:
        (node / "step-00000002" / "COMMIT.json").unlink()
    dist.barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        dest = _dshard(rank, world, 0.0)
        got = CheckpointManager(node, local_leader=True).load_latest(dest)
    full = dest["w"].full_tensor()
    assert got is not None and got.step == 1, got
    assert torch.equal(full, torch.full_like(full, 1.0)), full
    (job.parent / f"stderr-{rank}").write_text(err.getvalue())
    with contextlib.redirect_stderr(err):  # training goes on: step 2 again, over node0's
        ckpt = CheckpointManager(node, local_leader=True)
        assert ckpt.load_latest(_dshard(rank, world, 0.0)) is not None
        ckpt.save(2, _dshard(rank, world, 22.0))
        ckpt.close()
    dist.barrier()
    if rank == 1:  # rank 0's part of the new save (with .metadata) reaches node 1 as a
        # stage-in would bring it; the copy node 1 had is the stale save's
        part = "step-00000002/rank-00000"
        shutil.rmtree(node / part)
        shutil.copytree(job.parent / "node0" / part, node / part)
    dist.barrier()
    dest = _dshard(rank, world, 0.0)
    got = CheckpointManager(node, local_leader=True).load_latest(dest)
    assert got is not None and got.step == 2, got
    assert torch.equal(dest["w"].full_tensor(), torch.full_like(full, 22.0))
    print(f"OK {rank} loaded {got.step}", flush=True)


def _own(rank: int, value: float) -> dict[str, torch.Tensor]:
    """A state under a per-rank key (no collective to build it, unlike a DTensor)."""
    return {f"w{rank}": torch.full((10,), value)}


def subset_save(rank: int, world: int, job: Path) -> None:
    """Rank 2 skips save(1): ranks 0 and 1 fail within the arrival deadline naming it;
    rank 2's late save(1) fails at once; then a save(2) of every rank commits."""
    ckpt = CheckpointManager(job, arrival_timeout_s=1.0)
    errors = []
    if rank != 2:
        try:
            ckpt.save(1, _own(rank, 1.0))
        except Exception as exc:  # noqa: BLE001 - the message is what the test compares
            errors.append(str(exc))
    dist.barrier()  # the default group: rank 2 comes to save(1) after the others gave up
    if rank == 2:
        try:
            ckpt.save(1, _own(rank, 1.0))
        except Exception as exc:  # noqa: BLE001 - the message is what the test compares
            errors.append(str(exc))
    (job.parent / f"error-{rank}").write_text("\n".join(errors))
    assert committed_steps(job) == [], committed_steps(job)
    ckpt.save(2, _own(rank, 2.0))  # the group is still in step
    ckpt.close()
    dest = _own(rank, 0.0)
    got = ckpt.load_latest(dest)
    assert got is not None and got.step == 2 and float(dest[f"w{rank}"][0]) == 2.0, got
    print(f"OK {rank}", flush=True)
