"""save()'s arrival check (every rank calls save, or all that did fail fast) against the
collective that save() already starts with, measured in the same run on the same ranks.

Each rank meets at ``save-N`` through the job's TCPStore (``checkpoint/arrival.py``:
append, add, wait), then runs one gloo all-reduce of two int64 (save()'s first
collective, which the check precedes). Goal: the check costs no more than that
all-reduce costs, i.e. negligible next to a save's stall (hundreds of ms for 1 GiB).
Ranks are local processes on loopback; medians over ``--iters`` saves. Run::

    .venv/bin/python benchmarks/bench_save_arrival.py [--ranks 4 8] [--iters 300]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

from timing import ratio_line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from slurm_resilience.checkpoint.arrival import for_group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(backend="gloo")
    check = for_group(group, rank, world, 30.0, print)
    assert check is not None
    t = torch.zeros(2, dtype=torch.int64)
    meet, reduce = [], []
    for step in range(iters):
        start = time.perf_counter()
        check.meet(f"save-{step}", f"save({step})")
        mid = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        meet.append(mid - start)
        reduce.append(time.perf_counter() - mid)
    out.put((rank, statistics.median(meet), statistics.median(reduce)))
    dist.barrier(group=group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8],
                        help="world sizes to measure (local processes)")
    parser.add_argument("--iters", type=int, default=300, help="saves per world size")
    args = parser.parse_args()
    for world in args.ranks:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args.iters, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        meet = statistics.median(r[1] for r in results)
        reduce = statistics.median(r[2] for r in results)
        print(f"{world} ranks: arrival check p50 {meet * 1e3:.2f} ms, gloo all-reduce p50 "
              f"{reduce * 1e3:.2f} ms (medians over ranks)")
        print(ratio_line(f"{world} ranks: arrival check", meet, reduce, "<= 1x"))


if __name__ == "__main__":
    main()
