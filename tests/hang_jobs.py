"""Sandbox helpers shared by the hang, Prometheus and accounting tests: submit
examples/train.py as a test user, wait, and read the incident reports of a job."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from slurm_resilience import events
from slurm_resilience.sandbox import control, daemons
from slurm_resilience.sandbox.handle import FINISHED, Sandbox

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
PYTHON = REPO / ".venv" / "bin" / "python"


def submit(sandbox: Sandbox, user: str, workdir: Path, args: str, *, nodes: int = 2,
           tasks: int = 2, extra_env: str = "", train: Path = TRAIN,
           sbatch_args: tuple[str, ...] = (), launcher: str = "") -> int:
    """Submit examples/train.py (or a copy at ``train``) as ``user`` the way the docs say:
    requeueable, appending. ``launcher``: what srun starts instead of the venv's python
    (e.g. torchrun with its options), given the script and its arguments."""
    uri = f"s3://ckpt/{user}/{workdir.name}"
    start = launcher or f"{PYTHON} -u"
    script = (f"#!/bin/sh\nexport SLURM_RESILIENCE_CKPT_URI={uri}\n{extra_env}"
              f"srun --kill-on-bad-exit=1 -N{nodes} -n{tasks} {start} "
              f"{shlex.quote(str(train))} --state-mb 1 {args}\n")
    return sandbox.sbatch(script, user=user, args=[
        f"-N{nodes}", f"-n{tasks}", "--requeue", "--open-mode=append",
        f"--output={workdir}/slurm-%j.out", *sbatch_args])


def submit_launch(sandbox: Sandbox, user: str, workdir: Path, args: str, *, nodes: int = 3,
                  spares: int = 1, launch_args: str = "", train: Path = TRAIN,
                  runner: str = "", sbatch_args: tuple[str, ...] = (),
                  exports: tuple[tuple[str, str], ...] = ()) -> int:
    """Submit examples/train.py under ``slurm-resilience launch --spares``: one task per
    node, requeueable (the fallback) and appending, as the README says. ``runner``:
    what each task runs the script with (default: the venv's python); ``exports``: more
    of the job's environment."""
    uri = f"s3://ckpt/{user}/{workdir.name}"
    more = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in exports)
    script = (f"#!/bin/sh\nexport SLURM_RESILIENCE_CKPT_URI={uri}\n{more}"
              f"exec {PYTHON} -m slurm_resilience launch --spares {spares} {launch_args} -- "
              f"{runner or f'{PYTHON} -u'} {shlex.quote(str(train))} --state-mb 1 {args}\n")
    return sandbox.sbatch(script, user=user, args=[
        f"-N{nodes}", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
        f"--output={workdir}/slurm-%j.out", *sbatch_args])


def committed_in_s3(sandbox: Sandbox, user: str, workdir: Path) -> list[int]:
    """The steps of the run in ``workdir`` committed in the sandbox's S3, in order."""
    run = sandbox.layout.s3_dir / "ckpt" / user / workdir.name
    return sorted(int(p.parent.name.removeprefix("step-"))
                  for p in run.glob("step-*/COMMIT.json")) if run.exists() else []


def counted(sandbox: Sandbox, kind: str, cause: str) -> int:
    """Every node agent's count of ``kind``/``cause`` (the metrics' events files)."""
    template = str(sandbox.state_dir / "nodes" / "{node}" / "state")
    return sum(events.read(events.path_for(template, node))["counters"].get(
        f"{kind}|{cause}", 0) for node in sandbox.nodes)


def output(workdir: Path, job_id: int) -> str:
    path = workdir / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


def wait_for(pred: Callable[[], T], timeout: float, what: str, poll: float = 0.5) -> T:
    """Poll ``pred`` until it is truthy (a wait for real daemons, not a time bound)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} not seen within {timeout:g}s")


def wait_for_output(sandbox: Sandbox, workdir: Path, job_id: int, pattern: str,
                    timeout: float, what: str) -> re.Match[str]:
    """Wait until the job's output matches ``pattern``. Fails at once if the job ends
    first, and either way names the job's state and reason, the nodes' drain reasons and
    the output, so a failure says why the line never came."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, output(workdir, job_id))
        if found:
            return found
        job = sandbox.job(job_id)
        ended = job.state in FINISHED
        if ended or time.monotonic() > deadline:
            sinfo = sandbox.run(["sinfo", "-R", "-N"], check=False).stdout
            state = sandbox.run(["scontrol", "show", "job", str(job_id)], check=False).stdout
            why = "the job ended first" if ended else f"not seen within {timeout:g}s"
            raise AssertionError(f"{what}: {why}\n{state}\nsinfo -R:\n{sinfo}\noutput:\n"
                                 f"{output(workdir, job_id)}")
        time.sleep(0.5)


