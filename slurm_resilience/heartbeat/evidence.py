"""Evidence of a hang, captured before anything is killed.

For each stalled rank on this node: a ``py-spy dump`` of its process (when
py-spy is installed) and, when the job enabled PyTorch's NCCL flight recorder
(``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``), a trigger of its dump, whose bytes are
copied as they are: root never unpickles them. For the node: a health snapshot
from the gate's collectors and the Xids raised since the job started.

Every process is checked first: it must still be the one that created the
slot (pid and start time) and belong to the job's user, so a slot can never
point the root agent at someone else's process.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib
import os
import shutil
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.config import Config
from slurm_resilience.heartbeat import safefs
from slurm_resilience.heartbeat.slot import SlotView
from slurm_resilience.heartbeat.writer import process_start_ticks
from slurm_resilience.log import get_logger
from slurm_resilience.proc import CommandError, Runner

log = get_logger("heartbeat.evidence")

NCCL_PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
NCCL_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
NCCL_FILE_DEFAULT = "/tmp/nccl_trace_rank_"
MAX_TRACE_BYTES = 64 << 20
MAX_ENVIRON_BYTES = 1 << 20


def process_uid(pid: int) -> int | None:
    """Real uid of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def same_process(pid: int, pid_start: int, uid: int) -> bool:
    """Whether ``pid`` is still the slot's process (same start time) and runs as ``uid``."""
    if pid <= 1:
        return False
    try:
        if process_start_ticks(pid) != pid_start:
            return False
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return False
    return process_uid(pid) == uid


def read_environ(pid: int) -> dict[str, str]:
    """A process's environment as text (root may read it; nothing in it is executed)."""
    with open(f"/proc/{pid}/environ", "rb") as fh:
        raw = fh.read(MAX_ENVIRON_BYTES)
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def find_py_spy(configured: str) -> str | None:
    """The py-spy binary: the configured one, else PATH, else beside this Python."""
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


@dataclass
class RankEvidence:
    """What was captured from one rank's process."""

    rank: int
    pid: int
    stack: str = ""
    stack_error: str = ""
    nccl_trace: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "stack": self.stack,
                "stack_error": self.stack_error, "nccl_trace": self.nccl_trace}


def py_spy_dump(binary: str | None, pid: int, timeout: float,
                runner: Runner | None = None) -> tuple[str, str]:
    """``(stack text, error)`` of ``py-spy dump --pid``; error says why there is no stack."""
    if binary is None:
        return "", "py-spy is not installed (pip install py-spy): no stack captured"
    try:
        out = (runner or Runner()).run([binary, "dump", "--pid", str(pid)], timeout=timeout)
    except CommandError as exc:
        return "", f"couldn't dump stack of pid {pid}: {exc}"
    return out.stdout, ""


def nccl_flight_recorder(pid: int, rank: int, uid: int, save_dir_fd: int | None, *,
                         wait_s: float = 5.0) -> dict[str, Any]:
    """Trigger the NCCL flight recorder of one rank and keep its dump as opaque bytes.

    The pipe and the dump file are in paths the job chose: each is opened
    without following links and must belong to the job's user.
    """
    env = read_environ(pid)
    prefix = env.get(NCCL_PIPE_ENV, "")
    if not prefix:
        return {"enabled": False}
    pipe = f"{prefix}{rank}.pipe"
    dump = f"{env.get(NCCL_FILE_ENV) or NCCL_FILE_DEFAULT}{rank}"
    result: dict[str, Any] = {"enabled": True, "pipe": pipe, "file": dump}
    if not (os.path.isabs(pipe) and os.path.isabs(dump)):
        result["error"] = "pipe or dump path is not absolute: not used"
        return result
    started = time.time()
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        result["error"] = f"couldn't open pipe {pipe}: {exc.strerror}"
        return result
    try:
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != uid:
            result["error"] = f"{pipe} is not a FIFO owned by uid {uid}: not triggered"
            return result
        os.write(fd, b"1\n")
    finally:
        os.close(fd)
    directory, name = os.path.split(dump)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            dfd = safefs.open_dir(directory)
            try:
                data = safefs.read_owned_file(dfd, name, uid, max_bytes=MAX_TRACE_BYTES)
                mtime = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime
            finally:
                os.close(dfd)
            if mtime >= started - 1:
                break
        except FileNotFoundError:
            pass
        except OSError as exc:
            result["error"] = f"couldn't read dump {dump}: {exc}"
            return result
        if time.monotonic() > deadline:
            result["error"] = f"no dump in {dump} within {wait_s:g}s"
            return result
        time.sleep(0.2)
    result.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    if save_dir_fd is not None:
        saved = f"nccl-trace-rank{rank}.bin"
        try:
            safefs.write_new(save_dir_fd, saved, data)
            result["saved_as"] = saved
        except FileExistsError:
            result["saved_as"] = saved
    return result


