"""Run inside the rolled-out root with the installed package's Python (not the checkout's).

Brings up the sandbox cluster wired to the hooks `install node` put in PREFIX/hooks,
breaks node1's stand-in GPU (Xid 79) and submits one 2-node job: the installed
prolog must refuse node1 and drain it, and the job must complete on the other nodes.
Usage: gate_check.py PREFIX STATE_DIR
"""

from __future__ import annotations

import random
import socket
import sys
import time
from pathlib import Path

from slurm_resilience.sandbox import faults
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.layout import AGENT_OFFSET, S3_OFFSET, Layout

NODES = 3


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base() -> int:
    for _ in range(200):
        base = random.randrange(30000, 40000, 100)  # noqa: S311 - not a secret
        ports = [*range(base, base + NODES + 1), base + S3_OFFSET,
                 *range(base + AGENT_OFFSET + 1, base + AGENT_OFFSET + NODES + 1)]
        if all(_free(p) for p in ports):
            return base
    raise SystemExit("gate_check: no free port range")


def wait_drained(box: Sandbox, node: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        info = box.adapter().show_node(node)
        if info.drained:
            return info.reason
        if time.monotonic() > deadline:
            raise SystemExit(f"gate_check: {node} not drained after {timeout:g}s: "
                             f"{info.state} {info.reason!r}")
        time.sleep(0.5)


def site_runs(job: int) -> None:
    """The site's own prolog and health program (which test-rollout put into slurm.conf
    before the merge) still ran, through our hooks."""
    prolog = Path("/var/tmp/site-prolog.log")
    ran = prolog.read_text().split() if prolog.exists() else []
    if str(job) not in ran:
        raise SystemExit(f"gate_check: the site's prolog did not run for job {job} ({ran})")
    nhc = Path("/var/tmp/site-nhc.log")
    if not nhc.exists() or not nhc.read_text().strip():
        raise SystemExit("gate_check: the site's health program (NHC's stand-in) never ran")
    print(f"gate_check: the site's prolog ran for job {job}; its health program ran "
          f"{len(nhc.read_text().splitlines())} time(s)")


def main() -> int:
    prefix, state_dir = Path(sys.argv[1]), Path(sys.argv[2])
    # repo=PREFIX: the sandbox's Prolog=, Epilog= and HealthCheckProgram= are PREFIX/hooks/*.
    layout = Layout(state_dir=state_dir, nodes=NODES, leaves=1, port_base=free_port_base(),
                    repo=prefix)
    for hook in ("prolog", "epilog", "healthcheck"):
        if not layout.hook(hook).is_file():
            raise SystemExit(f"gate_check: {layout.hook(hook)} was not installed")
    box = Sandbox.start(layout)
    try:
        conf = layout.slurm_conf.read_text()
        assert f"Prolog={prefix}/hooks/prolog\n" in conf, conf
        print(faults.inject(state_dir, "node1", "gpu-xid:3:79"))
        job = box.sbatch("srun sh -c 'echo $SLURMD_NODENAME'\n", args=["-N2", "--requeue"])
        reason = wait_drained(box, "node1", timeout=60)
        print(f"node1 drained: {reason}")
        if not reason.startswith("SR: health: gpu3 XID 79"):
            raise SystemExit(f"gate_check: node1 drained for another reason: {reason!r}")
        info = box.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180, poll=0.5)
        print(f"job {job}: {info.state} on {info.nodes} after {info.restarts} requeue(s)")
        if info.state != "COMPLETED" or "node1" in info.nodes or info.restarts < 1:
            raise SystemExit("gate_check: the job was not gated off node1 and run elsewhere")
        site_runs(job)
    finally:
        box.stop()
    print("gate_check: the installed hooks gated the job and drained node1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
