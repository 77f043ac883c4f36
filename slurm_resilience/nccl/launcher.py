"""Start the ranks, enforce the hard timeout, kill everything left, classify the attempt.

Each rank runs in its own session (``start_new_session``), so killing its
process group takes whatever it started with it; after every attempt the
launcher kills every rank's group, reaps them, and checks ``/proc`` that no
process of those sessions is left. Ranks write to files, not pipes, so a rank
logging a lot (``NCCL_DEBUG=INFO``) can never block on a full pipe.

This module does not import torch: the ranks do.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from slurm_resilience import proc
from slurm_resilience.log import get_logger
from slurm_resilience.nccl.cache import AttemptDoc

log = get_logger("nccl")

Status = Literal["ok", "wrong", "timeout", "crashed", "unavailable", "aborted"]
# After one rank fails, the others are usually stuck in the collective: give them this
# long to report before they are killed (they have nothing more to say).
CRASH_GRACE_S = 3.0
POLL_S = 0.02


@dataclass(frozen=True)
class LaunchSpec:
    """One attempt of the test: how many ranks, what to all_reduce, under which limit."""

    ranks: int
    backend: str
    sizes: tuple[int, ...]
    timeout_s: float
    warmup: int = 5
    iters: int = 20
    env: Mapping[str, str] = field(default_factory=dict)
    fault_file: str = ""
    python: str = ""
    nice: int = 0

    def argv(self, rank: int, store: str) -> list[str]:
        return [
            self.python or sys.executable, "-I", "-m", "slurm_resilience.nccl.worker",
            "--rank", str(rank), "--world", str(self.ranks), "--backend", self.backend,
            "--store", store, "--sizes", ",".join(str(s) for s in self.sizes),
            "--warmup", str(self.warmup), "--iters", str(self.iters),
            # The rank's own deadline is a backstop behind ours.
            "--deadline-s", f"{self.timeout_s + 30:g}",
            "--fault-file", self.fault_file, "--nice", str(self.nice),
        ]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank reported (its JSON line) and how it ended."""

    rank: int
    returncode: int | None
    report: Mapping[str, Any]
    stderr_tail: str = ""

    @property
    def label(self) -> str:
        return str(self.report.get("label", f"rank{self.rank}"))

    @property
    def error(self) -> str:
        return str(self.report.get("error", ""))


@dataclass(frozen=True)
class Attempt:
    """One attempt: its status, why, the ranks' reports, and any process left behind."""

    status: Status
    detail: str
    seconds: float
    ranks: tuple[RankOutcome, ...]
    leftovers: tuple[int, ...] = ()

    def to_json(self) -> AttemptDoc:
        return {
            "status": self.status, "detail": self.detail, "seconds": round(self.seconds, 3),
            "leftovers": list(self.leftovers),
            "ranks": [{"rank": r.rank, "returncode": r.returncode, **dict(r.report)}
                      for r in self.ranks],
        }


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(fh.tell() - limit, 0))
            return fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _last_json(path: str) -> dict[str, object]:
    """The rank's report: the last JSON object line of its stdout."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict):
                return data
    return {}


def session_members(sids: set[int], proc: str = "/proc") -> list[int]:
    """Pids of live processes whose session is one of ``sids`` (field 6 of /proc/PID/stat)."""
    found = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue  # exited while we looked
        # comm (field 2) may hold spaces and parentheses: split after the last ')'.
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) > 4 and rest[0] != "Z" and int(rest[3]) in sids:
            found.append(int(entry))
    return sorted(found)


def _kill_sessions(procs: list[proc.Child[bytes]]) -> tuple[int, ...]:
    """SIGKILL every rank's process group, reap the ranks, return whatever is still alive."""
    sids = {p.pid for p in procs}
    for p in procs:
        # A group already gone has nothing left to kill.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except proc.TimeoutExpired:
            log.error("nccl: cleanup: couldn't reap rank", pid=p.pid)
    # Grandchildren are reaped by init; give them a moment to disappear from /proc.
    deadline = time.monotonic() + 2.0
    left = session_members(sids)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = session_members(sids)
    if left:
        log.error("nccl: cleanup: processes left after kill", pids=left)
    return tuple(left)


