"""Stand-in hardware for each sandbox node: 8 GPUs, 8 HCAs, a kernel log and an NVMe.

Per node ``<state>/nodes/<node>/``: ``sys/class/infiniband`` (mlx5_0..7, port 1
ACTIVE at 400 Gb/sec (4X NDR)), ``kmsg`` (empty, /dev/kmsg record format),
``boot_id``, and ``nvme/`` (the staging directory, made to look
``NVME_SIZE`` big through ``health.nvme.size_limit``); and the node's NVML
scenario ``<state>/scenarios/<node>.json`` (8 healthy H100s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.fakes import nvml, sysfs
from slurm_resilience.log import get_logger

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
    nvml.write_scenario(str(hw.scenario), nvml.default_scenario(GPUS))
    hw.sysfs.parent.mkdir(parents=True, exist_ok=True)
    fresh = hw.sysfs.with_name(f".{hw.sysfs.name}.new-{uuid.uuid4().hex[:8]}")
    sysfs.build(str(fresh), HCAS)
    swap_in(fresh, hw.sysfs)
    _replace(hw.kmsg, "")
    _replace(hw.boot_id, f"{uuid.uuid4()}\n")
    hw.nvme.mkdir(parents=True, exist_ok=True)
    fill = hw.nvme / FILL_FILE
    if fill.exists():
        fill.unlink()


FILL_FILE = ".sandbox-nvme-full"
RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def _replace(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
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


def swap_in(fresh: Path, target: Path) -> None:
    """Put the directory ``fresh`` at ``target`` in one step and remove what was there."""
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
    shutil.rmtree(fresh)


def prepare_node_hardware(state_dir: Path, nodes: list[str]) -> list[NodeHardware]:
    """Give every sandbox node healthy stand-in hardware (called by ``sandbox up``)."""
    out = []
    for node in nodes:
        hw = locate(state_dir, node)
        reset_node(hw)
        out.append(hw)
    return out
