"""Find and stop every process of one sandbox, pid files or not.

Pid files name the daemons, but not what they start: ``slurmstepd`` (which
clears its environment, reparents to init and ignores SIGTERM), the jobs under
it, and detached helpers such as the idle NCCL verifier and its ranks. A
process is this sandbox's when

* an argument names a path inside the state directory and it has no controlling
  terminal (daemons, jobs and hooks have none; an admin's ``less`` of a log does), or
* its environment says so (``env_match``: the sandbox's own marker variable,
  which the daemons and the healthcheck carry, or a job's ``SLURM_CONF``; never
  a mere ``SLURM_CONF``, which an admin's shell may have exported), or
* it is a Slurm program (``slurmstepd``…) whose working directory or an open
  file lies inside the state directory, or
* its parent is one of the above (ranks, a job's children).

Paths are matched whole, so ``/tmp/sbx1`` never matches ``/tmp/sbx10``: a
sandbox beside this one is never touched. The caller and its ancestors are
never included (``sandbox down`` run from a job or a shell inside the state dir).

Mounts are swept too (:func:`unmount_under`): a job whose epilog never ran leaves its
run-dir tmpfs mounted inside the state directory.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_resilience.log import get_logger
from slurm_resilience.procstat import Proc, read_proc

if TYPE_CHECKING:
    from slurm_resilience.proc import Runner

log = get_logger("sandbox")

# Programs matched by working directory and open files as well (they carry no marker
# in argv or environment). Never a shell: a user's shell may sit inside the state dir.
SLURM_PROGRAMS = frozenset({"slurmstepd", "slurmd", "slurmctld", "slurmdbd", "munged"})
MAX_FDS_LOOKED_AT = 256
POLL_S = 0.05


@dataclass(frozen=True)
class Found:
    """A process of the sandbox and why it counts as one."""

    proc: Proc
    why: str


def processes(proc: str = "/proc") -> dict[int, Proc]:
    out = {}
    for entry in os.listdir(proc):
        if entry.isdigit():
            found = read_proc(int(entry), proc)
            if found is not None:
                out[found.pid] = found
    return out


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


@functools.lru_cache(maxsize=16)
def _marker_re(root: str) -> re.Pattern[str]:
    # The state dir as a whole path: at the start of an argument or after '=' / ':' / ','
    # (--socket=/x/…, A:B lists), and followed by '/' or the end of the path.
    return re.compile(r"(?:^|[=:,\s])" + re.escape(root) + r"(?:/|$|[:,\s])")


def names_path_in(arg: str, root: str) -> bool:
    """Whether the argument ``arg`` names ``root`` or a path inside it."""
    return bool(_marker_re(root).search(arg))


def _argv(pid: int, proc: str) -> list[str]:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _environ(pid: int, proc: str) -> dict[str, str]:
    try:
        with open(f"{proc}/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _links(pid: int, proc: str) -> Iterable[str]:
    """The working directory and (a bounded number of) open files of ``pid``."""
    try:
        names = ["cwd"] + [f"fd/{fd}" for fd in os.listdir(f"{proc}/{pid}/fd")]
    except OSError:
        names = ["cwd"]
    for name in names[:MAX_FDS_LOOKED_AT]:
        try:
            yield os.readlink(f"{proc}/{pid}/{name}")
        except OSError:
            continue


def _ancestors(pid: int, table: Mapping[int, Proc]) -> set[int]:
    out = set()
    while pid in table and pid not in out and pid > 1:
        out.add(pid)
        pid = table[pid].ppid
    return out


EnvMatch = Callable[[Mapping[str, str]], bool]


def find(state_dir: Path, env_match: EnvMatch, *, proc: str = "/proc",
         exclude: Iterable[int] = ()) -> list[Found]:
    """Every live process of the sandbox in ``state_dir`` (see the module's doc).

    ``env_match``: whether a process's environment marks it as the sandbox's.
    """
    root = os.path.realpath(state_dir)
    roots = {root, str(Path(state_dir).absolute())}
    patterns = [_marker_re(r) for r in roots]
    table = processes(proc)
    skip = _ancestors(os.getpid(), table) | set(exclude)
    found: dict[int, Found] = {}
    for p in table.values():
        if p.pid in skip:
            continue
        why = ""
        argv = _argv(p.pid, proc)
        if not p.tty and any(pat.search(a) for a in argv for pat in patterns):
            why = "argv"
        elif env_match(_environ(p.pid, proc)):
            why = "environment"
        elif p.comm in SLURM_PROGRAMS and any(_inside(link, r) for link in _links(p.pid, proc)
                                              for r in roots):
            why = "cwd/open file"
        if why:
            found[p.pid] = Found(p, why)
    # Children of ours are ours (a verifier's ranks, a job's processes).
    children: dict[int, list[Proc]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child.pid not in found and child.pid not in skip:
                found[child.pid] = Found(child, f"child of {child.ppid}")
                todo.append(child.pid)
    return sorted(found.values(), key=lambda f: f.proc.pid)


def same(p: Proc, proc: str = "/proc") -> bool:
    """Whether ``p`` still runs (same pid, same start time, not a zombie)."""
    now = read_proc(p.pid, proc)
    return now is not None and now.start == p.start


def _signal(p: Proc, sig: signal.Signals) -> None:
    if same(p):
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            log.error("sandbox: not allowed to signal a process of the sandbox", pid=p.pid,
                      comm=p.comm, signal=sig.name)


def stop(state_dir: Path, env_match: EnvMatch, *, grace: float = 5.0,
         rounds: int = 3, exclude: Iterable[int] = ()) -> tuple[list[Found], list[Found]]:
    """TERM every process of the sandbox, KILL what is left after ``grace`` (slurmstepd
    ignores TERM), and look again (a process may have started a child meanwhile).

    Returns (stopped, left): what was found, and what still runs after ``rounds`` passes.
    """
    stopped: dict[int, Found] = {}
    for _ in range(rounds):
        batch = find(state_dir, env_match, exclude=exclude)
        if not batch:
            return list(stopped.values()), []
        for f in batch:
            stopped.setdefault(f.proc.pid, f)
            _signal(f.proc, signal.SIGTERM)
        _wait_gone([f.proc for f in batch], grace)
        survivors = [f for f in batch if same(f.proc)]
        for f in survivors:
            log.warning("process ignored SIGTERM; killing", pid=f.proc.pid, comm=f.proc.comm,
                        why=f.why)
            _signal(f.proc, signal.SIGKILL)
        _wait_gone([f.proc for f in survivors], 5.0)
    left = find(state_dir, env_match, exclude=exclude)
    if left:
        log.error("processes of the sandbox still running", pids=[f.proc.pid for f in left])
    return list(stopped.values()), left


def _wait_gone(procs: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(same(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _unescape_mount_path(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in a path as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(root: Path, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points inside ``root`` (whole paths: a sibling directory never matches),
    deepest first so nested mounts come off before their parents."""
    base = os.path.realpath(root)
    found: list[str] = []
    with open(mountinfo, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            fields = line.split(" ")
            if len(fields) > 4:
                point = _unescape_mount_path(fields[4])
                if point != base and _inside(point, base):
                    found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(root: Path, *, runner: Runner | None = None) -> tuple[list[str], list[str]]:
    """Detach (MNT_DETACH) every mount inside ``root``; returns (detached, failed)."""
    from slurm_resilience.proc import CommandError, Runner

    run = runner or Runner(env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})
    detached: list[str] = []
    failed: list[str] = []
    for point in mounts_under(root):
        try:
            run.run(["umount", "--lazy", "--no-canonicalize", point], timeout=10)
            detached.append(point)
        except CommandError as exc:
            log.error("couldn't unmount a mount left in the sandbox", path=point,
                      error=str(exc))
            failed.append(point)
    return detached, failed
