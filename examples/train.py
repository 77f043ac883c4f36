#!/usr/bin/env python3
"""A small, real PyTorch training job that survives crashes, hangs and requeues.

Copy it as a starting point. It trains an MLP with DDP (gloo on CPU, NCCL works the
same on GPUs) and uses:

* ``slurm_resilience.checkpoint.CheckpointManager`` on torch.distributed.checkpoint:
  ``save()`` stalls only for a host-memory snapshot; the node agent syncs committed
  steps to S3, and on a restart (requeue, or a new job with the same
  ``SLURM_RESILIENCE_CKPT_URI``, at any world size) ``load_latest(model=...,
  optimizer=..., scheduler=...)`` restores the newest committed step into the model,
  the optimizer (its moments and learning rate) and the LR scheduler;
* ``slurm_resilience.heartbeat``: one ``beat(step)`` per iteration and a
  ``section("checkpoint")`` around saves, so the agent can tell a hang from a
  slow phase;
* with ``SLURM_RESILIENCE_CKPT_RESCUE=on`` in the job's environment, the last finished
  step is saved at a fault (a hang, a peer's death) and a relaunch under
  ``slurm-resilience launch`` resumes from it: ``beat(step)`` comes after the optimizer's
  and scheduler's steps, as below;
* ``ckpt.stop_requested(step)`` at each step boundary: warned ahead of the time limit
  (or preempted), every rank saves the same step with ``ckpt.stop(...)`` and the job is
  requeued, resuming from that step.

Run it under srun, e.g.::

    export SLURM_RESILIENCE_CKPT_URI=s3://ckpt/$USER/my-run
    sbatch -N2 --requeue --open-mode=append --wrap \
        "srun --kill-on-bad-exit=1 python examples/train.py --steps 100 --ckpt-every 5"

Fault flags (``--crash-at-step``, ``--hang-at-step``) fire only on the first run
(``SLURM_RESILIENCE_RESTART_COUNT``, else ``SLURM_RESTART_COUNT``, unset or 0) unless
``--fault-every-run`` is given, so a requeued or relaunched job can finish. The last
line is ``done step=N resumed_from=M restarts=R at=T``;
the ``at=`` stamps (Unix time) let a test check the goodput breakdown against the job's
own clock.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
import zlib

STARTED = time.time()  # before torch's import: a restart's figures split start-up from restore

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from slurm_resilience import heartbeat  # noqa: E402
from slurm_resilience.checkpoint import CheckpointManager  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="train until this step")
    p.add_argument("--ckpt-every", type=int, default=5, help="checkpoint every K steps")
    p.add_argument("--state-mb", type=float, default=4.0,
                   help="size of model + optimizer state in MB (per rank)")
    p.add_argument("--step-seconds", type=float, default=0.1,
                   help="extra time per step, standing in for real compute")
    p.add_argument("--crash-at-step", type=int, default=-1, help="all ranks exit(17) at step S")
    p.add_argument("--hang-at-step", type=int, default=-1, help="stop making progress at step S")
    p.add_argument("--hang-after", type=int, default=-1,
                   help="hang this many steps after the step resumed from")
    p.add_argument("--hang-rank", type=int, default=0, help="the rank that hangs")
    p.add_argument("--hang-on-file", default="",
                   help="hang at the first step after this file exists (a test's trigger)")
    p.add_argument("--checkpoint-seconds", type=float, default=0.0,
                   help="make the first checkpoint section last this long (a slow save)")
    p.add_argument("--fault-every-run", action="store_true",
                   help="fire fault flags on requeued runs too")
    return p.parse_args(argv)


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def init_distributed() -> tuple[int, int]:
    """Rendezvous from Slurm's variables: MASTER_ADDR/MASTER_PORT if set, else the step's
    first node (or loopback when node names do not resolve, as in a one-host sandbox)."""
    rank = _env_int("RANK", "SLURM_PROCID")
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    job = _env_int("SLURM_JOB_ID")
    restarts = _env_int("SLURM_RESTART_COUNT")
    relaunch = _env_int("SLURM_RESILIENCE_RELAUNCH")  # set by slurm-resilience launch
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        addr = "127.0.0.1"
        # The step's first node: a relaunched step may have left the job's first node.
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get(
            "SLURM_JOB_NODELIST", "")
        if nodelist:
            import hostlist

            first = hostlist.expand_hostlist(nodelist)[0]
            try:
                socket.gethostbyname(first)
                addr = first
            except OSError:
                addr = "127.0.0.1"
    # Same on every rank, different per job, run and cluster (sandboxes share one host).
    # Below Linux's ephemeral range (32768 and up by default): a port the kernel handed to
    # some client socket there makes rank 0's store fail with EADDRINUSE.
    seed = f"{os.environ.get('SLURM_CLUSTER_NAME', '')}/{job}/{restarts}/{relaunch}".encode()
    port = int(os.environ.get("MASTER_PORT") or 20000 + zlib.crc32(seed) % 12000)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world)
    return rank, world


def build(state_mb: float, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                              torch.optim.lr_scheduler.LRScheduler]:
    # Two d-by-d layers; Adam keeps two moments, so the state is about 3x the parameters.
    d = max(8, int(math.sqrt(state_mb * 1e6 / (3 * 4 * 2))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rank, _world = init_distributed()
    print(f"rank {rank} started at={STARTED:.3f} distributed_at={time.time():.3f}", flush=True)
    # Requeues plus relaunches inside the allocation (slurm-resilience launch sets it).
    restarts = _env_int("SLURM_RESILIENCE_RESTART_COUNT", "SLURM_RESTART_COUNT")
    faulty = restarts == 0 or a.fault_every_run
    model, opt, sched = build(a.state_mb, a.steps)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ckpt = CheckpointManager.from_env()

    # Loaded in place (resharded if the world size changed); waits for stage-in first.
    resumed = ckpt.load_latest(model=ddp, optimizer=opt, scheduler=sched)
    start = resumed.step if resumed is not None else 0
    heartbeat.checkpointed(start)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    print(f"rank {rank} running step={start + 1} at={time.time():.3f} restarts={restarts} "
          f"node={node}", flush=True)
    hang_at = a.hang_at_step if a.hang_at_step >= 0 else (
        start + a.hang_after if a.hang_after >= 0 else -1)
    d = model[0].in_features
    gen = torch.Generator().manual_seed(1234 + rank)

    stopped = False
    for step in range(start + 1, a.steps + 1):
        if faulty and step == a.crash_at_step:
            print(f"rank {rank} crashing at step={step}", flush=True)
            os._exit(17)
        triggered = bool(a.hang_on_file) and os.path.exists(a.hang_on_file)
        if faulty and (step == hang_at or triggered) and rank == a.hang_rank:
            print(f"rank {rank} hanging at step={step} at={time.time():.3f}", flush=True)
            while True:  # no progress, like a rank stuck in a dead collective
                time.sleep(3600)
        # -- one training step ----------------------------------------------------------
        x = torch.randn(32, d, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x.flip(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        time.sleep(a.step_seconds)
        heartbeat.beat(step)
        # -- warned ahead of the time limit, or preempted: save this step and stop ---------
        stop = ckpt.stop_requested(step)  # the same answer on every rank
        if stop is not None:
            said = ckpt.stop(step, stop, model=ddp, optimizer=opt, scheduler=sched)
            if rank == 0:
                print(f"stopped step={step} cause={stop.cause} at={time.time():.3f}: {said}",
                      flush=True)
            stopped = True
            break
        # -- checkpoint -------------------------------------------------------------------
        if step % a.ckpt_every == 0:
            with heartbeat.section("checkpoint"):
                t0 = time.perf_counter()
                ckpt.save(step, model=ddp, optimizer=opt, scheduler=sched)
                stall_ms = (time.perf_counter() - t0) * 1e3
                if a.checkpoint_seconds and step == a.ckpt_every:
                    time.sleep(a.checkpoint_seconds)
            heartbeat.checkpointed(step)
            if rank == 0:
                print(f"checkpoint step={step} loss={loss.item():.4f} stall_ms={stall_ms:.1f} "
                      f"at={time.time():.3f}", flush=True)

    ckpt.close()  # the last save is committed before we report done
    if stopped:  # requeued (time limit) or ended by Slurm (preemption): nothing more to do
        dist.destroy_process_group()
        return 0
    heartbeat.done()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done step={a.steps} resumed_from={start} restarts={restarts} "
              f"at={time.time():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