def wait_for_decision(sandbox: Sandbox, workdir: Path, job_id: int, run: int = 0,
                      timeout: float = 300) -> dict[str, Any]:
    """Wait for the hang report of restart ``run`` that decided to act. Fails at once if the
    job ends first, and either way names the job's state, the nodes' drain reasons, the
    agents' last log lines and the output, so a failure says where the hang went unseen.
    The timeout is a bound on a lost incident, not on speed: a loaded machine is slow."""
    deadline = time.monotonic() + timeout
    while True:
        found = acting(reports(sandbox, job_id), run)
        if found:
            return found
        ended = sandbox.job(job_id).state in FINISHED
        if ended or time.monotonic() > deadline:
            sinfo = sandbox.run(["sinfo", "-R", "-N"], check=False).stdout
            state = sandbox.run(["scontrol", "show", "job", str(job_id)], check=False).stdout
            log = sandbox.layout.log_dir / "slurm-resilience.jsonl"
            logs = "the agents' last log lines:\n" + "".join(
                log.read_text(errors="replace").splitlines(True)[-30:] if log.exists() else [])
            why = "the job ended first" if ended else f"not seen within {timeout:g}s"
            raise AssertionError(f"the decision of run {run} of job {job_id}: {why}\n{state}"
                                 f"\nsinfo -R:\n{sinfo}\nreports: {reports(sandbox, job_id)}"
                                 f"\n{logs}\noutput:\n{output(workdir, job_id)}")
        time.sleep(0.5)


def step_nodes(sandbox: Sandbox, workdir: Path, job_id: int,
               timeout: float = 180) -> tuple[str, str]:
    """(the batch host, the other step node) of a ``launch`` job on two step nodes, from
    the launcher's first line."""
    first = wait_for(lambda: re.search(r"relaunch 0: (\S+) (\S+)(?: \(spares \S+\))? at=",
                                       output(workdir, job_id)), timeout,
                     "the launcher's first line")
    host = sandbox.job(job_id).batch_host
    return host, first.group(2) if first.group(1) == host else first.group(1)


@contextlib.contextmanager
def s3_stopped(sandbox: Sandbox, stop: bool = True) -> Iterator[None]:
    """The sandbox's S3 endpoint stopped for the block (when ``stop``), and started again
    after it, whatever happens inside."""
    s3 = control.s3_extra(sandbox.layout)[0]
    if stop:
        daemons.stop(s3.daemon)
    try:
        yield
    finally:
        if stop:
            daemons.spawn(s3.argv, log_file=sandbox.layout.log_dir / "s3.log",
                          pid_file=s3.daemon.pid_file,
                          env={**control.daemon_env(sandbox.layout), **s3.env})


def reports(sandbox: Sandbox, job_id: int) -> list[dict[str, Any]]:
    out = []
    for node in sandbox.nodes:
        d = sandbox.node_dir(node) / "state" / "incidents"
        for f in sorted(d.glob(f"hang-job{job_id}-*.json")) if d.exists() else []:
            out.append(json.loads(f.read_text()))
    return out


def acting(reports: list[dict[str, object]], run: int) -> dict[str, object] | None:
    """The report of restart ``run`` that decided to requeue, relaunch or hold, if any."""
    for r in reports:
        decision = r.get("decision", {})
        if r.get("restart") == run and decision.get("action") in (  # type: ignore[union-attr]
                "requeue", "relaunch", "hold"):
            return r
    return None


def clock_minus_productive_s(clock: dict[str, Any], productive_s: float) -> float:
    """For the hung-once job (saves every 5 steps, a hang at step 12, 30 steps): the time
    its own clock shows it stepping on kept work (run 0 up to the step-10 save, run 1 up to
    the step-30 save, less the saves' stalls) minus goodput's productive time (the kept
    steps times their median, sampled once an agent tick). Positive: steps slower than the
    median, which goodput leaves unexplained; negative: the median of a short, loaded run's
    few samples above its mean, which goodput claims twice. Either way it is what a
    breakdown's ``unexplained`` should show, less each run's first step (which the clock
    counts as stepping and goodput as start-up) and the rounding of the allocation's ends."""
    ckpt = clock["checkpoints"]
    kept = (ckpt[10][0] - clock["running"][0]) + (ckpt[30][0] - clock["running"][1]) \
        - sum(stall for _, stall in ckpt.values())
    return float(kept - productive_s)


def job_clock(out: str) -> dict[str, Any]:
    """The times examples/train.py printed (Unix time, the job's own clock): per run the
    earliest rank's "running" line (just before its first step), per checkpoint step its
    time and stall_ms (rank 0, after the save's section), each hang, and the done line."""
    import re

    clock: dict[str, Any] = {"running": {}, "checkpoints": {}, "hangs": [], "done": None}
    for m in re.finditer(r"rank \d+ running step=\d+ at=([\d.]+) restarts=(\d+)", out):
        run, at = int(m.group(2)), float(m.group(1))
        clock["running"][run] = min(at, clock["running"].get(run, at))
    for m in re.finditer(r"checkpoint step=(\d+) loss=\S+ stall_ms=([\d.]+) at=([\d.]+)", out):
        clock["checkpoints"][int(m.group(1))] = (float(m.group(3)), float(m.group(2)) / 1e3)
    clock["hangs"] = [(int(m.group(1)), float(m.group(2))) for m in
                      re.finditer(r"rank \d+ hanging at step=(\d+) at=([\d.]+)", out)]
    done = re.search(r"done step=\d+ resumed_from=\d+ restarts=\d+ at=([\d.]+)", out)
    clock["done"] = float(done.group(1)) if done else None
    return clock


def goodput(sandbox: Sandbox, job_id: int, nodes: list[str]) -> dict[str, Any]:
    """The job's goodput from the records of every node it ran on (the sandbox's nodes
    share this host, so one command reads them all)."""
    args = [a for n in nodes for a in ("--node", n)]
    out = subprocess.run([sys.executable, "-m", "slurm_resilience", "goodput", str(job_id),
                          *args, "--json"], capture_output=True, text=True,
                         timeout=60, env=control.user_env(sandbox.layout))
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))
