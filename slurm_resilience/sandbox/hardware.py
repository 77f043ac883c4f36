"""Stand-in hardware for each sandbox node: 8 GPUs, 8 HCAs, a kernel log and an NVMe.

Per node ``<state>/nodes/<node>/``: ``sys/class/infiniband`` (mlx5_0..7, port 1
ACTIVE at 400 Gb/sec (4X NDR)), ``sys/bus/pci/devices/<bdf>/aer_dev_*`` (each GPU's
PCIe AER statistics, all 0), ``proc/modules`` (the NVIDIA and RDMA modules,
nvidia_peermem loaded), ``kmsg`` (empty, /dev/kmsg record format), ``boot_id``,
``nvme/`` (the staging directory, made to look ``NVME_SIZE`` big through
``health.nvme.size_limit``), ``nvme-smart-log.json`` (what ``nvme smart-log -o json``
answers), ``systemd/<unit>`` (each GPU service unit's state), ``shared/`` (the
shared filesystem the health check probes) and ``bin/`` (stand-ins for ``nvme`` and
``systemctl``, first on the health check's PATH); and the node's NVML scenario
``<state>/scenarios/<node>.json`` (8 healthy H100s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_resilience.fakes import nvml, sysfs
from slurm_resilience.log import get_logger
from slurm_resilience.sandbox import standins

log = get_logger("sandbox")

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

    @property
    def pci(self) -> Path:
        return self.root / "sys" / "bus" / "pci" / "devices"

    @property
    def modules(self) -> Path:
        return self.root / "proc" / "modules"

    @property
    def smart_log(self) -> Path:
        return self.root / "nvme-smart-log.json"

    @property
    def units(self) -> Path:
        return self.root / "systemd"

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    @property
    def bin(self) -> Path:
        return self.root / "bin"


def scenario_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "scenarios"


def locate(state_dir: Path, node: str) -> NodeHardware:
    return NodeHardware(node, Path(state_dir) / "nodes" / node,
                        scenario_dir(state_dir) / f"{node}.json")


def reset_node(hw: NodeHardware) -> None:
    """Healthy hardware, as after a reboot: new boot id, empty kernel log, fresh counters.

    A health check may read the node while this runs: every file is replaced by a
    rename, and the HCA tree is built beside the old one and swapped in with one
    ``renameat2(RENAME_EXCHANGE)``, so a reader sees the old tree or the new one,
    never a missing or half-built path.
    """
    scenario = nvml.default_scenario(GPUS)
    fabric = hw.scenario.with_suffix(".fabric.json")
    if fabric.exists():  # an NVL72 node: its GPUs' NVLink domain
        entry = json.loads(fabric.read_text())
        for gpu in scenario["gpus"]:
            gpu["fabric"] = dict(entry)
    nvml.write_scenario(str(hw.scenario), scenario)
    hw.sysfs.parent.mkdir(parents=True, exist_ok=True)
    fresh = hw.sysfs.with_name(f".{hw.sysfs.name}.new-{uuid.uuid4().hex[:8]}")
    sysfs.build(str(fresh), HCAS)
    swap_in(fresh, hw.sysfs)
    replace_text(hw.kmsg, "")
    replace_text(hw.boot_id, f"{uuid.uuid4()}\n")
    hw.nvme.mkdir(parents=True, exist_ok=True)
    fill = hw.nvme / FILL_FILE
    if fill.exists():
        fill.unlink()
    for bus_id in nvml.H100_BUS_IDS[:GPUS]:
        sysfs.build_aer(str(hw.pci), sysfs.sysfs_bdf(f"00000000:{bus_id}:00.0"))
    replace_text(hw.modules, standins.proc_modules(peermem=True))
    replace_text(hw.smart_log, standins.smart_log_json())
    for unit in standins.UNITS:
        replace_text(hw.units / unit, "active\n")
    hw.shared.mkdir(parents=True, exist_ok=True)
    for name, script in standins.SCRIPTS.items():
        path = hw.bin / name
        if not path.exists() or path.read_text() != script:
            replace_text(path, script, mode=0o755)


FILL_FILE = ".sandbox-nvme-full"
RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def replace_text(path: Path, text: str, mode: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    if mode is not None:
        tmp.chmod(mode)
    os.replace(tmp, path)


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    try:
        fn = libc.renameat2
    except AttributeError:  # a libc without the wrapper (glibc < 2.28, some others)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (``renameat2(RENAME_EXCHANGE)``); OSError when the
    kernel, libc or file system cannot."""
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 not in this libc")
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


# A reader whose path walk had passed ``target`` before a swap goes on in the old tree: it is
# kept this long (renamed aside), not removed at once, so such a reader never finds a
# half-deleted HCA (a CI run saw one with no ports). Longer than a collector may run.
RETIRED_KEEP_S = 30.0


def swap_in(fresh: Path, target: Path) -> None:
    """Put the directory ``fresh`` at ``target`` in one step; what was there is set aside
    and removed at a later swap, once older than ``RETIRED_KEEP_S``."""
    if not target.exists():
        os.rename(fresh, target)
        return
    try:
        exchange(fresh, target)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
        # Not atomic: a reader may see the path missing for a moment. Said, not hidden.
        log.warning("sandbox: no atomic directory exchange here; swapping in two renames",
                    path=str(target), error=exc.strerror)
        old = fresh.with_name(fresh.name + ".old")
        os.rename(target, old)
        os.rename(fresh, target)
        fresh = old
    now = time.time()
    prefix = f".{target.name}.retired-"
    mine = target.with_name(f"{prefix}{now:.6f}-{uuid.uuid4().hex[:8]}")
    os.rename(fresh, mine)
    for path in target.parent.glob(prefix + "*"):
        if path == mine:
            continue
        stamp = path.name[len(prefix):].split("-", 1)[0]
        try:
            old_enough = now - float(stamp) > RETIRED_KEEP_S
        except ValueError:
            old_enough = True  # not ours to read: a name we never write
        if old_enough:
            shutil.rmtree(path, ignore_errors=True)


def prepare_node_hardware(state_dir: Path, nodes: list[str],
                          fabric_of: Mapping[str, dict[str, Any]] | None = None
                          ) -> list[NodeHardware]:
    """Give every sandbox node healthy stand-in hardware (called by ``sandbox up``);
    ``fabric_of``: node → its GPUs' NVLink fabric entry (GB200 NVL72), kept across resets."""
    out = []
    for node in nodes:
        hw = locate(state_dir, node)
        fabric = hw.scenario.with_suffix(".fabric.json")
        if fabric_of and node in fabric_of:
            replace_text(fabric, json.dumps(fabric_of[node]))
        elif fabric.exists():
            fabric.unlink()
        reset_node(hw)
        out.append(hw)
    return out
