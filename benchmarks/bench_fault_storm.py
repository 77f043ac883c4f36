"""Goodput under a fault storm: one job on the sandbox for ``--minutes`` (20) with a checkpoint
about every 30 s and a fault about every ``--every`` seconds (120), in turn: a rank hang, an
Xid that ends the ranks of its node (as a GPU fallen off the bus does), the loss of a node
(its slurmd and every process of it killed), an S3 outage (the endpoint stopped for 60 s)
and a node agent's restart.

The job runs ``examples/train.py`` under ``slurm-resilience launch --spares 2 --max-restarts
10`` on 4 of the sandbox's 6 nodes. A node a fault took out is repaired a minute later, as an
operator would (the stand-in hardware healed, slurmd started again, our drain resumed), so
the storm does not run out of nodes, and one the job still holds is a spare again.

Reported: goodput (productive over allocated time) from the project's own
``slurm-resilience goodput JOB --json``, cross-checked against the job's own step log
(steps kept times the step time the log shows), each fault with when it struck and what
followed (relaunch or requeue), and the goal of issue 23: at least 90% at that fault rate
with spares. Run as root (the sandbox needs it) with a test user that exists::

    .venv/bin/python benchmarks/bench_fault_storm.py [--minutes 20] [--every 120]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import free_port_base  # noqa: E402
from hang_jobs import output, submit_launch, wait_for  # noqa: E402

from slurm_resilience.sandbox import catalogue, control, daemons, faults, nodekill  # noqa: E402
from slurm_resilience.sandbox.handle import Sandbox  # noqa: E402
from slurm_resilience.sandbox.layout import Layout  # noqa: E402

STEP_S = 0.5
# What a step costs on top of --step-seconds (the forward, backward and all-reduce): the
# job's own log showed 0.54 s a step in the storms here. The step counts below are sized
# with it, so that "a checkpoint every 30 s" is 30 s of the job's time, not 32.
STEP_OVERHEAD_S = 0.04
REPAIR_AFTER_S = 60.0
S3_OUTAGE_S = 60.0
KINDS = ("hang", "xid", "node-loss", "s3-outage", "agent-restart")


@dataclass
class Struck:
    kind: str
    at: float
    node: str
    detail: str


def ranks_on(layout: Layout, node: str) -> list[int]:
    """The training ranks running on sandbox node ``node``."""
    out = []
    for pid in nodekill.node_processes(layout, node):
        with contextlib.suppress(OSError):
            if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def step_nodes(out: str) -> list[str]:
    """The step's nodes of the newest launch (re)start in the job's output."""
    found = re.findall(r"slurm-resilience launch: relaunch \d+: (\S+(?: \S+)*?)(?: \(spares|"
                       r" at=)", out)
    return found[-1].split() if found else []


class Storm:
    def __init__(self, box: Sandbox, job_id: int, work: Path, trigger: Path):
        self.box = box
        self.job_id = job_id
        self.work = work
        self.trigger = trigger
        self.repairs: list[tuple[float, str, Callable[[], None]]] = []
        self.struck: list[Struck] = []

    def target(self) -> str:
        """A step node other than the batch host (losing the batch host ends the launcher:
        that path is the requeue's, measured by bench_recovery)."""
        nodes = step_nodes(output(self.work, self.job_id))
        batch = self.box.job(self.job_id).batch_host
        others = [n for n in nodes if n != batch]
        if not others:
            raise RuntimeError(f"no step node besides the batch host in {nodes}")
        return others[0]

    def strike(self, kind: str) -> None:
        now = time.time()
        node = "" if kind in ("hang", "s3-outage") else self.target()
        detail = getattr(self, "_" + kind.replace("-", "_"))(node)
        self.struck.append(Struck(kind, now, node, detail))
        print(f"  {time.strftime('%H:%M:%S')} {kind} {node}: {detail}", flush=True)

    def _hang(self, _node: str) -> str:
        self.trigger.touch()
        # Hung once: the trigger goes as soon as the rank says so, or the next run hangs too.
        def hung() -> bool:
            seen: int = output(self.work, self.job_id).count("hanging at step=")
            return seen > sum(
                1 for s in self.struck if s.kind == "hang")
        wait_for(hung, 60, "the rank's hang")
        self.trigger.unlink()
        return "rank 1 stopped making progress"

    def _xid(self, node: str) -> str:
        done = faults.inject(self.box.state_dir, node, "gpu-xid:0:79")
        for pid in ranks_on(self.box.layout, node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.repairs.append((time.time() + REPAIR_AFTER_S, node, lambda: self._heal(node)))
        return f"{done}; its ranks killed"

    def _node_loss(self, node: str) -> str:
        killed = nodekill.kill_node(self.box.layout, node)
        self.repairs.append((time.time() + REPAIR_AFTER_S, node, lambda: self._revive(node)))
        return f"slurmd and every process of the node killed ({len(killed)})"

    def _s3_outage(self, _node: str) -> str:
        extra = catalogue.s3_extra(self.box.layout)[0]
        daemons.stop(extra.daemon, grace=2.0)

        def back() -> None:
            daemons.spawn(extra.argv, log_file=self.box.layout.log_dir / "s3.log",
                          pid_file=extra.daemon.pid_file, env=control.daemon_env(self.box.layout))
        self.repairs.append((time.time() + S3_OUTAGE_S, "s3", back))
        return f"S3 endpoint stopped for {S3_OUTAGE_S:g}s"

    def _agent_restart(self, node: str) -> str:
        extra = next(e for e in catalogue.agent_extras(self.box.layout)
                     if e.daemon.name == f"agent-{node}")
        daemons.stop(extra.daemon, grace=5.0)
        daemons.spawn(extra.argv, log_file=self.box.layout.log_dir / f"{extra.daemon.name}.log",
                      pid_file=extra.daemon.pid_file,
                      env={**control.daemon_env(self.box.layout), **extra.env})
        return "agent stopped and started"

    def _heal(self, node: str) -> None:
        faults.heal(self.box.state_dir, node)
        self._resume(node)

    def _revive(self, node: str) -> None:
        nodekill.revive_node(self.box.layout, node)
        self._resume(node)

    def _resume(self, node: str) -> None:
        self.box.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)

    def repair_due(self) -> None:
        now = time.time()
        for item in [r for r in self.repairs if r[0] <= now]:
            self.repairs.remove(item)
            item[2]()

    def finish(self) -> None:
        for _, _, fn in self.repairs:
            fn()
        self.repairs.clear()


def kept_step_time(out: str, every: int) -> float:
    """The median step time the job's own log shows: from a run's start (after its restore)
    or a checkpoint to the next checkpoint of the same run, over the steps between them."""
    marks = [(int(s or c) - (1 if s else 0), float(t or u)) for s, t, c, u in re.findall(
        r"rank 0 running step=(\d+) at=([\d.]+)|checkpoint step=(\d+) loss=\S+ "
        r"stall_ms=[\d.]+ at=([\d.]+)", out)]
    gaps = [(t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in itertools.pairwise(marks)
            if 0 < s2 - s1 <= every and t2 > t1]
    if not gaps:
        raise RuntimeError("no checkpoint after a run's start in the job's output")
    return statistics.median(gaps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0,
                        help="how long the job trains without faults (default: 20)")
    parser.add_argument("--every", type=float, default=120.0,
                        help="seconds between faults (default: 120)")
    parser.add_argument("--user", default="srtest1", help="the unprivileged user running the "
                                                          "job (default: srtest1)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="a directory to write the job's output, goodput's JSON and the "
                             "sandbox's logs to")
    parser.add_argument("--max-restarts", type=int, default=10,
                        help="the launcher's --max-restarts (default: 10, so that every fault "
                             "of a 20-minute storm may take the spare path; the launcher's "
                             "own default is 3)")
    parser.add_argument("--rescue", action=argparse.BooleanOptionalAction, default=True,
                        help="the job saves its last finished step at each fault "
                             "(SLURM_RESILIENCE_CKPT_RESCUE; --no-rescue: the last checkpoint "
                             "only, as before)")
    parser.add_argument("--port-base", type=int, default=0,
                        help="first port of the benchmark's own sandbox (default: a free one)")
    args = parser.parse_args()
    steps = int(args.minutes * 60 / (STEP_S + STEP_OVERHEAD_S))
    every = max(1, round(30 / (STEP_S + STEP_OVERHEAD_S)))
    state = Path(tempfile.mkdtemp(prefix="sr-bench-storm-", dir="/tmp"))
    state.chmod(0o755)
    box = Sandbox.start(Layout(state_dir=state, nodes=6, leaves=1,
                               port_base=args.port_base or free_port_base(6), repo=REPO))
    try:
        work = box.user_dir(args.user, "storm")
        trigger = work / "hang-now"
        job_id = submit_launch(
            box, args.user, work,
            f"--steps {steps} --ckpt-every {every} --step-seconds {STEP_S} --hang-rank 1 "
            f"--hang-on-file {trigger} --fault-every-run", nodes=4, spares=2,
            launch_args=f"--max-restarts {args.max_restarts}",
            sbatch_args=("--no-kill",),
            exports=(("SLURM_RESILIENCE_CKPT_RESCUE", "on" if args.rescue else "off"),))
        print(f"job {job_id}: {steps} steps of about {STEP_S} s, a checkpoint every {every}; "
              f"a fault every {args.every:g} s", flush=True)
        wait_for(lambda: "running step=" in output(work, job_id), 300, "the first step")
        storm = Storm(box, job_id, work, trigger)
        started = time.time()
        next_at, n = started + args.every, 0
        while box.job(job_id).state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            storm.repair_due()
            if time.time() >= next_at and time.time() - started < args.minutes * 60:
                try:
                    storm.strike(KINDS[n % len(KINDS)])
                except (RuntimeError, TimeoutError) as exc:
                    print(f"  {KINDS[n % len(KINDS)]}: not struck: {exc}", flush=True)
                n += 1
                next_at += args.every
            time.sleep(1.0)
        storm.finish()
        final = box.job(job_id)
        out = output(work, job_id)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"slurm-{job_id}.out").write_text(out)
            shutil.copytree(box.layout.log_dir, args.keep / "log", dirs_exist_ok=True)
        got = subprocess.run(
            [sys.executable, "-m", "slurm_resilience", "--config",
             str(box.layout.resilience_conf), "goodput", str(job_id), "--json"],
            capture_output=True, text=True, timeout=120, env=control.user_env(box.layout))
        if got.returncode != 0:
            raise RuntimeError(f"goodput failed: {got.stderr}")
        g = json.loads(got.stdout)
        if args.keep is not None:
            (args.keep / "goodput.json").write_text(got.stdout)
    finally:
        box.stop()
        shutil.rmtree(state, ignore_errors=True)
    if final.state != "COMPLETED":
        tail = "\n".join(out.splitlines()[-40:])
        print(f"job {job_id} ended {final.state} (restarts {final.restarts}); its output's "
              f"end:\n{tail}")
        return 1
    step_s = kept_step_time(out, every)
    by_log = steps * step_s
    print(f"job {job_id} ended {final.state} after {len(storm.struck)} faults "
          f"({', '.join(s.kind for s in storm.struck)})")
    print(f"  relaunches inside the allocation: "
          f"{len(re.findall(r'order for relaunch', out))}, requeues: {final.restarts}")
    print(f"  allocated {g['allocated_s']:.0f} s, productive {g['productive_s']:.0f} s "
          f"(goodput); by the job's own log {by_log:.0f} s ({steps} steps x {step_s:.3f} s)")
    print(f"  a checkpoint every {every} steps: every {every * step_s:.1f} s by the job's log")
    print("  losses: " + ", ".join(f"{k} {v:.0f} s" for k, v in g["losses_s"].items() if v))
    # Faults every --every seconds after recoveries of about equal length strike at about
    # the same place between two checkpoints (the storm aliases with the interval); at a
    # site they come at random times and lose half an interval on average. The same run
    # with that average in place of what its faults lost:
    faulted = len(g["runs"]) - 1  # every run but the last ended at a fault
    lost = g["losses_s"]["lost_since_checkpoint"]
    if faulted:
        half = every * step_s / 2
        at_random = (g["productive_s"] + lost - faulted * half) / g["allocated_s"]
        print(f"  work lost since the last checkpoint: {lost:.0f} s at {faulted} faults "
              f"({lost / faulted:.1f} s each); " + (
                  "without the saves at the fault, " if args.rescue else
                  "at random fault times, ") +
              f"half an interval each ({half:.1f} s): goodput {at_random:.1%}")
    writes = [float(t) for t in re.findall(r"checkpoint: rescue: saved step \d+ at the fault "
                                           r".*? in ([\d.]+)s:", out)]
    if args.rescue:
        resumed = len(re.findall(r"checkpoint: load: resuming from step \d+, saved at the "
                                 r"fault", out))
        print(f"  saves at the fault: {len(writes)} written (each node's local leader; "
              f"median {statistics.median(writes) if writes else 0:.2f} s), "
              f"{resumed} relaunches resumed from one")
    for r in g["runs"]:
        lost = ", ".join(f"{k} {v:.1f}" for k, v in r["losses"].items() if v)
        print(f"    run {r['restarts']} relaunch {r['relaunch']}: {r['allocated_s']:.1f} s "
              f"allocated, {r['productive_s']:.1f} s productive" + (f"; {lost}" if lost else ""))
    first = min(float(t) for t in re.findall(r"rank \d+ started at=([\d.]+)", out))
    done = float(re.findall(r"done step=\d+ resumed_from=\d+ restarts=\d+ at=([\d.]+)", out)[-1])
    print(f"  the job's own span, first rank's start to done: {done - first:.0f} s "
          f"(the allocation is longer by the first prolog and the last epilog)")
    ratio = g["productive_s"] / g["allocated_s"] if g["allocated_s"] else 0.0
    print(f"goodput {ratio:.1%} (the job's log: {by_log / g['allocated_s']:.1%}); "
          f"goal >= 90%: {'met' if ratio >= 0.9 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
