#!/usr/bin/env python3
"""The main scenario on a local sandbox cluster, narrated (``make demo``).

1. Bring up a real 4-node Slurm cluster on loopback (``.sandbox/``): munge,
   slurmctld, four ``slurmd -N``, an S3 endpoint and one node agent per node.
2. Run a 2-node job: this checkout's prolog and epilog run on both nodes.
3. A GPU falls off the bus on node1 (Xid 79 in its stand-in hardware). The health
   gate (the periodic health check, or the prolog of a job landing there first)
   drains node1 with a reason naming the GPU and the Xid; a job whose prolog failed
   is requeued onto healthy nodes with nobody touching it.
   Once the fault is repaired, the periodic health check returns node1 to service.
4. A real PyTorch training job (2 nodes, gloo) checkpoints through the staging
   API; one rank hangs. The node agent sees the stall, captures evidence, drains
   the node it blames and requeues the job, which resumes from its last
   checkpoint (synced to S3 meanwhile) and finishes.
5. An admin's own drain is never touched; ours is resumed.

The sandbox stays up afterwards so you can look around; the last lines say how.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slurm_resilience import log  # noqa: E402
from slurm_resilience.sandbox import control, faults  # noqa: E402
from slurm_resilience.sandbox.handle import Sandbox  # noqa: E402
from slurm_resilience.sandbox.layout import Layout  # noqa: E402
from slurm_resilience.slurm.errors import ForeignDrain  # noqa: E402

PYTHON = REPO / ".venv" / "bin" / "python"
TRAIN = REPO / "examples" / "train.py"


def say(step: str, text: str) -> None:
    print(f"\n== {step}: {text}", flush=True)


def show(box: Sandbox, argv: list[str]) -> str:
    out = box.run(argv, timeout=60).stdout
    print("   $ " + " ".join(argv))
    for line in out.rstrip().splitlines():
        print("   " + line)
    return out


def wait_for(what: str, pred: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"demo: {what} did not happen within {timeout:g}s")


def gate(box: Sandbox) -> None:
    say("3", "node1's GPU 3 falls off the bus (Xid 79); a 2-node job arrives")
    print("   whichever runs first, the periodic health check or the job's prolog, drains node1")
    print("   " + faults.inject(box.state_dir, "node1", "gpu-xid:3:79"))
    job = box.sbatch(["sh", "-c", "echo ran on $SLURM_JOB_NODELIST"], args=["-N2"])
    done = box.wait_job(job, timeout=120)
    print(f"   job {job}: {done.state} after {done.restarts} requeue(s); "
          f"output: {box.output(job).strip()}")
    show(box, ["sinfo", "-R", "-o", "%N %E"])
    print("   the fault is repaired (a reboot, in the stand-ins); the health check "
          "resumes node1 after consecutive passes")
    print("   " + faults.heal(box.state_dir, "node1"))
    ctl = box.adapter()
    started = time.monotonic()
    wait_for("node1's return to service", lambda: not ctl.show_node("node1").drained, 120)
    print(f"   node1 back in service {time.monotonic() - started:.0f}s later")


def _incident(box: Sandbox, job: int) -> dict[str, object] | None:
    for node in box.nodes:
        d = box.node_dir(node) / "state" / "incidents"
        for f in sorted(d.glob(f"hang-job{job}-*.json")) if d.exists() else []:
            report: dict[str, object] = json.loads(f.read_text())
            if (report.get("decision") or {}).get("action") == "requeue":  # type: ignore[union-attr]
                return report
    return None


def hang(box: Sandbox) -> None:
    say("4", "a 2-node PyTorch job checkpoints every 5 steps; rank 1 hangs at step 12")
    uri = f"s3://ckpt/root/demo-{time.strftime('%H%M%S')}"
    script = (f"#!/bin/sh\nexport SLURM_RESILIENCE_CKPT_URI={uri}\n"
              f"srun --kill-on-bad-exit=1 -N2 -n2 {PYTHON} -u {TRAIN} --state-mb 1 "
              "--steps 20 --ckpt-every 5 --hang-at-step 12 --hang-rank 1\n")
    job = box.sbatch(script, args=["-N2", "--requeue", "--open-mode=append"])
    print(f"   job {job}: sbatch -N2 --requeue --open-mode=append, "
          f"SLURM_RESILIENCE_CKPT_URI={uri}")
    report = wait_for("the hang decision", lambda: _incident(box, job), 180)
    assert isinstance(report, dict)
    blame = report.get("blame") or {}
    print(f"   agent: {report.get('summary') or 'hang detected'}")
    for node, reason in blame.get("drains", []):  # type: ignore[union-attr]
        print(f"   drained {node}: {reason}")
    done = box.wait_job(job, timeout=240)
    lines = box.output(job).splitlines()
    for line in lines:
        if re.search(r"checkpoint step=|hanging|resum|^done", line):
            print("   | " + line)
    print(f"   job {job}: {done.state}, restarts={done.restarts}")
    show(box, [str(PYTHON), "-m", "slurm_resilience", "--config", str(box.resilience_config),
               "ckpt", "ls", uri])


def ownership(box: Sandbox) -> None:
    ctl = box.adapter()
    say("5", "an admin drains node4 for maintenance; we refuse to resume it, and resume ours")
    box.run(["scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=maintenance"])
    try:
        ctl.resume("node4")
        raise SystemExit("demo: BUG: resumed an admin's drain")
    except ForeignDrain as exc:
        print(f"   refused, as it should: {exc.slurm_message}")
    for node in ctl.list_nodes():
        if node.drained and ctl.ours(node.reason):
            print(f"   resume {node.name} (reason {node.reason!r}): {ctl.resume(node.name)}")
    box.run(["scontrol", "update", "NodeName=node4", "State=RESUME"])
    box.wait_nodes_ready(timeout=60)
    show(box, ["sinfo", "-N", "-o", "%N %t %E"])


def main() -> int:
    log.configure(mode="cli", level="error")  # the narration says what happened
    layout = Layout(state_dir=REPO / ".sandbox", nodes=4, leaves=2)
    say("1", "bring up slurmctld, 4 slurmd, munge, an S3 endpoint and the node agents")
    if control.running(layout) and any(control.running(layout).values()):
        # A fresh start, so the daemons run this checkout's code and configuration.
        control.down(layout)
    print("   " + control.up(layout, install=True))
    box = Sandbox(layout)
    box.jobs_dir.mkdir(exist_ok=True)
    box.jobs_dir.chmod(0o1777)
    box.reset()
    show(box, ["sinfo", "-N", "-o", "%N %t %f"])

    say("2", "run a 2-node job; the prolog and epilog of this checkout run on both nodes")
    show(box, ["srun", "-N2", "-n2", "--label", "sh", "-c", "echo running on $SLURMD_NODENAME"])

    gate(box)
    hang(box)
    ownership(box)

    say("done", "the sandbox is still up for you to explore:")
    print(f'   eval "$(.venv/bin/slurm-resilience sandbox env --state-dir {layout.state_dir})"')
    print("   sinfo -R; squeue; .venv/bin/slurm-resilience sandbox status")
    print(f"   .venv/bin/slurm-resilience sandbox down --state-dir {layout.state_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
