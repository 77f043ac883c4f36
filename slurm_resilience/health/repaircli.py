"""``slurm-resilience xid-repaired --gpu N``: record that a GPU was reset.

A fatal Xid fails its GPU until the repair it needs (see ``xid_repairs``). A reboot or
NVML seeing a lost GPU again are noticed by themselves; an operator's ``nvidia-smi -r``
on a GPU that never left the bus (Xid 48, 119...) is not, so the operator says so here.
The record is a reset: it never ends an Xid that needs a reboot (79, or any GPU whose Xid
154 or NVML recovery action asks for one).
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from slurm_resilience import config
from slurm_resilience.config.paths import node_name

_PCI = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?$")


def register(sub: Any) -> None:
    p = sub.add_parser("xid-repaired",
                       help="record that a GPU was reset, ending its fatal Xids that a "
                            "reset ends (never those that need a reboot)")
    p.add_argument("--gpu", required=True, action="append", metavar="GPU",
                   help="GPU index (as the gate has seen it) or PCI address "
                        "(0000:5d:00 or 00000000:5D:00.0); repeat for several")
    p.add_argument("--evidence", default="operator: GPU reset",
                   help="how it was repaired, shown in the log and the check's finding "
                        "(default: 'operator: GPU reset')")
    p.add_argument("--node", default="", help="node name (default: config, SLURMD_NODENAME, "
                                              "hostname)")
    p.set_defaults(func=run)


def _pci_of(gpu: str, known: dict[str, int]) -> str:
    if _PCI.match(gpu):
        return gpu
    from slurm_resilience.cli import UsageError

    if gpu.isdigit():
        for bus_id, index in known.items():
            if index == int(gpu):
                return bus_id
        raise UsageError(f"xid-repaired: gpu{gpu}: the gate has not seen this GPU index; "
                         "give its PCI address instead")
    raise UsageError(f"xid-repaired: {gpu!r} is neither a GPU index nor a PCI address")


def run(args: argparse.Namespace) -> int:
    from slurm_resilience.health import gate, xid_repairs

    cfg = config.load(args.config)
    node = node_name(args.node or cfg.node.name)
    directory = gate.state_dir(cfg, node)
    from slurm_resilience.cli import UsageError

    try:
        known = gate.StateStore(directory).load_state(gate.GPU_MAP, gate.GpuMap).by_pci
    except OSError as exc:
        raise UsageError(f"xid-repaired: couldn't read the gate's state in {directory}: "
                         f"{exc.strerror} (run as root on the node)") from None
    now = time.time()
    for gpu in args.gpu:
        pci = _pci_of(gpu, known)
        try:
            xid_repairs.record(directory, xid_repairs.Repair(pci, now, args.evidence))
        except OSError as exc:
            raise UsageError(f"xid-repaired: couldn't record the repair in {directory}: "
                             f"{exc.strerror} (run as root on the node)") from None
        print(f"{node}: {xid_repairs.pci_key(pci)} repaired ({args.evidence}); the next gate "
              "run ends its fatal Xids logged before now that a reset ends")
    return 0
