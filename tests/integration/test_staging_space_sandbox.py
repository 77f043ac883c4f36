"""Staging capacity in the sandbox: a finished job's local-only step that fills a node's
stand-in NVMe never takes the node out of service and is evicted; a node drained while a
running job filled it returns by itself once the job ends."""

from __future__ import annotations

import shutil
import time

import pytest

from slurm_resilience.checkpoint import reclaim_record
from slurm_resilience.checkpoint.commit import step_name
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.slurmconf import HEALTH_CHECK_INTERVAL_S

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

HEALTH_INTERVAL_S = float(HEALTH_CHECK_INTERVAL_S)  # the sandbox's HealthCheckInterval
# The running job outlives several health-check passes, with room for a loaded machine.
JOB_S = 30


def test_finished_jobs_step_filling_the_nvme_does_not_drain_the_node(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A local-only job commits a small step and ends; its user then grows the step to
    95 GiB of node2's 100 GiB stand-in disk (min_free 10 GiB): over two health-check
    intervals node2 is never drained, and the agent evicts the step (over its quota)."""
    user, node = test_users[0], "node2"
    nvme = sandbox.node_dir(node) / "nvme"
    wd = sandbox.user_dir(user, "staging-space")
    script = ("#!/bin/sh\nset -e\n"
              f"d={nvme}/job-$SLURM_JOB_ID/{step_name(1)}\nmkdir -p $d\n"
              "head -c 4096 /dev/zero > $d/rank-00000.bin\necho '{}' > $d/COMMIT.json\n")
    job = sandbox.sbatch(script, user=user, args=[f"--nodelist={node}", "-N1",
                                                   f"--output={wd}/slurm-%j.out"])
    step_dir = nvme / f"job-{job}" / step_name(1)
    try:
        assert sandbox.wait_job(job, timeout=60).state == "COMPLETED"
        record = reclaim_record.path(str(sandbox.node_dir(node) / "state"))
        deadline = time.monotonic() + 30
        while f"job-{job}" not in _text(record):  # the agent saw the job end
            assert time.monotonic() < deadline, _text(record)
            time.sleep(0.5)
        assert step_dir.is_dir()
        sandbox.run(["truncate", "-s", "95G", str(step_dir / "rank-00000.bin")], user=user)
        filled = time.monotonic()
        ctl, out_s, evicted_after = sandbox.adapter(), 0.0, None
        while time.monotonic() - filled < 2 * HEALTH_INTERVAL_S + 2:
            info = ctl.show_node(node)
            if info.drained:
                out_s += 0.5
                print(f"{node} drained: {info.reason!r}")
            if evicted_after is None and not step_dir.exists():
                evicted_after = time.monotonic() - filled
            time.sleep(0.5)
        deadline = filled + 180  # the agent's space pass runs every 10 s, beside uploads
        while evicted_after is None and step_dir.exists():
            assert time.monotonic() < deadline, "the finished job's step was never evicted"
            time.sleep(0.5)
        if evicted_after is None:
            evicted_after = time.monotonic() - filled
        print(f"{node} out of service {out_s:.1f}s over {2 * HEALTH_INTERVAL_S + 2:.0f}s "
              f"after a finished job filled its NVMe; step evicted after "
              f"{evicted_after:.1f}s")
        assert out_s == 0.0
    finally:
        shutil.rmtree(nvme / f"job-{job}", ignore_errors=True)


def test_node_drained_for_a_running_jobs_step_returns_once_the_job_ends(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A running job's newest step filling node3's stand-in NVMe is not reclaimable: the
    gate drains node3; once the job ends the step is evicted and node3 returns by itself."""
    user, node = test_users[0], "node3"
    nvme = sandbox.node_dir(node) / "nvme"
    wd = sandbox.user_dir(user, "staging-space")
    script = ("#!/bin/sh\nset -e\n"
              f"d={nvme}/job-$SLURM_JOB_ID/{step_name(1)}\nmkdir -p $d\n"
              "truncate -s 95G $d/rank-00000.bin\necho '{}' > $d/COMMIT.json\n"
              f"sleep {JOB_S}\n")
    job = sandbox.sbatch(script, user=user, args=[f"--nodelist={node}", "-N1",
                                                   f"--output={wd}/slurm-%j.out"])
    ctl = sandbox.adapter()
    try:
        deadline = time.monotonic() + 60
        while not ctl.show_node(node).drained:
            assert time.monotonic() < deadline, ctl.show_node(node)
            time.sleep(0.5)
        reason = ctl.show_node(node).reason
        print(f"{node} drained while job {job} runs: {reason!r}")
        assert "nvme" in reason
        assert sandbox.wait_job(job, timeout=90).state == "COMPLETED"
        ended = time.monotonic()
        deadline = ended + 120
        while ctl.show_node(node).drained:
            assert time.monotonic() < deadline, ctl.show_node(node)
            time.sleep(0.5)
        back = time.monotonic() - ended
        print(f"{node} back in service {back:.1f}s after the job ended "
              f"(health.resume_after_passes passing runs, {HEALTH_INTERVAL_S:.0f}s apart)")
        step = nvme / f"job-{job}" / step_name(1)
        deadline = ended + 180  # evicted under the pressure it makes (the space pass: 10 s)
        while step.exists():
            assert time.monotonic() < deadline, "the ended job's step was never evicted"
            time.sleep(0.5)
    finally:
        shutil.rmtree(nvme / f"job-{job}", ignore_errors=True)


def _text(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except FileNotFoundError:
        return ""
