"""The health gate in the real sandbox: faults drain nodes, jobs move on, healthy nodes return."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from slurm_resilience import config
from slurm_resilience.health.gate import StateStore, state_dir
from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox


@pytest.fixture
def box(sandbox: Sandbox) -> Iterator[Sandbox]:
    """The session sandbox; every node's stand-in hardware is healed afterwards."""
    yield sandbox
    for node in sandbox.nodes:
        faults.heal(sandbox.state_dir, node)


def wait_reason(box: Sandbox, node: str, text: str, timeout: float = 40.0) -> str:
    """Wait until ``node`` is drained with a reason containing ``text``; return the reason."""
    ctl = box.adapter()
    deadline = time.monotonic() + timeout
    while True:
        info = ctl.show_node(node)
        if info.drained and text in info.reason:
            return info.reason
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node} is {info.state}+{sorted(info.flags)} reason "
                               f"{info.reason!r}; expected a drain with {text!r}")
        time.sleep(0.5)


def wait_resumed(box: Sandbox, node: str, timeout: float = 60.0) -> None:
    ctl = box.adapter()
    deadline = time.monotonic() + timeout
    while ctl.show_node(node).drained:
        if time.monotonic() > deadline:
            info = ctl.show_node(node)
            raise TimeoutError(f"{node} still drained after {timeout:g}s: {info.reason!r}")
        time.sleep(0.5)


def wait_health_check_since(box: Sandbox, node: str, since: float, timeout: float = 40.0
                            ) -> None:
    """Wait until a HealthCheckProgram run on ``node`` that started after ``since`` (a
    ``time.time()``) has ended, as its "hook ok" event in the log says."""
    log = box.state_dir / "log" / "slurm-resilience.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        for line in log.read_text().split("\n")[:-1]:  # whole lines: one may be half written
            e = json.loads(line)
            if (e.get("node"), e.get("hook"), e.get("event")) != (node, "healthcheck",
                                                                  "hook ok"):
                continue
            ended = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            if ended - float(e["seconds"]) > since:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no health check on {node} ended within {timeout:g}s")
        time.sleep(0.5)


def test_xid79_drains_node_and_the_job_completes_elsewhere_then_node_resumes(box: Sandbox
                                                                           ) -> None:
    """Xid 79 on node1's GPU 3: the prolog drains node1 naming GPU, Xid and meaning, the
    2-node job is requeued onto other nodes and completes; healed, node1 is resumed by
    the HealthCheckProgram while an admin's "maintenance" drain on node3 is left alone."""
    print(faults.inject(box.state_dir, "node1", "gpu-xid:3:79"))
    job = box.sbatch("srun sh -c 'echo $SLURMD_NODENAME'\n", args=["-N2", "--requeue"])
    reason = wait_reason(box, "node1", "gpu3 XID 79 (GPU fell off the bus)")
    print(f"node1 drained: {reason}")
    assert reason.startswith("SR: health: gpu3 XID 79 (GPU fell off the bus) ")
    info = box.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120, poll=0.5)
    print(f"job {job}: {info.state} on {info.nodes} after {info.restarts} requeue(s)")
    assert info.state == "COMPLETED"
    assert info.restarts >= 1, "the job never landed on node1"
    assert "node1" not in info.nodes and len(info.nodes) == 2
    assert sorted(box.output(job).split()) == sorted(info.nodes)

    drained_at = time.time()
    box.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=maintenance"])
    print(faults.heal(box.state_dir, "node1"))
    started = time.monotonic()
    wait_resumed(box, "node1", timeout=90)
    print(f"node1 resumed by the HealthCheckProgram {time.monotonic() - started:.0f}s "
          "after healing")
    wait_health_check_since(box, "node3", drained_at)
    node3 = box.adapter().show_node("node3")
    assert node3.drained and node3.reason == "maintenance"


def test_ib_port_down_and_full_nvme_drain_with_their_reasons(box: Sandbox) -> None:
    """The HealthCheckProgram drains node2 for an IB port DOWN, node4 for a full NVMe and
    node3 for a filesystem the kernel remounted read-only."""
    print(faults.inject(box.state_dir, "node2", "ib-down:mlx5_2:1"))
    print(faults.inject(box.state_dir, "node4", "nvme-full"))
    print(faults.inject(box.state_dir, "node3", "kernel-log:readonly-remount"))
    ib = wait_reason(box, "node2", "mlx5_2 port1 DOWN")
    nvme = wait_reason(box, "node4", "nvme ")
    ro = wait_reason(box, "node3", "filesystem read-only")
    print(f"node2: {ib}\nnode4: {nvme}\nnode3: {ro}")
    assert ib == "SR: health: mlx5_2 port1 DOWN (expected ACTIVE 400Gb/s)"
    # Committed steps an earlier test's jobs left on node4 may show as reclaimable.
    assert nvme.startswith("SR: health: nvme 0B free ")
    assert nvme.endswith(" of 100.0GiB (expected >=10.0GiB)")
    assert ro.startswith("SR: health: nvme0n1p1 filesystem read-only x1 in the kernel log "
                         "(tolerated 0): EXT4-fs (nvme0n1p1): Remounting")


