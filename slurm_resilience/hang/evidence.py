"""Evidence of a hang, captured before anything is killed.

For each stalled rank on this node: a ``py-spy dump`` of its process (when
py-spy is installed) and, when the job enabled PyTorch's NCCL flight recorder
(``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``), a trigger of its dump, whose bytes are
copied as they are: root never unpickles them. For the node: a health snapshot
from the gate's collectors and the Xids raised since the job started.

Every process is checked first: it must still be the one that created the
slot (pid and start time) and belong to the job's user, so a slot can never
point the root agent at someone else's process. Paths from the job's
environment are reached only as the job's user could (``safefs.open_job_path``).

All of it shares one deadline (``heartbeat.evidence_timeout_s``): the node's checks run
beside the rank captures and get the time left; at the deadline (less a short grace for
reaping) captures not started are cancelled, running py-spy children are killed as
process groups, and checks still running are reported as timed out; the incident goes on
without waiting for them.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, cast

from slurm_resilience import safefs
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.config import Config
from slurm_resilience.heartbeat.slot import SlotView
from slurm_resilience.heartbeat.writer import process_start_ticks
from slurm_resilience.log import get_logger
from slurm_resilience.proc import ChildGroup, CommandError, CommandTimeout, Runner

log = get_logger("heartbeat.evidence")

NCCL_PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
NCCL_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
NCCL_FILE_DEFAULT = "/tmp/nccl_trace_rank_"
MAX_TRACE_BYTES = 64 << 20
MAX_ENVIRON_BYTES = 1 << 20
TIMED_OUT = "evidence capture timed out"
# After the deadline, how long killed py-spy children get to be reaped by their threads.
REAP_GRACE_S = 1.0
# Names tried for one dump before giving up keeping it (a taken name is never reused).
SAVE_ATTEMPTS = 16
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


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


class NcclTraceDoc(TypedDict, total=False):
    """What came of triggering one rank's NCCL flight recorder."""

    enabled: bool  # the rank set TORCH_NCCL_DEBUG_INFO_PIPE_FILE
    pipe: str
    file: str
    error: str
    bytes: int
    sha256: str
    saved_as: str  # under the incident's files/ directory; only a file this capture wrote
    save_error: str  # why the dump read was not kept


class RankEvidenceDoc(TypedDict):
    rank: int
    pid: int
    stack: str
    stack_error: str
    nccl_trace: NcclTraceDoc


class XidsDoc(TypedDict, total=False):
    """Xids since the job started, from the health gate's kernel-log collector."""

    checked: bool
    error: str
    events: list[dict[str, Any]]  # the collector's events, as it returns them
    findings: list[str]  # the fatal ones, one line each


class HealthDoc(TypedDict, total=False):
    """The health gate's read-only checks (its report's to_dict, kept as it is) plus:"""

    checked: bool
    error: str
    failures: list[str]  # messages of the failed findings
    findings: list[dict[str, Any]]


@dataclass
class RankEvidence:
    """What was captured from one rank's process."""

    rank: int
    pid: int
    stack: str = ""
    stack_error: str = ""
    nccl_trace: NcclTraceDoc = field(default_factory=lambda: NcclTraceDoc())

    def to_json(self) -> RankEvidenceDoc:
        return {"rank": self.rank, "pid": self.pid, "stack": self.stack,
                "stack_error": self.stack_error, "nccl_trace": self.nccl_trace}


def py_spy_dump(binary: str | None, pid: int, timeout: float,
                runner: Runner | None = None, group: ChildGroup | None = None
                ) -> tuple[str, str]:
    """``(stack text, error)`` of ``py-spy dump --pid``; error says why there is no stack."""
    if binary is None:
        return "", "py-spy is not installed (pip install py-spy): no stack captured"
    if timeout <= 0:
        return "", f"{TIMED_OUT}: no time left for a stack of pid {pid}"
    try:
        out = (runner or Runner()).run([binary, "dump", "--pid", str(pid)], timeout=timeout,
                                       group=group)
    except CommandTimeout:
        return "", f"{TIMED_OUT}: py-spy dump of pid {pid} stopped at the evidence deadline"
    except CommandError as exc:
        return "", f"couldn't dump stack of pid {pid}: {exc}"
    return out.stdout, ""


