"""The sandbox and the Slurm adapter against real slurmctld, slurmd and munge."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_resilience.sandbox import control, sweep
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.slurm.errors import ForeignDrain

pytestmark = pytest.mark.sandbox


def reason_in_sinfo(sandbox: Sandbox, node: str) -> str:
    out = sandbox.run(["sinfo", "-R", "-h", "-N", "-n", node, "-o", "%N|%E"]).stdout
    # sinfo -N prints a node once per partition it is in (debug and urgent): one reason.
    reasons = {line.split("|", 1)[1] for line in out.splitlines() if line.startswith(node)}
    assert len(reasons) <= 1, out
    return reasons.pop() if reasons else ""


def test_four_nodes_come_up_and_run_a_two_node_srun(sandbox: Sandbox) -> None:
    """All four nodes are IDLE with their leaf feature and a 2-node srun runs on two of them."""
    nodes = sandbox.adapter().list_nodes()
    assert [n.name for n in nodes] == ["node1", "node2", "node3", "node4"]
    assert all(control.ready(n) for n in nodes)
    assert [n.features for n in nodes] == [("leaf01",), ("leaf01",), ("leaf02",), ("leaf02",)]
    out = sandbox.run(["srun", "-N2", "-n2", "sh", "-c", "echo $SLURMD_NODENAME"], timeout=60)
    names = sorted(out.stdout.split())
    assert len(names) == 2 and len(set(names)) == 2
    assert set(names) <= set(sandbox.nodes)


def test_adapter_drains_and_resumes_a_node(sandbox: Sandbox) -> None:
    """Our drain shows in sinfo -R with the SR: prefix, and resume brings the node back."""
    ctl = sandbox.adapter()
    ctl.drain("node2", "test: disk on fire")
    assert reason_in_sinfo(sandbox, "node2") == "SR: test: disk on fire"
    assert ctl.show_node("node2").drained
    assert ctl.resume("node2") is True
    node = ctl.show_node("node2")
    assert not node.drained and node.state == "IDLE"
    # slurmctld pings a resumed node first (IDLE+NOT_RESPONDING for a moment).
    sandbox.wait_nodes_ready(timeout=60)
    assert reason_in_sinfo(sandbox, "node2") == ""


def test_adapter_refuses_to_resume_an_admin_drain(sandbox: Sandbox) -> None:
    """A node an admin drained with their own reason stays drained with that reason."""
    sandbox.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=maintenance"])
    ctl = sandbox.adapter()
    with pytest.raises(ForeignDrain, match="maintenance"):
        ctl.resume("node3")
    with pytest.raises(ForeignDrain):
        ctl.drain("node3", "our own reason")
    node = ctl.show_node("node3")
    assert node.drained and node.reason == "maintenance"
    assert reason_in_sinfo(sandbox, "node3") == "maintenance"


def test_adapter_requeues_a_running_batch_job_which_runs_again(sandbox: Sandbox) -> None:
    """A requeued running job starts again: Restarts=1 and its appended output shows two runs."""
    job = sandbox.sbatch("echo run $SLURM_RESTART_COUNT on $SLURMD_NODENAME\nsleep 300\n",
                         args=["--open-mode=append", "--requeue", "-N1"])
    sandbox.wait_job(job, {"RUNNING"}, timeout=60)
    deadline = time.monotonic() + 60
    while "run" not in sandbox.output(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    sandbox.adapter().requeue(job)
    info = sandbox.wait_job(job, {"RUNNING"}, timeout=90, poll=0.5)
    assert info.restarts == 1
    deadline = time.monotonic() + 60
    while sandbox.output(job).count("run") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [ln for ln in sandbox.output(job).splitlines() if ln.startswith("run")]
    assert len(lines) == 2, sandbox.output(job)
    assert lines[1].startswith("run 1 on node")


DETACHED = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # like slurmstepd
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)   # like a verifier's rank
print(child.pid, flush=True)
time.sleep(600)
"""