def test_healthy_prolog_is_silent_and_jobs_run(box: Sandbox) -> None:
    """With healthy stand-ins a 2-node job runs and no node is drained."""
    job = box.sbatch("srun true\n", args=["-N2"])
    assert box.wait_job(job, timeout=60).state == "COMPLETED"
    assert not [n.name for n in box.adapter().list_nodes() if n.drained]


def test_each_nodes_hook_server_runs_its_hooks(box: Sandbox) -> None:
    """slurmd's prolog and epilog are handed to the node's hook server (its agent runs
    one): the job's hooks log their end and none ran in its own process."""
    job = box.sbatch("srun true\n", args=["-N2"])
    assert box.wait_job(job, timeout=60).state == "COMPLETED"
    log = box.state_dir / "log" / "slurm-resilience.jsonl"
    deadline = time.monotonic() + 30
    while True:
        mine = [e for e in map(json.loads, log.read_text().splitlines())
                if e.get("job_id") == job and e.get("component") == "hooks"]
        done = {(e["node"], e["hook"]) for e in mine if e["event"] == "hook ok"}
        if len(done) == 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {h for _, h in done} == {"prolog", "epilog"} and len(done) == 4, mine
    assert not [e for e in mine if "own process" in e["event"]], mine


def test_jobs_held_by_our_failed_prolog_are_released_without_nohold(sandbox_factory: Any
                                                                   ) -> None:
    """Without nohold_on_prolog_fail Slurm holds the requeued job; the healthcheck releases
    it and it runs on the healthy node."""
    box = sandbox_factory(nodes=2, leaves=1,
                          slurm_overrides={"SchedulerParameters": "bf_interval=2"})
    assert "nohold_on_prolog_fail" not in box.slurm_conf.read_text()
    print(faults.inject(box.state_dir, "node1", "gpu-ecc:0"))
    job = box.sbatch("echo ran on $SLURMD_NODENAME\n", args=["-N1", "--requeue"])
    reason = wait_reason(box, "node1", "gpu0 XID 48 (double-bit ECC error)")
    print(f"node1 drained: {reason}")
    info = box.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120, poll=0.5)
    print(f"job {job}: {info.state} on {info.nodes} after {info.restarts} requeue(s)")
    assert info.state == "COMPLETED" and info.nodes == ("node2",) and info.restarts >= 1
    events = (box.state_dir / "log" / "slurm-resilience.jsonl").read_text()
    assert "released job held after our prolog failed" in events


def wait_job_start_recorded(box: Sandbox, node: str, job: int, timeout: float = 30.0) -> float:
    """Wait until the prolog on ``node`` has recorded the job's start (what the epilog
    reads), not merely until Slurm shows RUNNING (it does while the prolog still runs)."""
    cfg = config.load(str(box.resilience_config))
    store = StateStore(state_dir(cfg, node))
    deadline = time.monotonic() + timeout
    while True:
        started = store.load("jobs").get(str(job))
        if started is not None:
            return float(started)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no start of job {job} recorded on {node} after {timeout:g}s "
                               f"(job {box.job(job).state})")
        time.sleep(0.1)


def test_epilog_reports_xids_raised_during_the_job(box: Sandbox) -> None:
    """A non-fatal Xid logged while the job runs is reported by the epilog as raised during
    the job, without a drain; a fatal one drains the node (at the epilog or the next
    health check, whichever runs first)."""
    job = box.sbatch("sleep 4\n", args=["-N1", "-w", "node3"])
    wait_job_start_recorded(box, "node3", job)
    print(faults.inject(box.state_dir, "node3", "gpu-xid:2:43"))
    assert box.wait_job(job, timeout=60).state == "COMPLETED"
    log = box.state_dir / "log" / "slurm-resilience.jsonl"
    deadline = time.monotonic() + 60
    while "XID 43 (GPU stopped processing)" not in log.read_text() \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = [ln for ln in log.read_text().splitlines()
             if "during the job" in ln and '"hook": "epilog"' in ln]
    assert lines, "the epilog did not report the Xid raised during the job"
    assert "gpu2 XID 43 (GPU stopped processing)" in lines[-1]
    assert not box.adapter().show_node("node3").drained

    job = box.sbatch("sleep 4\n", args=["-N1", "-w", "node3"])
    wait_job_start_recorded(box, "node3", job)
    print(faults.inject(box.state_dir, "node3", "gpu-xid:5:119"))
    reason = wait_reason(box, "node3", "gpu5 XID 119 (GSP RPC timeout)", timeout=40)
    print(f"node3 drained: {reason}")
