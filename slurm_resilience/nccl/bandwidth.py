"""Bus bandwidth of an all_reduce and its comparison with a threshold (pure).

nccl-tests defines, for all_reduce over ``n`` ranks of ``size`` bytes taking
``t`` seconds: algbw = size / t, busbw = algbw x 2(n-1)/n. busbw is what the
slowest link of a ring moves, so it can be compared with hardware figures and
does not depend on n. GB/s are 10^9 bytes per second, as in nccl-tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slurm_resilience.config.nccl import NcclThreshold

GB = 1e9


def bus_factor(ranks: int) -> float:
    """2(n-1)/n: the share of the buffer each rank sends and receives in a ring all_reduce."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    return 2.0 * (ranks - 1) / ranks


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: bytes of the buffer per second of one all_reduce."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return size_bytes / seconds / GB


def busbw_gbps(size_bytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth in GB/s: 2(n-1)/n x bytes / time."""
    return algbw_gbps(size_bytes, seconds) * bus_factor(ranks)


def fmt_gbps(value: float) -> str:
    """Short and readable: 212, 47.3, 0.812."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def fmt_size(size: int) -> str:
    """16GiB, 256MiB, 1.5MiB, 100B."""
    for unit, scale in _UNITS:
        if size >= scale:
            value = size / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{size}B"


def model_matches(pattern: str, name: str) -> bool:
    """``H100`` matches ``NVIDIA H100 80GB HBM3`` but not ``GH100``, nor a PCIe/NVL board
    (``NVIDIA H100 PCIe``, ``NVIDIA H200 NVL``) unless the pattern names it; case-insensitive."""
    from slurm_resilience import gpu_models

    return gpu_models.matches(pattern, name)


def pick_threshold(thresholds: Iterable[NcclThreshold], model: str, ranks: int, variant: str
                   ) -> NcclThreshold | None:
    """The configured figure for this model, rank count and variant; None when there is none."""
    for t in thresholds:
        if t.gpus == ranks and t.variant == variant and model_matches(t.model, model):
            return t
    return None


@dataclass(frozen=True)
class Measurement:
    """The slowest rank's time for one size."""

    size: int
    seconds: float
    ranks: int

    @property
    def algbw(self) -> float:
        return algbw_gbps(self.size, self.seconds)

    @property
    def busbw(self) -> float:
        return busbw_gbps(self.size, self.seconds, self.ranks)


def slowest(per_rank_seconds: Sequence[float]) -> float:
    """A collective is as fast as its slowest rank."""
    if not per_rank_seconds:
        raise ValueError("no rank reported a time")
    return max(per_rank_seconds)


def measurement_for(measurements: Sequence[Measurement], size: int) -> Measurement:
    """The measurement at ``size``, else at the largest size run (the closest to peak)."""
    if not measurements:
        raise ValueError("no measurements")
    for m in measurements:
        if m.size == size:
            return m
    return max(measurements, key=lambda m: m.size)


@dataclass(frozen=True)
class BandwidthVerdict:
    ok: bool
    measured_gbps: float
    expected_gbps: float
    size: int
    reason: str


def compare(measurements: Sequence[Measurement], threshold: NcclThreshold, variant: str
            ) -> BandwidthVerdict:
    """Measured against expected, with a drain reason such as
    ``nccl allreduce 212 GB/s < 460 (8xH100, 16GiB)``."""
    m = measurement_for(measurements, threshold.size)
    busbw = m.busbw
    ok = busbw >= threshold.min_busbw_gbps
    what = "nccl allreduce" if variant == "intra-node" else f"nccl {variant} allreduce"
    op = ">=" if ok else "<"
    reason = (f"{what} {fmt_gbps(busbw)} GB/s {op} {threshold.min_busbw_gbps:g} "
              f"({threshold.gpus}x{threshold.model}, {fmt_size(m.size)})")
    return BandwidthVerdict(ok, busbw, threshold.min_busbw_gbps, m.size, reason)


# -- nccl-tests output, to check the formula against real runs ------------------------------

_ROW = re.compile(
    r"^\s*(?P<size>\d+)\s+(?P<count>\d+)\s+(?P<type>\w+)\s+(?P<redop>\w+)\s+(?P<root>-?\d+)"
    r"\s+(?P<t1>[\d.]+)\s+(?P<alg1>[\d.]+)\s+(?P<bus1>[\d.]+)\s+(?P<wrong1>\S+)"
    r"\s+(?P<t2>[\d.]+)\s+(?P<alg2>[\d.]+)\s+(?P<bus2>[\d.]+)\s+(?P<wrong2>\S+)\s*$"
)
_MPI_TAG = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")


@dataclass(frozen=True)
class PerfRow:
    """One row of ``all_reduce_perf``: out-of-place time (us), algbw and busbw (GB/s)."""

    size: int
    time_us: float
    algbw: float
    busbw: float
    in_time_us: float
    in_algbw: float
    in_busbw: float


def parse_all_reduce_perf(text: str) -> list[PerfRow]:
    """Rows of an nccl-tests ``all_reduce_perf`` run (Open MPI output tags allowed)."""
    rows = []
    for raw in text.splitlines():
        line = _MPI_TAG.sub("", raw)
        if line.lstrip().startswith("#"):
            continue
        m = _ROW.match(line)
        if m:
            rows.append(PerfRow(int(m["size"]), float(m["t1"]), float(m["alg1"]), float(m["bus1"]),
                                float(m["t2"]), float(m["alg2"]), float(m["bus2"])))
    return rows


def parse_rank_count(text: str) -> int | None:
    """Ranks listed under ``# Using devices``; None when the header is missing."""
    ranks = re.findall(r"^#\s+Rank\s+(\d+)\s", text, re.MULTILINE)
    return len(ranks) if ranks else None
