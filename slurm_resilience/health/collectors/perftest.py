"""GPUDirect RDMA loopback bandwidth per HCA: perftest's ``ib_write_bw``, server and
client on this host, GPU memory on both ends (``--use_cuda=<gpu>``) when GPUs exist.

``ib_write_bw`` prints its settings, then one table::

     #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
     8388608    5000             371.82             371.80               0.005540

The unit is ``Gb/sec`` with ``--report_gbits`` (always passed here), ``MB/sec`` in
older releases and ``MiB/sec`` in newer ones otherwise; warnings such as ``Conflicting
CPU frequency values detected`` may sit between the header and the row, and the CUDA
build adds its own lines (``allocating GPU buffer``...). All are read here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.proc import CommandError, Completed, Runner

TOOL = "ib_write_bw"
_HEADER = re.compile(r"#bytes\s+#iterations\s+BW peak\[(Gb|MB|MiB)/sec\]\s+"
                     r"BW average\[(?:Gb|MB|MiB)/sec\]")
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)(?:\s+[\d.]+)?\s*$")
# One unit of the table in Gb/s.
_TO_GBPS = {"Gb": 1.0, "MB": 8e-3, "MiB": 8 * 1.048576e-3}
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")
CONNECT_RETRY_S = 0.2  # the client asks again until the server listens


class PerftestParseError(ValueError):
    """Text without an ``ib_write_bw`` result table."""


@dataclass
class HcaBandwidth:
    hca: str
    link_gbps: float | None  # the port's rate from sysfs (picks the threshold)
    gpu: int | None  # the GPU whose memory was used; None: host memory
    gbps: float | None = None  # BW average; None when the test did not finish
    error: str | None = None


@dataclass
class PerftestSnapshot:
    installed: bool = True
    results: list[HcaBandwidth] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PerftestSnapshot:
        return cls(bool(d.get("installed", True)),
                   [HcaBandwidth(**r) for r in d.get("results", [])])


def parse_bw(text: str) -> float:
    """BW average of the largest message size in the table, in Gb/s."""
    unit = None
    best: tuple[int, float] | None = None
    for line in text.splitlines():
        header = _HEADER.search(line)
        if header:
            unit = header.group(1)
            continue
        row = _ROW.match(line) if unit else None
        if row and unit and (best is None or int(row.group(1)) >= best[0]):
            best = (int(row.group(1)), float(row.group(4)) * _TO_GBPS[unit])
    if best is None:
        raise PerftestParseError("no ib_write_bw result table")
    return round(best[1], 2)


def link_gbps(rate: str | None) -> float | None:
    """``400 Gb/sec (4X NDR)`` → 400.0."""
    m = _RATE.match(rate or "")
    return float(m.group(1)) if m else None


def _hcas(root: str) -> list[tuple[str, float | None]]:
    out = []
    for hca in sorted(os.listdir(root)):
        try:
            with open(os.path.join(root, hca, "ports", "1", "rate"), encoding="ascii") as fh:
                rate = fh.read(128)
        except OSError:
            rate = None
        out.append((hca, link_gbps(rate)))
    return out


def gpu_count(dev: str = "/dev") -> int:
    """GPUs by their device nodes (``/dev/nvidia0``...): no driver call."""
    try:
        return sum(1 for n in os.listdir(dev) if re.fullmatch(r"nvidia\d+", n))
    except OSError:
        return 0


def _tail(done: Completed) -> str:
    return ((done.stderr or done.stdout).strip().splitlines() or [""])[-1][:200]


def _one(hca: str, gpu: int | None, port: int, args: list[str], timeout: float,
         runner: Runner) -> tuple[float | None, str | None]:
    """One loopback pair. Both ends stay in the caller's process group (no session of
    their own), so whoever stops the caller's group stops them too (the idle runner's
    hand-off); each is bounded by ``timeout``, and the server ends with its client."""
    base = [TOOL, "-d", hca, "-p", str(port), "--report_gbits", *args]
    if gpu is not None:
        base.append(f"--use_cuda={gpu}")
    server: dict[str, Completed | str] = {}

    def serve() -> None:
        try:
            server["done"] = runner.run(base, timeout=timeout, check=False)
        except CommandError as exc:
            server["error"] = str(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    result: tuple[float | None, str | None] = (None, None)
    last = "no answer"
    while result == (None, None) and time.monotonic() < deadline and thread.is_alive():
        try:
            done = runner.run([*base, "localhost"], check=False,
                              timeout=max(deadline - time.monotonic(), 0.1))
        except CommandError as exc:
            result = (None, str(exc))
            break
        try:
            result = (parse_bw(done.stdout), None)
        except PerftestParseError:
            last = _tail(done)
            time.sleep(CONNECT_RETRY_S)  # the server is not listening yet
    thread.join(max(deadline - time.monotonic(), 0.0) + 1.0)
    if result != (None, None):
        return result
    ended = server.get("done")
    if isinstance(ended, Completed):
        return None, f"server exited {ended.returncode}: {_tail(ended)}"
    return None, str(server.get("error") or f"no result within {timeout:g}s: {last}")


def collect(root: str, *, args: list[str], port: int, timeout: float,
            gpu_by_hca: Mapping[str, int], max_hcas: int = 16, dev: str = "/dev",
            runner: Runner | None = None) -> PerftestSnapshot:
    """Each HCA under ``root`` in turn (they share the PCIe root complexes: one at a
    time measures each one alone)."""
    if shutil.which(TOOL) is None:
        return PerftestSnapshot(installed=False)
    gpus = gpu_count(dev)
    snap = PerftestSnapshot()
    for i, (hca, link) in enumerate(_hcas(root)[:max_hcas]):
        gpu = gpu_by_hca.get(hca, i % gpus if gpus else None)
        gbps, error = _one(hca, gpu, port + i, args, timeout, runner or Runner())
        snap.results.append(HcaBandwidth(hca, link, gpu, gbps, error))
    return snap


def collect_json(root: str, args: list[str], port: int, timeout: float,
                 gpu_by_hca: Mapping[str, int], max_hcas: int) -> dict[str, Any]:
    return collect(root, args=args, port=port, timeout=timeout, gpu_by_hca=gpu_by_hca,
                   max_hcas=max_hcas).to_json()
