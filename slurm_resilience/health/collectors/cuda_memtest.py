"""A small GPU memory and bandwidth test in torch, for nodes without DCGM.

Per GPU: write a pattern over a block of HBM and read it back (a stuck or flipping
cell shows as mismatches), time device-to-device copies (HBM bandwidth), and
host-to-device / device-to-host copies from pinned memory (the PCIe or C2C path, as
nvbandwidth measures it). It runs only where torch sees CUDA; elsewhere it says why.
torch is imported here alone, never on the prolog path.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GpuMemtest:
    index: int
    name: str
    bytes_tested: int
    mismatches: int
    hbm_gbps: float  # read + write traffic of a device-to-device copy, 10^9 B/s
    h2d_gbps: float
    d2h_gbps: float


@dataclass
class MemtestReport:
    gpus: list[GpuMemtest] = field(default_factory=list)
    unavailable: str | None = None  # why the test could not run here


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _one(torch: Any, index: int, nbytes: int, iters: int) -> GpuMemtest:
    dev = torch.device("cuda", index)
    n = nbytes // 4
    with torch.cuda.device(dev):
        pattern = torch.arange(n, dtype=torch.int32, device=dev) ^ 0x5A5A5A5A
        copy = torch.empty_like(pattern)
        copy.copy_(pattern)
        torch.cuda.synchronize(dev)
        mismatches = int((copy != pattern).sum().item())
        start = time.perf_counter()
        for _ in range(iters):
            copy.copy_(pattern)
        torch.cuda.synchronize(dev)
        hbm = _gbps(2 * nbytes * iters, time.perf_counter() - start)
        host = torch.empty(n, dtype=torch.int32, pin_memory=True)
        start = time.perf_counter()
        for _ in range(iters):
            copy.copy_(host, non_blocking=True)
        torch.cuda.synchronize(dev)
        h2d = _gbps(nbytes * iters, time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(iters):
            host.copy_(copy, non_blocking=True)
        torch.cuda.synchronize(dev)
        d2h = _gbps(nbytes * iters, time.perf_counter() - start)
        name = str(torch.cuda.get_device_name(dev))
        del pattern, copy, host
        torch.cuda.empty_cache()
    return GpuMemtest(index, name, nbytes, mismatches, hbm, h2d, d2h)


def collect(nbytes: int, iters: int) -> MemtestReport:
    try:
        import torch
    except ImportError as exc:
        return MemtestReport(unavailable=f"torch not installed ({exc})")
    if not torch.cuda.is_available():
        return MemtestReport(unavailable="torch sees no CUDA device "
                                         "(torch.cuda.is_available() is False)")
    report = MemtestReport()
    for index in range(torch.cuda.device_count()):
        report.gpus.append(_one(torch, index, nbytes, iters))
    return report


def to_json(report: MemtestReport) -> dict[str, Any]:
    return dataclasses.asdict(report)


def from_json(d: dict[str, Any]) -> MemtestReport:
    return MemtestReport([GpuMemtest(**g) for g in d.get("gpus", [])], d.get("unavailable"))