def classify(reports: list[RankOutcome], timed_out: bool, timeout_s: float) -> tuple[Status, str]:
    """Status and detail of an attempt from its ranks (pure)."""
    wrong = [r for r in reports if any(int(x.get("mismatches", 0)) > 0
                                       for x in r.report.get("results", ()))]
    if wrong:
        return "wrong", ",".join(r.label for r in wrong)
    if timed_out:
        return "timeout", f"timed out after {timeout_s:g}s"
    unavailable = [r for r in reports if r.report.get("phase") == "import"]
    if unavailable:
        return "unavailable", f"rank {unavailable[0].rank}: {unavailable[0].error}"
    for r in reports:
        if r.returncode != 0 or "error" in r.report or "results" not in r.report:
            why = r.error or (r.stderr_tail.strip().splitlines() or [""])[-1]
            where = f" in {r.report['phase']}" if r.report.get("phase") else ""
            return "crashed", f"rank {r.rank} exited {r.returncode}{where}: {why}"[:300]
    return "ok", ""


# Passed on from the caller's environment; everything else is left out. A prolog's
# environment carries job-controlled values (SPANK_*), which must not reach root's ranks,
# and a CUDA_VISIBLE_DEVICES from an operator's shell would hide GPUs the test counts.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "HOME")
PASSED_PREFIXES = ("NCCL_",)
DEFAULT_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def rank_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment (pure): an allowlist of ``base``, then ``extra`` (config)."""
    env = {k: v for k, v in base.items() if k in PASSED_ENV or k.startswith(PASSED_PREFIXES)}
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("OMP_NUM_THREADS", "1")
    # CUDA numbers GPUs fastest-first by default; PCI order makes rank i the GPU that
    # nvidia-smi, NVML and the health gate call gpu i, so "wrong result on gpu5" means one GPU.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(extra)
    return env


def run_once(spec: LaunchSpec, stop: threading.Event | None = None) -> Attempt:
    """Start ``spec.ranks`` ranks, wait up to ``spec.timeout_s``, kill what is left."""
    if spec.ranks < 1:
        raise ValueError(f"nccl: launch: need at least one rank, got {spec.ranks}")
    workdir = tempfile.mkdtemp(prefix="sr-nccl-")
    store = os.path.join(workdir, "rendezvous")
    env = rank_env(os.environ, spec.env)
    procs: list[proc.Child[bytes]] = []
    started = time.monotonic()
    timed_out = aborted = False
    try:
        for rank in range(spec.ranks):
            with open(os.path.join(workdir, f"{rank}.out"), "wb") as out, \
                    open(os.path.join(workdir, f"{rank}.err"), "wb") as err:
                procs.append(proc.spawn(spec.argv(rank, store), stdout=out, stderr=err,
                                        env={**env, "LOCAL_RANK": str(rank)}, cwd=workdir))
        deadline = started + spec.timeout_s
        first_failure: float | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if stop is not None and stop.is_set():
                aborted = True
                break
            if now >= deadline:
                timed_out = True
                break
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            if first_failure is not None and now - first_failure > CRASH_GRACE_S:
                break
            time.sleep(POLL_S)
    finally:
        leftovers = _kill_sessions(procs)
    seconds = time.monotonic() - started
    reports = [
        RankOutcome(rank, p.returncode, _last_json(os.path.join(workdir, f"{rank}.out")),
                    _tail(os.path.join(workdir, f"{rank}.err")))
        for rank, p in enumerate(procs)
    ]
    shutil.rmtree(workdir, ignore_errors=True)
    if aborted:
        return Attempt("aborted", "stopped: a job arrived", seconds, tuple(reports), leftovers)
    status, detail = classify(reports, timed_out, spec.timeout_s)
    log.info("nccl attempt", status=status, detail=detail, seconds=round(seconds, 3),
             ranks=spec.ranks, leftovers=list(leftovers))
    return Attempt(status, detail, seconds, tuple(reports), leftovers)
