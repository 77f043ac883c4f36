"""Configuration of the NCCL loopback gate (``nccl:`` section).

The shipped bandwidth thresholds and their public sources are documented in
``conf/nccl-thresholds.md``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from slurm_resilience.config.loader import ByteSize, setting

Variant = Literal["intra-node", "ib-loopback"]

GIB = 1024**3

# What the IB-loopback variant sets: no shared memory and no peer-to-peer inside
# the node, so NCCL has to move every byte through the node's HCAs (its NET
# transport), and GPUDirect RDMA allowed at any PCIe distance.
IB_LOOPBACK_ENV: Mapping[str, str] = types.MappingProxyType({
    "NCCL_SHM_DISABLE": "1",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_NET_GDR_LEVEL": "SYS",
})


@dataclass(frozen=True)
class NcclThreshold:
    """The least bus bandwidth a node of one GPU model and count must reach."""

    model: str = setting(help="GPU model as in the NVML/driver name, matched as a word "
                              "(H100 matches 'NVIDIA H100 80GB HBM3', not 'NVIDIA H100 PCIe' "
                              "or 'NVIDIA H200 NVL': name the variant, 'H100 PCIe', for "
                              "those); 'cpu' for the gloo backend")
    gpus: int = setting(min=1, max=1024, help="number of local GPUs (ranks) this figure is for")
    min_busbw_gbps: float = setting(min=0, help="least bus bandwidth in GB/s (10^9 bytes/s)")
    size: ByteSize = setting(ByteSize(16 * GIB), help="message size the figure holds at; the "
                                                      "measurement at this size is compared")
    variant: Variant = setting("intra-node", help="intra-node (NVLink/PCIe, NCCL defaults) or "
                                                  "ib-loopback (SHM and P2P off: through the HCAs)")
    source: str = setting("", help="where the figure comes from (for the operator reading it)")


def _default_thresholds() -> tuple[NcclThreshold, ...]:
    # Sources and reasoning: conf/nccl-thresholds.md.
    return (
        NcclThreshold("H100", 8, 460.0, ByteSize(16 * GIB), "intra-node",
                      "nccl-tests all_reduce_perf on 8xH100 SXM (NVLS): ~480 GB/s peak"),
        NcclThreshold("H200", 8, 431.0, ByteSize(16 * GIB), "intra-node",
                      "Azure aznhc nd96isr_h200_v5.conf: check_nccl_allreduce 431.0 at 16G"),
        NcclThreshold("A100", 8, 228.0, ByteSize(8 * GIB), "intra-node",
                      "nccl-tests all_reduce_perf on 8xA100 SXM4 (NVLink3): ~230 GB/s"),
        NcclThreshold("B200", 8, 600.0, ByteSize(16 * GIB), "intra-node",
                      "no public nccl-tests figure found; set low (2/3 of NVLink5's 900 GB/s "
                      "per direction): catches a broken fabric, not one slow link"),
        NcclThreshold("GB200", 4, 600.0, ByteSize(16 * GIB), "intra-node",
                      "no public nccl-tests figure for one 4-GPU GB200 tray found; set low "
                      "as for B200"),
    )


@dataclass(frozen=True)
class NcclSection:
    """Active all-reduce test of the node's GPUs (and, in ib-loopback, its HCAs)."""

    enabled: bool = setting(False, help="run the NCCL gate at all (prolog, epilog, idle)")
    backend: Literal["nccl", "gloo"] = setting(
        "nccl", help="nccl on GPU nodes; gloo runs the same orchestration on CPUs (sandbox, CI)"
    )
    processes: int = setting(
        0, min=0, max=1024,
        help="ranks to start; 0: one per local GPU (counted from /proc/driver/nvidia/gpus)",
    )
    gpu_model: str = setting(
        "", help="model to pick thresholds by; empty: read from the driver (gloo: 'cpu')"
    )
    sizes: tuple[ByteSize, ...] = setting(
        default_factory=lambda: (ByteSize(256 * 1024**2), ByteSize(GIB), ByteSize(16 * GIB)),
        help="all_reduce message sizes in bytes; the top one must reach peak bandwidth "
             "(8-16 GiB on 8-GPU nodes)",
    )
    warmup_iters: int = setting(5, min=0, max=1000, help="untimed all_reduces per size")
    iters: int = setting(20, min=1, max=10000, help="timed all_reduces per size")
    variants: tuple[Variant, ...] = setting(
        default_factory=lambda: ("intra-node",),
        help="which tests to run: intra-node, ib-loopback, or both",
    )
    ib_loopback_env: dict[str, str] = setting(
        default_factory=lambda: dict(IB_LOOPBACK_ENV),
        help="environment of the ib-loopback variant (NCCL_SHM_DISABLE, NCCL_P2P_DISABLE, "
             "NCCL_NET_GDR_LEVEL ...)",
    )
    extra_env: dict[str, str] = setting(
        default_factory=dict,
        help="environment added to every rank (e.g. NCCL_DEBUG: WARN, LD_LIBRARY_PATH for a "
             "NCCL net plugin); from the caller the ranks get only PATH, locale, HOME, "
             "TMPDIR and NCCL_*",
    )
    thresholds: tuple[NcclThreshold, ...] = setting(
        default_factory=_default_thresholds,
        help="least bus bandwidth per GPU model, count, size and variant",
    )
    timeout_s: float = setting(
        120.0, min=1, max=3600, help="hard limit of one attempt; a hang past it is a failure"
    )
    retries: int = setting(1, min=0, max=5, help="attempts after a failed one before failing")
    python: str = setting("", help="interpreter for the ranks; empty: the one running us")
    nice: int = setting(10, min=0, max=19, help="niceness of the ranks in idle verification")
    validity_s: float = setting(
        86400.0, min=0, help="a passing result is trusted this long; then the next chance re-tests"
    )
    prolog: bool = setting(
        True, help="let the prolog run the test (whole-node jobs only, when the result is "
                   "stale, the node just came back, or the job asks)"
    )
    prolog_always: bool = setting(
        False, help="every whole-node job asks for the test, as with SLURM_RESILIENCE_NCCL_TEST=1"
    )
    epilog: bool = setting(False, help="run a stale test in the epilog of whole-node jobs")
    idle_verify: bool = setting(
        True, help="the periodic health run starts the test on an idle node in the background"
    )
    idle_interval_s: float = setting(
        3600.0, min=1, help="idle verification re-tests an idle node this often"
    )
    handoff_timeout_s: float = setting(
        5.0, min=0.1, max=60,
        help="how long an arriving job waits for idle verification to stop and free the node",
    )
    fault_file: str = setting(
        "", help="fault injection file read by the ranks (sandbox/tests only; {node} allowed); "
                 "empty: none"
    )

    def validate(self) -> None:
        if not self.sizes:
            raise ValueError("sizes must list at least one message size")
        if any(s <= 0 for s in self.sizes):
            raise ValueError("sizes must be positive")
        if not self.variants:
            raise ValueError("variants must name at least one test")
        if self.backend == "gloo" and "ib-loopback" in self.variants:
            raise ValueError("variant ib-loopback needs backend nccl (gloo has no HCA path)")