def _detached(env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    """A process in its own session that ignores SIGTERM and has a child (an idle
    verifier and its rank, as the healthcheck starts them); returns it and its child's pid."""
    proc = subprocess.Popen([sys.executable, "-c", DETACHED], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, start_new_session=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def running_job_steps(box: Sandbox, node: str) -> tuple[int, list[sweep.Proc]]:
    """A job running on ``node``, and its slurmstepd processes."""
    job = box.sbatch("sleep 300\n", args=["-N1", "-w", node])
    box.wait_job(job, {"RUNNING"}, timeout=60)
    steps: list[sweep.Proc] = []
    deadline = time.monotonic() + 30
    while not steps and time.monotonic() < deadline:
        steps = [f.proc for f in sweep.find(box.state_dir, control.env_match(box.layout))
                 if f.proc.comm == "slurmstepd"]
        time.sleep(0.1)
    assert steps, "no slurmstepd of the running job found"
    return job, steps


def test_down_cancels_jobs_so_their_epilogs_run(sandbox_factory: object) -> None:
    assert callable(sandbox_factory)
    box = sandbox_factory(nodes=1, leaves=1)
    job, steps = running_job_steps(box, "node1")
    box.stop()
    assert not [p for p in steps if sweep.same(p)], "slurmstepd left running"
    log = box.state_dir / "log" / "slurm-resilience.jsonl"
    epilogs = [e for e in map(json.loads, log.read_text().splitlines())
               if e.get("hook") == "epilog" and e.get("job_id") == job]
    assert epilogs, "the job was not cancelled before slurmd stopped (no epilog ran)"


def test_down_leaves_no_process_of_ours(sandbox_factory: object) -> None:
    """After down, no pid from the pid files is alive and no process of the sandbox is left,
    even with slurmctld already gone (no job can be cancelled): the running job and its
    slurmstepd (which ignores SIGTERM), detached helpers carrying the sandbox's marker
    (ignoring SIGTERM) and their children. A process of a sandbox whose state dir merely
    starts with the same characters is left alone."""
    assert callable(sandbox_factory)
    box = sandbox_factory(nodes=2, leaves=1)
    daemons = control.all_daemons(box.layout)
    pids = [d.pid() for d in daemons]
    assert all(pids), dict(zip([d.name for d in daemons], pids, strict=True))
    _job, steps = running_job_steps(box, "node1")
    assert control.daemons.stop(control.slurmctld(box.layout))
    ours, rank = _detached({control.SANDBOX_ENV: str(box.state_dir)})
    sibling = f"{box.state_dir}0"  # another sandbox's state dir, same prefix
    other, other_rank = _detached({control.SANDBOX_ENV: sibling, "SLURM_CONF": sibling})
    try:
        stopped = box.stop()
        assert {d.name for d in daemons} - {"slurmctld"} <= set(stopped)
        assert {f"slurmstepd[{p.pid}]" for p in steps} <= set(stopped)
        for pid in pids:
            assert pid is not None and not control.daemons.alive(pid)
        assert ours.wait(timeout=30) == -signal.SIGKILL
        assert not [p for p in steps if sweep.same(p)], "slurmstepd left running"
        assert sweep.read_proc(rank) is None, "the helper's child left running"
        assert other.poll() is None and sweep.read_proc(other_rank) is not None
        marker = str(box.state_dir)
        leftovers = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and control.daemons.alive(int(proc.name)):
                argv = control.daemons.cmdline(int(proc.name))
                if any(marker + "/" in a or a == marker for a in argv):
                    leftovers.append((proc.name, argv))
        assert leftovers == []
        assert sweep.find(box.state_dir, control.env_match(box.layout)) == []
        assert not list((box.state_dir / "run").glob("*.pid"))
    finally:
        for helper, child in ((ours, rank), (other, other_rank)):
            for pid in (child, helper.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            helper.wait(timeout=30)
            assert helper.stdout is not None
            helper.stdout.close()


def test_job_of_an_unprivileged_user_runs_as_that_user(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A test user's job runs under their uid and can run this checkout's venv Python."""
    import pwd
    import sys

    user = test_users[0]
    job = sandbox.sbatch(f"id -un\n{sys.executable} -c 'import slurm_resilience; print(\"ok\")'\n",
                         user=user)
    info = sandbox.wait_job(job, timeout=60)
    assert info.state == "COMPLETED", sandbox.output(job)
    assert info.uid == pwd.getpwnam(user).pw_uid
    assert sandbox.output(job).split() == [user, "ok"]


def test_cli_env_prints_exports_for_slurm_and_s3(sandbox: Sandbox) -> None:
    """`sandbox env` prints SLURM_CONF and the S3 endpoint, bucket and keys of this sandbox."""
    import sys

    out = sandbox.run([sys.executable, "-m", "slurm_resilience", "sandbox", "env",
                       "--state-dir", str(sandbox.state_dir)]).stdout
    assert f"export SLURM_CONF={sandbox.slurm_conf}" in out
    assert f"export AWS_ENDPOINT_URL={sandbox.s3.endpoint}" in out
    assert f"export AWS_ACCESS_KEY_ID={sandbox.s3.access_key}" in out
    assert "export S3_BUCKET=ckpt" in out
    assert (sandbox.state_dir / "s3" / "ckpt").is_dir()
