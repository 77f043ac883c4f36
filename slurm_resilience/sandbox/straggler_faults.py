"""Sandbox fault ``node-slow:PERCENT``: the node's stand-in GPUs compute PERCENT% slower.

It writes ``<state>/nodes/<node>/slow-factor`` (``1.3`` for 30%); a sandbox workload that
stands in for GPU compute (the straggler test's) multiplies its step time by it, as a
throttled or degraded GPU would. ``sandbox heal`` removes it. Imported by
:mod:`slurm_resilience.sandbox.faults`, which owns the registry.
"""

from __future__ import annotations

from slurm_resilience.sandbox import faults as registry
from slurm_resilience.sandbox.hardware import NodeHardware

FACTOR_FILE = "slow-factor"


def node_slow(hw: NodeHardware, args: list[str]) -> str:
    if not args[0].isdigit() or not 1 <= int(args[0]) <= 1000:
        raise registry.FaultError(f"node-slow: PERCENT must be 1..1000, got {args[0]!r}")
    factor = 1 + int(args[0]) / 100
    (hw.root / FACTOR_FILE).write_text(f"{factor}\n")
    return f"compute {args[0]}% slower (step times x{factor:g} in sandbox workloads)"


def heal(hw: NodeHardware) -> None:
    (hw.root / FACTOR_FILE).unlink(missing_ok=True)


registry.register("node-slow", "node-slow:PERCENT", node_slow)
registry.register_healer(heal)
