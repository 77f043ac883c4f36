#!/usr/bin/env python3
"""The main scenario on a local sandbox cluster, narrated (``make demo``).

1. Bring up a real 4-node Slurm cluster on loopback (``.sandbox/``).
2. Run a 2-node job.
3. Drain a node with a reason, as the hooks do, and show it in ``sinfo -R``.
4. Show that an admin's drain is never touched, and resume ours.

The sandbox stays up afterwards so you can look around; the last lines say how.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slurm_resilience import log  # noqa: E402
from slurm_resilience.sandbox import control  # noqa: E402
from slurm_resilience.sandbox.handle import Sandbox  # noqa: E402
from slurm_resilience.sandbox.layout import Layout  # noqa: E402
from slurm_resilience.slurm.errors import ForeignDrain  # noqa: E402


def say(step: str, text: str) -> None:
    print(f"\n== {step}: {text}", flush=True)


def show(box: Sandbox, argv: list[str]) -> str:
    out = box.run(argv, timeout=60).stdout
    print("   $ " + " ".join(argv))
    for line in out.rstrip().splitlines():
        print("   " + line)
    return out


def main() -> int:
    log.configure(mode="cli", level="error")  # the narration says what happened
    layout = Layout(state_dir=REPO / ".sandbox", nodes=4, leaves=2)
    say("1", "bring up slurmctld, 4 slurmd, munge and an S3 endpoint on loopback")
    started = time.monotonic()
    print("   " + control.up(layout, install=True))
    box = Sandbox(layout)
    box.jobs_dir.mkdir(exist_ok=True)
    box.jobs_dir.chmod(0o1777)
    print(f"   ready in {time.monotonic() - started:.1f}s")
    show(box, ["sinfo", "-N", "-o", "%N %t %f"])

    say("2", "run a 2-node job; the prolog and epilog of this checkout run on both nodes")
    show(box, ["srun", "-N2", "-n2", "--label", "sh", "-c", "echo running on $SLURMD_NODENAME"])

    ctl = box.adapter()
    say("3", "drain node3 the way the hooks do: our SR: prefix, actual against expected")
    ctl.drain("node3", "demo: mlx5_2 port1 DOWN (expected ACTIVE 400Gb/s)")
    show(box, ["sinfo", "-R", "-o", "%N %E"])

    say("4", "an admin drains node4 for maintenance; we refuse to resume it")
    box.run(["scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=maintenance"])
    try:
        ctl.resume("node4")
        print("   BUG: resumed an admin's drain")
        return 1
    except ForeignDrain as exc:
        print(f"   refused, as it should: {exc.slurm_message}")
    print(f"   resume node3 (our drain): {ctl.resume('node3')}")
    box.run(["scontrol", "update", "NodeName=node4", "State=RESUME"])
    show(box, ["sinfo", "-N", "-o", "%N %t %E"])

    say("done", "the sandbox is still up for you to explore:")
    print(f'   eval "$(.venv/bin/slurm-resilience sandbox env --state-dir {layout.state_dir})"')
    print("   sinfo; squeue; .venv/bin/slurm-resilience sandbox status")
    print(f"   .venv/bin/slurm-resilience sandbox down --state-dir {layout.state_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
