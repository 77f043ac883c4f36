"""One rank of the all_reduce test: ``python -m slurm_resilience.nccl.worker ...``.

Started by :mod:`slurm_resilience.nccl.launcher`, one per local GPU (nccl) or
per requested process (gloo). This is the only module that imports torch, and
only inside :func:`main`, so the prolog never pays for it unless it runs the test.

For every size the rank fills a float32 buffer with ``((i % 251) + 1) * (rank + 1)``,
all_reduces it once and compares every element with the exact sum
``((i % 251) + 1) * n(n+1)/2`` (small integers: exact in float32, so any
difference is corruption, not rounding), then times ``iters`` all_reduces after
``warmup`` untimed ones. It prints one JSON object on stdout and exits 0; a
failure prints ``{"error": ..., "phase": ...}`` and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from slurm_resilience.nccl import faults

PATTERN = 251
# Elements built or checked at once: bounds the extra memory of a 16 GiB test to 512 MiB.
CHUNK = 64 * 1024 * 1024
EXIT_ERROR = 1
EXIT_ORPHANED = 97


def expected_factor(ranks: int) -> int:
    """Sum over ranks of (rank + 1)."""
    return ranks * (ranks + 1) // 2


def gpu_label(backend: str, local_rank: int, visible: str | None) -> str:
    """How findings name this rank: the physical GPU index for nccl, the rank for gloo."""
    if backend != "nccl":
        return f"rank{local_rank}"
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if local_rank < len(ids) and ids[local_rank].isdigit():
            return f"gpu{ids[local_rank]}"
    return f"gpu{local_rank}"


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="slurm_resilience.nccl.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--store", required=True, help="rendezvous file (FileStore)")
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--deadline-s", type=float, required=True,
                   help="exit on our own after this long, should the launcher be gone")
    p.add_argument("--fault-file", default="")
    p.add_argument("--nice", type=int, default=0)
    return p.parse_args(argv)


def _watch_parent(deadline_s: float) -> None:
    """Never outlive the launcher: exit when it is gone or the deadline has passed."""
    parent = os.getppid()
    end = time.monotonic() + deadline_s

    def loop() -> None:
        while True:
            if os.getppid() != parent or time.monotonic() > end:
                os._exit(EXIT_ORPHANED)
            time.sleep(0.2)

    threading.Thread(target=loop, name="watch-parent", daemon=True).start()


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hang_forever() -> None:
    while True:
        time.sleep(3600)


def run(args: argparse.Namespace, where: dict[str, str]) -> dict[str, Any]:
    """Everything after argument parsing; ``where["phase"]`` says how far it got."""
    where["phase"] = "fault"
    fault = faults.read(args.fault_file)
    mine = fault if fault is not None and fault.applies_to(args.rank) else None
    where["phase"] = "import"
    import torch
    import torch.distributed as dist

    where["phase"] = "setup"
    sizes = [int(s) for s in args.sizes.split(",") if s]
    n, rank = args.world, args.rank
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    info: dict[str, Any] = {
        "rank": rank, "world": n, "backend": args.backend,
        "label": gpu_label(args.backend, rank, visible), "pid": os.getpid(),
        "torch": torch.__version__,
    }
    if args.backend == "nccl":
        if torch.version.cuda is None or not dist.is_nccl_available():
            # A CPU-only torch is an installation problem, not a sick node: "could not check".
            where["phase"] = "import"
            raise RuntimeError(f"torch {torch.__version__} has no CUDA/NCCL support")
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available to torch")
        if torch.cuda.device_count() <= rank:
            raise RuntimeError(f"rank {rank} has no GPU: torch sees {torch.cuda.device_count()}")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        info["device_name"] = torch.cuda.get_device_name(rank)
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        # A tuple (2, 21, 5) in current torch, an int (2708) in old ones.
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    else:
        device = torch.device("cpu")
        info["device_name"] = "cpu"

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    where["phase"] = "init"
    dist.init_process_group(
        args.backend, init_method=f"file://{args.store}", rank=rank, world_size=n,
        timeout=datetime.timedelta(seconds=max(args.deadline_s, 1.0)),
    )
    try:
        results = []
        for size in sizes:
            where["phase"] = f"allreduce {size}B"
            count = max(size // 4, 1)
            buf = torch.empty(count, dtype=torch.float32, device=device)
            for start in range(0, count, CHUNK):
                end = min(start + CHUNK, count)
                idx = torch.arange(start, end, device=device, dtype=torch.int64)
                buf[start:end] = ((idx % PATTERN) + 1).to(torch.float32) * (rank + 1)
            if mine is not None and mine.kind == "hang":
                _hang_forever()
            dist.all_reduce(buf)
            sync()
            if mine is not None and mine.kind == "wrong":
                buf[count // 2] += 1.0
            mismatches = 0
            first_bad = -1
            factor = float(expected_factor(n))
            for start in range(0, count, CHUNK):
                end = min(start + CHUNK, count)
                idx = torch.arange(start, end, device=device, dtype=torch.int64)
                want = ((idx % PATTERN) + 1).to(torch.float32) * factor
                bad = buf[start:end] != want
                nbad = int(bad.sum().item())
                if nbad and first_bad < 0:
                    first_bad = start + int(bad.nonzero()[0].item())
                mismatches += nbad
            for _ in range(args.warmup):
                dist.all_reduce(buf)
            sync()
            # NCCL's barrier must be told the device, or it guesses one per rank.
            dist.barrier(device_ids=[rank] if device.type == "cuda" else None)
            began = time.perf_counter()
            for _ in range(args.iters):
                if mine is not None and mine.kind == "slow":
                    time.sleep(mine.delay_s)
                dist.all_reduce(buf)
            sync()
            seconds = (time.perf_counter() - began) / args.iters
            results.append({"size": count * 4, "seconds": seconds, "mismatches": mismatches,
                            "first_bad_index": first_bad})
            del buf
            if device.type == "cuda":
                torch.cuda.empty_cache()
        info["results"] = results
        return info
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    _watch_parent(args.deadline_s)
    if args.nice:
        os.nice(args.nice)
    where = {"phase": "start"}
    try:
        _emit(run(args, where))
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported to the launcher as JSON
        traceback.print_exc(file=sys.stderr)
        _emit({"rank": args.rank, "error": f"{type(exc).__name__}: {exc}"[:2000],
               "phase": where["phase"], "pid": os.getpid()})
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
