"""Stand-in hardware for each sandbox node: 8 GPUs, 8 HCAs, a kernel log and an NVMe.

Per node ``<state>/nodes/<node>/``: ``sys/class/infiniband`` (mlx5_0..7, port 1
ACTIVE at 400 Gb/sec (4X NDR)), ``kmsg`` (empty, /dev/kmsg record format),
``boot_id``, and ``nvme/`` (the staging directory, made to look
``NVME_SIZE`` big through ``health.nvme.size_limit``); and the node's NVML
scenario ``<state>/scenarios/<node>.json`` (8 healthy H100s).
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.fakes import nvml, sysfs

GPUS = 8
HCAS = 8
NVME_SIZE = 100 << 30
NVME_MIN_FREE = 10 << 30


@dataclass(frozen=True)
class NodeHardware:
    """Where one node's stand-ins live."""

    node: str
    root: Path
    scenario: Path

    @property
    def sysfs(self) -> Path:
        return self.root / "sys" / "class" / "infiniband"

    @property
    def kmsg(self) -> Path:
        return self.root / "kmsg"

    @property
    def boot_id(self) -> Path:
        return self.root / "boot_id"

    @property
    def nvme(self) -> Path:
        return self.root / "nvme"


def scenario_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "scenarios"


def locate(state_dir: Path, node: str) -> NodeHardware:
    return NodeHardware(node, Path(state_dir) / "nodes" / node,
                        scenario_dir(state_dir) / f"{node}.json")


def reset_node(hw: NodeHardware) -> None:
    """Healthy hardware, as after a reboot: new boot id, empty kernel log, fresh counters."""
    nvml.write_scenario(str(hw.scenario), nvml.default_scenario(GPUS))
    if hw.sysfs.exists():
        shutil.rmtree(hw.sysfs)
    sysfs.build(str(hw.sysfs), HCAS)
    hw.kmsg.parent.mkdir(parents=True, exist_ok=True)
    hw.kmsg.write_text("")
    hw.boot_id.write_text(f"{uuid.uuid4()}\n")
    hw.nvme.mkdir(parents=True, exist_ok=True)
    fill = hw.nvme / FILL_FILE
    if fill.exists():
        fill.unlink()


FILL_FILE = ".sandbox-nvme-full"


def prepare_node_hardware(state_dir: Path, nodes: list[str]) -> list[NodeHardware]:
    """Give every sandbox node healthy stand-in hardware (called by ``sandbox up``)."""
    out = []
    for node in nodes:
        hw = locate(state_dir, node)
        reset_node(hw)
        out.append(hw)
    return out
