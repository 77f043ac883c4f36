"""The new GPU fault classes in the real sandbox: each drains its node with a reason that
states measured against expected, and the node comes back once healed. One test, four
nodes at once, sharing the session sandbox."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox

# node → (fault, text its drain reason must hold)
CASES = {
    "node1": ("nvlink-errors:2", "gpu2 NVLink "),
    "node2": ("gpu-recovery:1", "gpu1 NVML recovery action DRAIN_AND_RESET (expected NONE)"),
    "node3": ("sram-ecc:0", "gpu0 1 SRAM uncorrectable errors (expected <=0)"),
    "node4": ("fabric-unhealthy", "fabric health UNHEALTHY: degraded bandwidth "
                                  "(expected HEALTHY)"),
}


@pytest.fixture
def box(sandbox: Sandbox) -> Iterator[Sandbox]:
    yield sandbox
    for node in sandbox.nodes:
        faults.heal(sandbox.state_dir, node)


def _drained(box: Sandbox, node: str, text: str) -> str | None:
    info = box.adapter().show_node(node)
    return info.reason if info.drained and text in info.reason else None


def test_new_gpu_fault_classes_drain_with_measured_against_expected_then_heal(box: Sandbox
                                                                              ) -> None:
    """nvlink-errors, gpu-recovery, sram-ecc and fabric-unhealthy each drain their node
    (HealthCheckProgram) naming the value and what was expected; healed, all resume."""
    for node, (fault, _) in CASES.items():
        print(faults.inject(box.state_dir, node, fault))
    reasons: dict[str, str] = {}
    deadline = time.monotonic() + 90
    last_nudge = time.monotonic()
    while len(reasons) < len(CASES):
        for node, (_, text) in CASES.items():
            if node not in reasons and (reason := _drained(box, node, text)):
                reasons[node] = reason
        if time.monotonic() > deadline:
            raise TimeoutError(f"drained so far: {reasons}")
        if "node1" not in reasons and time.monotonic() - last_nudge > 15:
            # NVLink counters are judged as a rise between two runs: if the first run
            # after the fault was also the node's first (no baseline), rise them again.
            faults.inject(box.state_dir, "node1", CASES["node1"][0])
            last_nudge = time.monotonic()
        time.sleep(0.5)
    for node, reason in sorted(reasons.items()):
        print(f"{node}: {reason}")
        assert reason.startswith("SR: health: ") and "(expected " in reason
    for node in CASES:
        faults.heal(box.state_dir, node)
    ctl = box.adapter()
    deadline = time.monotonic() + 120
    while any(ctl.show_node(n).drained for n in CASES):
        if time.monotonic() > deadline:
            raise TimeoutError({n: ctl.show_node(n).reason for n in CASES})
        time.sleep(0.5)
