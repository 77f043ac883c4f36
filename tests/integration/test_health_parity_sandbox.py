"""The new GPU fault classes in the real sandbox: each drains its node with a reason that
states measured against expected, and the node comes back once healed. One test, all
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
    {"node1": ("hbm-degraded:3", "gpu3 ECC corrected ")},
]
# Counters judged as a rise between two runs: if the first run after the fault was also
# the node's first (no baseline yet), the fault is applied again.
RISES = ("nvlink-errors", "hbm-degraded")


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
    """nvlink-errors, gpu-recovery, sram-ecc, fabric-unhealthy and hbm-degraded each drain
    their node (HealthCheckProgram) naming the value and what was expected; healed, the
    nodes resume."""
    for cases in ROUNDS:
        reasons = _drain_all(box, cases)
        for node, reason in sorted(reasons.items()):
            print(f"{node}: {reason}")
            assert reason.startswith("SR: health: ") and "(expected " in reason
        _heal_all(box, list(cases))