def capture_ranks(slots: Sequence[SlotView], uid: int, *, py_spy: str | None, timeout: float,
                  save_dir_fd: int | None = None) -> list[RankEvidence]:
    """Stacks (and NCCL traces) of every rank, in parallel, bounded by ``timeout``."""
    def one(v: SlotView) -> RankEvidence:
        ev = RankEvidence(v.rank, v.pid)
        if not same_process(v.pid, v.pid_start, uid):
            ev.stack_error = (f"pid {v.pid} is gone or is not the job's process: no stack")
            return ev
        ev.stack, ev.stack_error = py_spy_dump(py_spy, v.pid, timeout)
        try:
            ev.nccl_trace = nccl_flight_recorder(v.pid, v.rank, uid, save_dir_fd,
                                                 wait_s=min(5.0, timeout / 2))
        except OSError as exc:
            ev.nccl_trace = {"error": f"couldn't read environment of pid {v.pid}: {exc}"}
        return ev

    if not slots:
        return []
    with cf.ThreadPoolExecutor(max_workers=min(8, len(slots))) as pool:
        futures = {pool.submit(one, v): v for v in slots}
        out = []
        done, pending = cf.wait(futures, timeout=timeout + 2)
        for fut in done:
            out.append(fut.result())
        for fut in pending:
            v = futures[fut]
            out.append(RankEvidence(v.rank, v.pid, stack_error="evidence capture timed out"))
    return sorted(out, key=lambda e: e.rank)


def _optional(module: str) -> Any:
    """A module of another capability, or None when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def xids_since(cfg: Config, node: str, since: float) -> dict[str, Any]:
    """Xid events since ``since`` (the job's start) from the gate's kernel-log collector."""
    collector = _optional("slurm_resilience.health.collectors.xid")
    catalog = _optional("slurm_resilience.health.xid_catalog")
    health = getattr(cfg, "health", None)
    if collector is None or catalog is None or health is None:
        return {"checked": False, "error": "health gate not installed: Xids not checked"}
    from slurm_resilience.config.paths import node_path

    x = health.xid
    try:
        snap = collector.collect(x.source, node_path(x.path, node),
                                 node_path(x.boot_id_file, node), x.max_read_bytes,
                                 x.window_s, health.collector_timeout_s)
    except (OSError, CommandError) as exc:
        return {"checked": False, "error": f"couldn't read the kernel log: {exc}"}
    fatal = catalog.fatal_set(x.fatal, x.extra_fatal, x.not_fatal)
    events = [e for e in snap.get("events", []) if (e.get("time") or 0) >= since]
    findings = []
    for e in events:
        if catalog.is_fatal(int(e["xid"]), str(e.get("text", "")), fatal):
            when = time.strftime("%H:%M:%S", time.localtime(e.get("time") or 0))
            findings.append(f"PCI {e['pci']} XID {e['xid']} ({catalog.meaning(int(e['xid']))}) "
                            f"at {when}")
    return {"checked": not snap.get("error"), "error": snap.get("error") or "",
            "events": events, "findings": findings}


def health_snapshot(cfg: Config, node: str) -> dict[str, Any]:
    """The gate's read-only checks now; failed findings count as fresh blame evidence."""
    gate = _optional("slurm_resilience.health.gate")
    if gate is None or getattr(cfg, "health", None) is None:
        return {"checked": False, "error": "health gate not installed: no snapshot"}
    try:
        report = gate.run(cfg, node, "prolog", only=("gpu", "infiniband", "nvme"))
    except Exception as exc:  # noqa: BLE001 - a broken collector must not stop the incident
        return {"checked": False, "error": f"couldn't run the health gate: {exc}"}
    snap: dict[str, Any] = report.to_dict()
    snap["checked"] = True
    snap["failures"] = [f["message"] for f in snap.get("findings", [])
                        if f.get("severity") == "fail"]
    return snap


def node_findings(xids: Mapping[str, Any], health: Mapping[str, Any]) -> list[str]:
    """Fresh findings that can blame this node: fatal Xids since job start, failed checks."""
    return [*xids.get("findings", []), *health.get("failures", [])]

