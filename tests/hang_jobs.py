"""Sandbox helpers shared by the hang, Prometheus and accounting tests: submit
examples/train.py as a test user, wait, and read the incident reports of a job."""

from __future__ import annotations

import json
import time
from pathlib import Path

from slurm_resilience.sandbox.handle import Sandbox

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
PYTHON = REPO / ".venv" / "bin" / "python"


def submit(sandbox: Sandbox, user: str, workdir: Path, args: str, *, nodes: int = 2,
           tasks: int = 2, extra_env: str = "") -> int:
    """Submit examples/train.py as ``user`` the way the docs say: requeueable, appending."""
    uri = f"s3://ckpt/{user}/{workdir.name}"
    script = (f"#!/bin/sh\nexport SLURM_RESILIENCE_CKPT_URI={uri}\n{extra_env}"
              f"srun --kill-on-bad-exit=1 -N{nodes} -n{tasks} {PYTHON} -u {TRAIN} "
              f"--state-mb 1 {args}\n")
    return sandbox.sbatch(script, user=user, args=[
        f"-N{nodes}", f"-n{tasks}", "--requeue", "--open-mode=append",
        f"--output={workdir}/slurm-%j.out"])


def output(workdir: Path, job_id: int) -> str:
    path = workdir / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


def wait_for(pred: object, timeout: float, what: str, poll: float = 0.5) -> object:
    """Poll ``pred`` until it is truthy (a wait for real daemons, not a time bound)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()  # type: ignore[operator]
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} not seen within {timeout:g}s")


def reports(sandbox: Sandbox, job_id: int) -> list[dict[str, object]]:
    out = []
    for node in sandbox.nodes:
        d = sandbox.node_dir(node) / "state" / "incidents"
        for f in sorted(d.glob(f"hang-job{job_id}-*.json")) if d.exists() else []:
            out.append(json.loads(f.read_text()))
    return out


def acting(reports: list[dict[str, object]], run: int) -> dict[str, object] | None:
    """The report of restart ``run`` that decided to requeue or hold, if any."""
    for r in reports:
        decision = r.get("decision", {})
        if r.get("restart") == run and decision.get("action") in (  # type: ignore[union-attr]
                "requeue", "hold"):
            return r
    return None
