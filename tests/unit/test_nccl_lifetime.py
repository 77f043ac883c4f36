"""The idle verifier never outlives the slurmd that ran the healthcheck which started it."""

from __future__ import annotations

import json
import subprocess
import sys

from slurm_resilience.nccl import lifetime, steps, verify

# A process renamed like slurmd (comm is what /proc/<pid>/stat shows), running ``child``.
AS_SLURMD = """
import ctypes, subprocess, sys
ctypes.CDLL(None).prctl(15, b"slurmd", 0, 0, 0)   # PR_SET_NAME
sys.exit(subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]]).returncode)
"""
HEALTHCHECK = """
import json, os
from slurm_resilience.nccl import lifetime
owner = lifetime.find_owner()
print(json.dumps({"owner": owner.pid if owner else None, "ppid": os.getppid()}))
"""


def test_the_owner_is_the_outermost_slurmd_above_the_health_run() -> None:
    """slurmd forks a short-lived copy of itself to run HealthCheckProgram: the owner is
    the daemon, not that copy, which ends with the health run."""
    inner = [sys.executable, "-c", AS_SLURMD, HEALTHCHECK]
    outer = subprocess.Popen([sys.executable, "-c", AS_SLURMD, AS_SLURMD, *inner[2:]],
                             stdout=subprocess.PIPE, text=True)
    out, _ = outer.communicate(timeout=60)
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["owner"] == outer.pid and seen["ppid"] != outer.pid


def test_no_owner_when_run_by_hand() -> None:
    out = subprocess.run([sys.executable, "-c", HEALTHCHECK], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out)["owner"] is None


WATCHER = """
import sys, time
from slurm_resilience.nccl import lifetime
lifetime.watch(lifetime.Owner.parse(sys.argv[1]), lambda: print("gone", flush=True),
               poll_s=0.05, exit_grace_s=0)
print("watching", flush=True)
time.sleep(600)
"""


def test_a_watcher_exits_once_its_owner_has_ended() -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        stat = lifetime.read_proc(owner.pid, "/proc")
        assert stat is not None
        me = lifetime.Owner(owner.pid, stat.start)
        watcher = subprocess.Popen([sys.executable, "-c", WATCHER, me.arg()],
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert watcher.stdout is not None
        assert watcher.stdout.readline().strip() == "watching"
        assert watcher.poll() is None
    finally:
        owner.kill()
        owner.wait(timeout=30)
    assert watcher.wait(timeout=60) == lifetime.EXIT_OWNER_GONE
    assert watcher.stdout.read().strip() == "gone"
    watcher.stdout.close()


def test_a_recycled_pid_is_not_the_owner() -> None:
    stat = lifetime.read_proc(1, "/proc")
    assert stat is not None
    assert lifetime.alive(lifetime.Owner(1, stat.start))
    assert not lifetime.alive(lifetime.Owner(1, stat.start + 1))


def test_the_verifier_does_not_start_once_its_owner_has_ended() -> None:
    """Before reading any config (a missing one would be EXIT_ERROR)."""
    assert verify.main(["--node", "n1", "--config", "/nonexistent/x.yaml",
                        "--owner", "999999999:1"]) == verify.EXIT_OK


def test_the_healthcheck_names_the_owner_on_the_verifier_command_line() -> None:
    class Ctx:
        node = "n1"
        env: dict[str, str] = {}

    argv = steps.verifier_argv(Ctx(), lifetime.Owner(12, 34))  # type: ignore[arg-type]
    assert argv[argv.index("--owner") + 1] == "12:34"
