"""What the healthcheck starts does not outlive slurmd: an idle NCCL verifier stuck in a
hang, and its ranks, end once the slurmd whose health run started them has stopped."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from slurm_resilience.nccl import lifetime, schedule
from slurm_resilience.sandbox import control, daemons, sweep
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


def wait_for(what: str, probe: Callable[[], Any], timeout: float, poll: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(poll)


def ranks_of(parent: int) -> list[sweep.Proc]:
    return [p for p in sweep.processes().values()
            if p.ppid == parent and b"slurm_resilience.nccl.worker"
            in _cmdline(p.pid)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def test_an_idle_verifier_and_its_ranks_end_with_slurmd(sandbox_factory: Any) -> None:
    box: Sandbox = sandbox_factory(nodes=1, leaves=1)
    box.run([str(box.layout.repo / ".venv/bin/slurm-resilience"), "sandbox", "inject",
             "node1", "nccl-hang", "--state-dir", str(box.state_dir)])
    box.update_resilience_config({"nccl": {"enabled": True, "timeout_s": 300}})
    lock = box.node_dir("node1") / "run" / schedule.LOCK_NAME
    holder = wait_for("idle verification of node1",
                      lambda: schedule.holder_pid(str(lock)), 60)
    verifier = sweep.read_proc(holder)
    assert verifier is not None
    ranks = wait_for("ranks started", lambda: ranks_of(holder), 30)
    slurmd = control.slurmd(box.layout, "node1")
    slurmd_pid = slurmd.pid()
    argv = _cmdline(holder).split(b"\0")
    owner = lifetime.Owner.parse(argv[argv.index(b"--owner") + 1].decode())
    assert owner.pid == slurmd_pid
    # slurmd alone goes (as when an admin stops it); slurmctld, munge and the rest stay.
    assert daemons.stop(slurmd)
    wait_for("verifier gone", lambda: not sweep.same(verifier), 60)
    wait_for("ranks gone", lambda: not [r for r in ranks if sweep.same(r)], 30)
    log = box.state_dir / "log" / "slurm-resilience.jsonl"
    assert "nccl: idle verification stopped: slurmd has ended" in log.read_text()
