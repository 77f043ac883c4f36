"""The health-parity fault families in the real sandbox: one fault of each drains its node
through the HealthCheckProgram with a reason that states measured against expected, and the
node comes back once healed. Every fault class is judged by the real gate on the same
stand-ins and config in tests/unit/test_fakes_faults.py; here one per family shows the
sandbox's wiring (state across health checks, stand-ins on the check's PATH, the drain
reason in Slurm). One test, all nodes at once, sharing the session sandbox."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox

# Round → node → (fault, text its drain reason must hold). A node's reason names its
# first finding only, so faults on one node go in separate rounds. Kernel-log lines, IB
# ports down and a full NVMe drain end to end in test_health_sandbox.py.
ROUNDS = [
    # NVML counters and the PCIe AER sysfs counters judged as a rise between runs, the
    # GPU software's consistency, and the throttle judged as a rate: hw_slowdown fails on
    # the third health check within the hour (throttle_fail_runs: three of the sandbox's
    # HealthCheckInterval passes).
    {"node1": ("nvlink-errors:2", "gpu2 NVLink recovery errors +1 (expected <=0)"),
     "node2": ("pcie-aer:2", "gpu2 PCIe AER nonfatal +1 (expected <=0)"),
     "node3": ("gpu-driver:550.127.05", "driver 550.127.05 (expected 565.*)"),
     "node4": ("gpu-throttle:5:hw_slowdown", "gpu5 HW slowdown in 3 runs within 60min "
                                             "(expected <3)")},
    # The host: shared filesystem, NVMe SMART through the nvme stand-in, the Fabric
    # Manager unit through the systemctl stand-in, the shipped per-GPU-model IB defaults
    # (the sandbox lists no HCAs).
    {"node1": ("mount-unreachable", "node1/shared unreachable: No such file or directory "
                                    "(expected reachable)"),
     "node2": ("nvme-spare-low", "nvme 10% available spare (expected >=20%)"),
     "node3": ("service-failed:nvidia-fabricmanager",
               "nvidia-fabricmanager failed (expected active)"),
     "node4": ("ib-missing:mlx5_3", "7 InfiniBand HCAs (expected 8 for NVIDIA H100 80GB HBM3)")},
]
# Counters judged as a rise between two runs: if the first run after the fault was also
# the node's first (no baseline yet), the fault is applied again.
RISES = ("nvlink-errors", "pcie-aer")


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
    """One fault of each new family (NVML counters, PCIe AER, GPU software, the throttle
    rate, shared mount, NVMe SMART, GPU service units, the per-model IB defaults) drains
    its node (HealthCheckProgram) naming the value and what was expected; healed, the
    nodes resume."""
    for cases in ROUNDS:
        reasons = _drain_all(box, cases)
        for node, reason in sorted(reasons.items()):
            print(f"{node}: {reason}")
            assert reason.startswith("SR: health: ")
            assert "(expected " in reason or "(tolerated " in reason
        _heal_all(box, list(cases))
