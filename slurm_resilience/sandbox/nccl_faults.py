"""Sandbox fault names of the NCCL gate, for ``slurm-resilience sandbox inject NODE FAULT``:

* ``nccl-slow``: every rank sleeps 500 ms before each timed all_reduce;
* ``nccl-wrong:GPU``: rank GPU returns a sum that is off by one in one element;
* ``nccl-hang``: rank 0 never enters the collective.

They write the node's fault file (``nccl.fault_file``, set by the sandbox to
``<state>/nodes/<node>/nccl-fault.json``), which the ranks read when they start.
``sandbox heal`` removes it and, as a reboot would, makes the cached result stale.
Imported by :mod:`slurm_resilience.sandbox.faults`, which owns the registry.
"""

from __future__ import annotations

from slurm_resilience import config
from slurm_resilience.nccl import cache, faults
from slurm_resilience.sandbox import faults as registry
from slurm_resilience.sandbox.hardware import NodeHardware

FAULT_FILE = "nccl-fault.json"


def _inject(name: str, hw: NodeHardware, args: list[str]) -> str:
    try:
        fault = faults.from_sandbox_name(":".join([name, *args]))
    except ValueError as exc:
        raise registry.FaultError(str(exc)) from None
    faults.write(str(hw.root / FAULT_FILE), fault)
    who = "every rank" if fault.rank is None else f"rank {fault.rank}"
    what = {"slow": "sleeps 500 ms before each all_reduce", "wrong": "returns a wrong sum",
            "hang": "never enters the all_reduce"}[fault.kind]
    return f"nccl test: {who} {what} (from the next test on)" + _hint(hw)


def _hint(hw: NodeHardware) -> str:
    """The sandbox ships the gate off (it costs CPU); say how to turn it on."""
    conf = hw.root.parent.parent / "etc" / "slurm-resilience.yaml"
    try:
        enabled = config.load(str(conf)).nccl.enabled
    except config.ConfigError:
        return ""
    return "" if enabled else f"; the NCCL gate is off: set nccl.enabled: true in {conf}"


def nccl_slow(hw: NodeHardware, args: list[str]) -> str:
    return _inject("nccl-slow", hw, args)


def nccl_wrong(hw: NodeHardware, args: list[str]) -> str:
    return _inject("nccl-wrong", hw, args)


def nccl_hang(hw: NodeHardware, args: list[str]) -> str:
    return _inject("nccl-hang", hw, args)


def heal(hw: NodeHardware) -> None:
    faults.write(str(hw.root / FAULT_FILE), None)
    cache.invalidate(str(hw.root / "state" / cache.FILENAME), "sandbox heal (as after a reboot)")


registry.register("nccl-slow", "nccl-slow", nccl_slow)
registry.register("nccl-wrong", "nccl-wrong:GPU", nccl_wrong)
registry.register("nccl-hang", "nccl-hang", nccl_hang)
registry.register_healer(heal)