def _trigger_pipe(pipe: str, uid: int) -> str:
    """Write to the job's flight-recorder FIFO; returns an error, or "" when triggered."""
    try:
        fd = safefs.open_job_path(pipe, uid, kind=stat.S_IFIFO, flags=os.O_WRONLY)
    except OSError as exc:
        return f"couldn't trigger the flight recorder through {pipe}: {exc.strerror}"
    try:
        os.write(fd, b"1\n")
    except OSError as exc:  # EAGAIN: full; EPIPE: nobody reads it
        return f"couldn't trigger the flight recorder through {pipe}: {exc.strerror}"
    finally:
        os.close(fd)
    return ""


def nccl_flight_recorder(pid: int, rank: int, uid: int, save_dir_fd: int | None, *,
                         wait_s: float = 5.0, clock: Clock = SystemClock(),
                         poll_s: float = 0.2, save_prefix: str = "nccl-trace") -> NcclTraceDoc:
    """Trigger the NCCL flight recorder of one rank and keep its dump as opaque bytes.

    The pipe and the dump file are in paths the job chose: each is reached only as the job's
    user could (:func:`safefs.open_job_path`): never through a link, never a device, FIFO or
    socket where a file is expected, never in a directory the user does not own. Every
    refusal reads the same, whether the path is absent, forbidden or of the wrong type.
    The dump is kept as ``<save_prefix>-rank<R>.bin`` (see :func:`trace_prefix`).
    """
    env = read_environ(pid)
    prefix = env.get(NCCL_PIPE_ENV, "")
    if not prefix:
        return {"enabled": False}
    pipe = f"{prefix}{rank}.pipe"
    dump = f"{env.get(NCCL_FILE_ENV) or NCCL_FILE_DEFAULT}{rank}"
    result: NcclTraceDoc = {"enabled": True, "pipe": pipe, "file": dump}
    started = time.time()
    error = _trigger_pipe(pipe, uid)
    if error:
        result["error"] = error
        return result
    deadline = clock.monotonic() + wait_s
    # PyTorch writes the dump in place, so one read can catch it half written: it is taken
    # once two polls in a row see the same non-empty content.
    previous: bytes | None = None
    while True:
        try:
            data, mtime = safefs.read_job_file(dump, uid, max_bytes=MAX_TRACE_BYTES)
            if mtime >= started - 1 and data and data == previous:
                break
            previous = data if mtime >= started - 1 else None
        except OSError:
            previous = None  # absent yet, or refused: both look the same to the job
        if clock.monotonic() >= deadline:
            result["error"] = (f"no dump in {dump} within {wait_s:g}s (it must be a regular "
                               "file of the job's user in a directory the user owns)")
            return result
        time.sleep(poll_s)
    result["bytes"], result["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    if save_dir_fd is not None:
        saved, error = save_trace(save_dir_fd, f"{save_prefix}-rank{rank}", data)
        if saved:
            result["saved_as"] = saved
        else:
            result["save_error"] = error
    return result


def trace_prefix(job_id: int, run: int, node: str) -> str:
    """The start of a flight-recorder dump's name under ``files/``: the directory is shared
    by every job (and, where node directories are shared, by every node)."""
    return f"nccl-trace-job{int(job_id)}-run{int(run)}-{_SAFE_NAME.sub('_', node)}"


def save_trace(dir_fd: int, stem: str, data: bytes) -> tuple[str, str]:
    """Keep ``data`` as a new file ``<stem>.bin`` (``<stem>.<n>.bin`` when taken); returns
    ``(name written, "")`` or ``("", why not)``. Never names a file this call did not write."""
    for n in range(SAVE_ATTEMPTS):
        name = f"{stem}.bin" if n == 0 else f"{stem}.{n}.bin"
        try:
            safefs.write_new(dir_fd, name, data)
            return name, ""
        except FileExistsError:
            continue
        except OSError as exc:
            return "", f"couldn't keep the dump as {name}: {exc.strerror or exc}"
    return "", f"couldn't keep the dump: {stem}.bin and {SAVE_ATTEMPTS - 1} more names taken"


NodeCheck = Callable[[float], Mapping[str, Any]]


@dataclass(frozen=True)
class CaptureOutcome:
    """Evidence of every rank and of the node, and how the one deadline went.

    ``started_at``, ``deadline`` and ``cut_at`` are readings of the capture's clock: the
    deadline is ``started_at`` plus the configured bound, ``cut_at`` the reading at which
    what was still running was cut off (None when everything finished before). Ranks and
    node checks cut off are listed; ``children_unreaped`` are py-spy children still alive
    when capture returned (none, unless the kernel is stuck)."""

    ranks: list[RankEvidence]
    timed_out: tuple[int, ...]
    children_started: int
    children_unreaped: tuple[int, ...]
    node: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    node_timed_out: tuple[str, ...] = ()
    started_at: float = 0.0
    deadline: float = 0.0
    cut_at: float | None = None


def capture_ranks(slots: Sequence[SlotView], uid: int, *, py_spy: str | None, timeout: float,
                  save_dir_fd: int | None = None, workers: int = 8,
                  clock: Clock = SystemClock(), runner: Runner | None = None
                  ) -> list[RankEvidence]:
    """Stacks (and NCCL traces) of every rank, in parallel, all within ``timeout``."""
    return capture_ranks_bounded(slots, uid, py_spy=py_spy, timeout=timeout,
                                 save_dir_fd=save_dir_fd, workers=workers, clock=clock,
                                 runner=runner).ranks


def reap_grace(timeout: float) -> float:
    """The part of the bound kept for reaping killed children: captures are cut this long
    before the deadline, so the whole capture, reaping included, fits the bound."""
    return min(REAP_GRACE_S, timeout / 10)


def capture_ranks_bounded(slots: Sequence[SlotView], uid: int, *, py_spy: str | None,
                          timeout: float, save_dir_fd: int | None = None, workers: int = 8,
                          clock: Clock = SystemClock(), runner: Runner | None = None,
                          node_checks: Mapping[str, NodeCheck] | None = None,
                          poll_s: float = 0.05, save_prefix: str = "nccl-trace"
                          ) -> CaptureOutcome:
    """Every rank's evidence and the node's checks, together, within one bound ``timeout``.

    The node checks (Xids, health) start first, in threads of their own, each told the time
    left (they bound their collectors by it); the ranks are captured by ``workers`` threads.
    At ``deadline - reap_grace``, on ``clock``, rank captures not started are cancelled,
    running py-spy children are killed (their process groups) and reaped within the grace;
    node checks still running are reported as timed out and left to end by their own limit.
    Nothing waits past the deadline for a straggler.
    """
    started = clock.monotonic()
    deadline = started + timeout
    grace = reap_grace(timeout)
    cut = deadline - grace
    group = ChildGroup()
    checks = dict(node_checks or {})

    def one(v: SlotView) -> RankEvidence:
        ev = RankEvidence(v.rank, v.pid)
        if not same_process(v.pid, v.pid_start, uid):
            ev.stack_error = (f"pid {v.pid} is gone or is not the job's process: no stack")
            return ev
        ev.stack, ev.stack_error = py_spy_dump(py_spy, v.pid, cut - clock.monotonic(), runner,
                                               group)
        left = cut - clock.monotonic()
        if left <= 0:
            ev.nccl_trace = {"error": f"{TIMED_OUT}: flight recorder not triggered"}
            return ev
        try:
            ev.nccl_trace = nccl_flight_recorder(v.pid, v.rank, uid, save_dir_fd,
                                                 wait_s=min(5.0, left / 2), clock=clock,
                                                 save_prefix=save_prefix)
        except OSError as exc:
            ev.nccl_trace = {"error": f"couldn't read environment of pid {v.pid}: {exc}"}
        return ev

    node_pool = cf.ThreadPoolExecutor(max_workers=max(1, len(checks)),
                                      thread_name_prefix="evidence-node")
    node_futs = {name: node_pool.submit(check, max(0.0, cut - clock.monotonic()))
                 for name, check in checks.items()}
    pool = cf.ThreadPoolExecutor(max_workers=max(1, min(workers, len(slots))),
                                 thread_name_prefix="evidence")
    futures = {pool.submit(one, v): v for v in slots}
    everything: set[cf.Future[Any]] = {*futures, *node_futs.values()}
    # Short waits against the clock rather than one long one, so the cut follows the
    # capture's own clock (injected in tests) and not only the time the wait began with.
    while not all(f.done() for f in everything) and (left := cut - clock.monotonic()) > 0:
        cf.wait(everything, timeout=min(left, poll_s))
    done = {f for f in everything if f.done()}
    cut_at = None if len(done) == len(everything) else clock.monotonic()
    # Not `with pool`: its exit waits for every task, which is what made 80 slots with a
    # slow py-spy take minutes. Cancel what has not started, kill what runs, move on.
    pool.shutdown(wait=False, cancel_futures=True)
    node_pool.shutdown(wait=False, cancel_futures=True)
    group.kill_all()
    # Cancelled futures never count as done for cf.wait: wait only for those that ran.
    pending = [f for f in futures if f not in done and not f.cancelled()]
    late, _ = cf.wait(pending, timeout=grace) if pending else (set(), set())
    out: list[RankEvidence] = []
    timed_out: list[int] = []
    for fut, v in futures.items():
        if fut in done:
            out.append(fut.result())
            continue
        timed_out.append(v.rank)
        if fut in late and not fut.cancelled() and fut.exception() is None:
            ev = fut.result()
            if not ev.stack_error.startswith(TIMED_OUT):
                ev.stack_error = f"{TIMED_OUT}: {ev.stack_error or 'captured after deadline'}"
            out.append(ev)
        else:
            out.append(RankEvidence(v.rank, v.pid, stack_error=f"{TIMED_OUT}: not captured "
                                                               f"within {timeout:g}s"))
    node: dict[str, Mapping[str, Any]] = {}
    node_late: list[str] = []
    for name, nfut in node_futs.items():
        if nfut in done and nfut.exception() is None:
            node[name] = nfut.result()
        elif nfut in done:
            node[name] = {"checked": False, "error": f"{name} failed: {nfut.exception()}"}
        else:
            node_late.append(name)
            node[name] = {"checked": False,
                          "error": f"{TIMED_OUT}: {name} not finished within {timeout:g}s"}
    unreaped = tuple(group.running())
    if unreaped:
        log.error("couldn't reap py-spy children at the evidence deadline", pids=list(unreaped))
    if timed_out or node_late:
        log.warning("evidence capture cut off at its deadline", ranks=len(timed_out),
                    node_checks=node_late, timeout_s=timeout)
    return CaptureOutcome(sorted(out, key=lambda e: e.rank), tuple(sorted(timed_out)),
                          group.started, unreaped, node, tuple(node_late), started, deadline,
                          cut_at)


def _optional(module: str) -> Any:
    """A module of another capability, or None when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def xids_since(cfg: Config, node: str, since: float, timeout_s: float | None = None) -> XidsDoc:
    """Xid events since ``since`` (the job's start) from the gate's kernel-log collector,
    within ``timeout_s`` when given (the evidence time left), else the collector limit."""
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
                                 x.window_s, _limit(health.collector_timeout_s, timeout_s))
    except (OSError, CommandError) as exc:
        return {"checked": False, "error": f"couldn't read the kernel log: {exc}"}
    fatal = catalog.fatal_set(x.fatal, x.extra_fatal, x.not_fatal)
    # An undated line can't be placed after the job's start: it never blames this job.
    events = [e for e in snap.events if e.time is not None and e.time >= since]
    findings = []
    for e in events:
        if catalog.is_fatal(e.xid, e.text, fatal):
            when = time.strftime("%H:%M:%S", time.localtime(e.time))
            findings.append(f"PCI {e.pci} XID {e.xid} ({catalog.meaning(e.xid)}) at {when}")
    return {"checked": not snap.error, "error": snap.error or "",
            "events": [{"xid": e.xid, "pci": e.pci, "text": e.text, "time": e.time}
                       for e in events], "findings": findings}


def _limit(configured: float, left: float | None) -> float:
    # A collector given no time at all would still start; a tenth of a second is the least.
    return configured if left is None else max(0.1, min(configured, left))


def health_snapshot(cfg: Config, node: str, timeout_s: float | None = None) -> HealthDoc:
    """The gate's read-only checks now; failed findings count as fresh blame evidence. With
    ``timeout_s`` (the evidence time left) the collectors get no more than that."""
    gate = _optional("slurm_resilience.health.gate")
    if gate is None or getattr(cfg, "health", None) is None:
        return {"checked": False, "error": "health gate not installed: no snapshot"}
    if timeout_s is not None:
        limit = _limit(cfg.health.collector_timeout_s, timeout_s)
        cfg = replace(cfg, health=replace(cfg.health, collector_timeout_s=limit))
    try:
        report = gate.run(cfg, node, "prolog", only=("gpu", "infiniband", "nvme"))
    except Exception as exc:  # noqa: BLE001 - a broken collector must not stop the incident
        return {"checked": False, "error": f"couldn't run the health gate: {exc}"}
    snap = cast(HealthDoc, report.to_dict())
    snap["checked"] = True
    snap["failures"] = [f["message"] for f in snap.get("findings", [])
                        if f.get("severity") == "fail"]
    return snap


def node_findings(xids: XidsDoc, health: HealthDoc) -> list[str]:
    """Fresh findings that can blame this node: fatal Xids since job start, failed checks."""
    return [*xids.get("findings", []), *health.get("failures", [])]

