"""Root's log under a user's slot flood, end to end in the sandbox: a job of an unprivileged
test user fills its run dir with 4,096 mis-sized heartbeat slots, and the node's real agent,
reading them every second, writes its budget of lines for the job and no more.

The figure (log bytes a minute while the flood lasts) is printed; run with ``-s``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hang_jobs import output, wait_for

from slurm_resilience.sandbox.handle import Sandbox

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
pytestmark = [pytest.mark.sandbox]

# One rank's real slot, then 4,095 one-byte slots beside it; then the job just waits.
FLOOD = """\
import os, time
from slurm_resilience import heartbeat
hb = heartbeat.init()
job_dir = os.path.dirname(hb.path)
for rank in range(1, 4096):
    with open(os.path.join(job_dir, f"hb-rank-{rank}.slot"), "wb") as f:
        f.write(b"x")
print("flooded", flush=True)
time.sleep(600)
"""

BUDGET = 10  # the watcher's lines per job a minute (LogBudget's default)


def _refusals(log: Path, job_id: int) -> list[dict[str, object]]:
    found = []
    with open(log, "rb") as f:
        for line in f:
            if b"refused heartbeat slot" not in line:
                continue
            event = json.loads(line)
            if event.get("job_id") == job_id and not event.get("summary"):
                found.append(event)
    return found


def test_a_users_slot_flood_leaves_the_agents_log_bounded(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """4,095 mis-sized slots, refused on every tick of the agent (once a second), add the
    budget's 10 lines for the job and no more while the flood goes on (the agent wrote
    4,096 lines a second before)."""
    user = test_users[0]
    work = sandbox.user_dir(user, "slotflood")
    script = work / "flood.py"
    script.write_text(FLOOD)
    os.chmod(script, 0o644)
    job_id = sandbox.sbatch(f"#!/bin/sh\nsrun -N1 -n1 {PYTHON} -u {script}\n", user=user,
                            args=["-N1", "-n1", f"--output={work}/slurm-%j.out"])
    log = Path(sandbox.layout.state_dir) / "log" / "slurm-resilience.jsonl"
    try:
        wait_for(lambda: "flooded" in output(work, job_id), 90, "the job's slot flood")
        wait_for(lambda: len(_refusals(log, job_id)) >= BUDGET, 60,
                 "the agent refusing the slots")
        start_size, started = log.stat().st_size, time.monotonic()
        time.sleep(10)  # ten of the agent's ticks over the flood (a figure, not a bound)
        grew, took = log.stat().st_size - start_size, time.monotonic() - started
        print(f"\nslot flood: 4,095 refused slots a tick; the sandbox's log grew "
              f"{grew * 60 / took:,.0f} bytes/minute (all four nodes' agents and hooks)")
        assert len(_refusals(log, job_id)) == BUDGET
    finally:
        sandbox.run(["scancel", str(job_id)])
