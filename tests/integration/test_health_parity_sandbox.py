"""The health-parity fault classes in the real sandbox: each drains its node with a reason
that states measured against expected, and the node comes back once healed. One test, all
nodes at once, sharing the session sandbox."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox

# Round → node → (fault, text its drain reason must hold). A node's reason names its
# first finding only, so faults on one node go in separate rounds.
ROUNDS = [
    {"node1": ("nvlink-errors:2", "gpu2 NVLink "),
     "node2": ("gpu-recovery:1", "gpu1 NVML recovery action DRAIN_AND_RESET (expected NONE)"),
     "node3": ("sram-ecc:0", "gpu0 1 SRAM uncorrectable errors (expected <=0)"),
     "node4": ("fabric-unhealthy", "fabric health UNHEALTHY: degraded bandwidth "
                                   "(expected HEALTHY)")},
    # PCIe counters and the throttle judged as a rate: hw_slowdown fails on the third
    # health check within the hour (throttle_fail_runs, ~30 s at HealthCheckInterval=10).
    {"node1": ("hbm-degraded:3", "gpu3 ECC corrected "),
     "node2": ("pcie-aer:2", "gpu2 PCIe AER nonfatal +1 (expected <=0)"),
     "node3": ("pcie-replay:1", "gpu1 PCIe replays +"),
     "node4": ("gpu-throttle:5:hw_slowdown", "gpu5 HW slowdown in 3 runs within 60min "
                                             "(expected <3)")},
    # Consistency across GPUs and the node's software.
    {"node1": ("gpu-persistence-off:0", "gpu0 persistence mode off (expected on)"),
     "node2": ("gpu-vbios:4", "gpu4 96.00.61.00.01 VBIOS differs from NVIDIA H100 80GB HBM3 "
                              "peers (expected 96.00.74.00.01)"),
     "node3": ("gpu-driver:550.127.05", "driver 550.127.05 (expected 565.*)"),
     "node4": ("peermem-unloaded", "nvidia_peermem not loaded (expected loaded)")},
    # Shared filesystem, NVMe SMART and the Fabric Manager unit.
    {"node1": ("mount-unreachable", "node1/shared unreachable: No such file or directory "
                                    "(expected reachable)"),
     "node2": ("nvme-media-errors", "nvme 7 media errors (expected <=0)"),
     "node3": ("nvme-spare-low", "nvme 10% available spare (expected >=20%)"),
     "node4": ("service-failed:nvidia-fabricmanager",
               "nvidia-fabricmanager failed (expected active)")},
    # The shipped per-GPU-model IB defaults (the sandbox lists no HCAs), and kernel log lines.
    {"node1": ("ib-missing:mlx5_3", "7 InfiniBand HCAs (expected 8 for NVIDIA H100 80GB HBM3)"),
     "node2": ("ib-downtrained:mlx5_5:1", "mlx5_5 port1 200Gb/s (expected >=400Gb/s)"),
     "node3": ("kernel-log:sxid", "fatal x1 in the kernel log (tolerated 0)"),
     "node4": ("kernel-log:nvme-io-error", "nvme0n1 NVMe I/O error x1 in the kernel log "
                                           "(tolerated 0)")},
    {"node1": ("kernel-log:soft-lockup", "host CPU soft lockup x3 in the kernel log "
                                         "(tolerated 2)"),
     "node2": ("kernel-log:hard-lockup", "host CPU hard lockup x1 in the kernel log "
                                         "(tolerated 0)"),
     "node3": ("kernel-log:mce", "host uncorrected machine check x1 in the kernel log "
                                 "(tolerated 0)")},
]
# Counters judged as a rise between two runs: if the first run after the fault was also
# the node's first (no baseline yet), the fault is applied again.
RISES = ("nvlink-errors", "hbm-degraded", "pcie-aer", "pcie-replay")
# Faults injected more than once: a few soft lockups are tolerated (max_soft_lockups 2).
TIMES = {"kernel-log:soft-lockup": 3}


@pytest.fixture
def box(sandbox: Sandbox) -> Iterator[Sandbox]:
    yield sandbox
    for node in sandbox.nodes:
        faults.heal(sandbox.state_dir, node)


def _drained(box: Sandbox, node: str, text: str) -> str | None:
    info = box.adapter().show_node(node)
    return info.reason if info.drained and text in info.reason else None


def _drain_all(box: Sandbox, cases: dict[str, tuple[str, str]]) -> dict[str, str]:
    for node, (fault, _) in cases.items():
        for _ in range(TIMES.get(fault, 1)):
            print(faults.inject(box.state_dir, node, fault))
    reasons: dict[str, str] = {}
    deadline = time.monotonic() + 90
    nudged = time.monotonic()
    while len(reasons) < len(cases):
        for node, (_, text) in cases.items():
            if node not in reasons and (reason := _drained(box, node, text)):
                reasons[node] = reason
        if time.monotonic() > deadline:
            raise TimeoutError(f"drained so far: {reasons}")
        if time.monotonic() - nudged > 15:
            for node, (fault, _) in cases.items():
                if node not in reasons and fault.startswith(RISES):
                    faults.inject(box.state_dir, node, fault)
            nudged = time.monotonic()
        time.sleep(0.5)
    return reasons


def _heal_all(box: Sandbox, nodes: list[str]) -> None:
    for node in nodes:
        faults.heal(box.state_dir, node)
    ctl = box.adapter()
    deadline = time.monotonic() + 120
    while any(ctl.show_node(n).drained for n in nodes):
        if time.monotonic() > deadline:
            raise TimeoutError({n: ctl.show_node(n).reason for n in nodes})
        time.sleep(0.5)


def test_new_gpu_fault_classes_drain_with_measured_against_expected_then_heal(box: Sandbox
                                                                              ) -> None:
    """Every new fault class (NVLink, recovery action, SRAM, fabric, HBM, PCIe AER and
    replays, the throttle rate, persistence/VBIOS/driver/peermem, shared mount, NVMe SMART,
    GPU service units, the per-model IB defaults, SXid/NVMe/lockup/MCE kernel lines) drains
    its node (HealthCheckProgram) naming the value and what was expected or tolerated;
    healed, the nodes resume."""
    for cases in ROUNDS:
        reasons = _drain_all(box, cases)
        for node, reason in sorted(reasons.items()):
            print(f"{node}: {reason}")
            assert reason.startswith("SR: health: ")
            assert "(expected " in reason or "(tolerated " in reason
        _heal_all(box, list(cases))
