"""What the NCCL gate costs: the prolog with a cached result, the test itself, the hand-off.

1. ``hooks/prolog`` exec'd as slurmd does, with the sandbox's configuration (every
   capability's steps), alternately with the NCCL gate off and on with a fresh cached
   pass: the difference is what the gate adds to every job's prolog (noisy on a loaded
   machine; the in-process figure of the step itself is exact). Reference:
   ``python3 -c pass``.
2. One gloo test of 2 ranks (64 KiB and 1 MiB, as in the sandbox), launch to verdict.
   Reference: ``python3 -I -c "import torch"``, which each rank pays once.
3. Hand-off: a holder runs real ranks stuck in a hang (as idle verification would)
   and a "job" takes the node lock from it: SIGTERM, ranks killed and reaped, lock
   released. Reference: taking a free lock.

Run::

    .venv/bin/python benchmarks/bench_nccl.py [--runs 30] [--tests 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from timing import repeat, series, summarise

from slurm_resilience import config
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.nccl import cache, faults, gate, schedule, steps
from slurm_resilience.sandbox import hardware, resilience_conf
from slurm_resilience.sandbox.layout import Layout

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python3"
NODE = "node1"

HOLDER = """
import os, signal, sys, threading
from slurm_resilience.nccl import faults, schedule
from slurm_resilience.nccl.launcher import LaunchSpec, run_once
lock = schedule.NodeLock(sys.argv[1])
assert lock.try_acquire()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
spec = LaunchSpec(2, "gloo", (65536,), 120.0, warmup=1, iters=2, fault_file=sys.argv[2])
print("running", flush=True)
attempt = run_once(spec, stop)
assert attempt.status == "aborted" and not attempt.leftovers, attempt
lock.release()
"""


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or done.stdout:
        raise SystemExit(f"{argv[0]} failed (rc {done.returncode}): {done.stdout}{done.stderr}")
    return seconds



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="prolog runs per series")
    parser.add_argument("--tests", type=int, default=5, help="gloo tests and hand-offs")
    args = parser.parse_args()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-nccl-") as tmp:
        layout = Layout(state_dir=Path(tmp), nodes=1, leaves=1)
        hardware.prepare_node_hardware(layout.state_dir, [NODE])
        sections = resilience_conf.sections(layout)
        sections["logging"]["file"] = f"{tmp}/log/events.jsonl"
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURMD_NODENAME": NODE,
            "SLURM_JOB_ID": "1001", "SLURM_JOB_UID": str(os.getuid()),
            "SLURM_JOB_GID": str(os.getgid()), "SLURM_JOB_USER": "bench",
            "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "SLURM_JOB_NODELIST": NODE,
        }
        paths = {}
        for name, enabled in (("off", False), ("on", True)):
            sections["nccl"] = {**sections["nccl"], "enabled": enabled, "idle_verify": False}
            paths[name] = Path(tmp) / f"conf-{name}.yaml"
            paths[name].write_text(yaml.safe_dump(sections))
        cfg = config.load(str(paths["on"]))
        state = cfg.node.state_dir.replace("{node}", NODE)
        cache.store(os.path.join(state, cache.FILENAME),
                    {"verdict": "pass", "reasons": ["bench"],
                     "fingerprint": cache.fingerprint(cfg.nccl)})
        reference = series(lambda: timed([str(PYTHON), "-c", "pass"], env), args.runs)
        # Off and on alternate, so that the load of a shared machine weighs on both alike.
        hook = [str(REPO / "hooks" / "prolog")]
        envs = {name: {**env, "SLURM_RESILIENCE_CONFIG": str(path)} for name, path in paths.items()}
        samples: dict[str, list[float]] = {"off": [], "on": []}
        for name in ("off", "on", "off", "on"):
            timed(hook, envs[name])
        for _ in range(args.runs):
            for name in ("off", "on"):
                samples[name].append(timed(hook, envs[name]))
        prolog = {name: summarise(values) for name, values in samples.items()}
        ctx = HookContext(kind="prolog", cfg=cfg, node=NODE, env=env, job_id=1001)
        step = repeat(lambda: steps.prolog(ctx), args.runs * 10)
        assert ctx._adapter is None, "the cached prolog step asked slurmctld"
        events = Path(tmp, "log", "events.jsonl").read_text()
        assert "nccl: running the test" not in events, "the cached prolog ran the test"
        print(f"python3 -c pass              {reference.ms()}  (reference)")
        for name in ("off", "on"):
            print(f"hooks/prolog, nccl {name:3}       {prolog[name].ms()}  "
                  f"{prolog[name].p50 / reference.p50:4.1f}x reference p50")
        added = prolog["on"].p50 - prolog["off"].p50
        print(f"the gate adds {added * 1e3:+.1f} ms p50 to a prolog with a fresh result")
        print(f"nccl prolog step in-process  {step.ms()}  (lock, cache read, decision)")
        out.update(reference_p50_ms=reference.p50 * 1e3, prolog_off_p50_ms=prolog["off"].p50
                   * 1e3, prolog_on_p50_ms=prolog["on"].p50 * 1e3,
                   prolog_on_p99_ms=prolog["on"].p99 * 1e3, step_p50_ms=step.p50 * 1e3)

        import_torch = [str(PYTHON), "-I", "-c", "import torch"]
        torch_ref = series(lambda: timed(import_torch, env), args.tests)
        runs, busbw = [], []
        for _ in range(args.tests):
            start = time.perf_counter()
            result = gate.run_gate(cfg.nccl)
            runs.append(time.perf_counter() - start)
            assert result.verdict == "pass", result.reasons
            busbw.append(result.variants[0].judgement.busbw[1024**2])
        test = summarise(runs)
        print(f"python3 -I -c 'import torch' {torch_ref.ms()}  (reference)")
        print(f"gloo test, 2 ranks           {test.ms()}  "
              f"{test.p50 / torch_ref.p50:4.1f}x reference p50; busbw at 1MiB "
              f"{min(busbw):.3f}-{max(busbw):.3f} GB/s (threshold "
              f"{cfg.nccl.thresholds[0].min_busbw_gbps:g})")
        out.update(torch_import_p50_ms=torch_ref.p50 * 1e3, gloo_test_p50_ms=test.p50 * 1e3)

        fault = os.path.join(tmp, "hang.json")
        faults.write(fault, faults.Fault("hang", 0))
        lock_path = os.path.join(tmp, "nccl.lock")
        free, handoffs = [], []
        for _ in range(args.tests):
            lock = schedule.NodeLock(lock_path)
            free.append(schedule.take_over(lock, 5.0).seconds)
            lock.release()
            holder = subprocess.Popen(
                [str(PYTHON), "-c", HOLDER, lock_path, fault, "slurm_resilience.nccl.bench"],
                stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None and holder.stdout.readline() == "running\n"
            time.sleep(3.0)  # ranks started and stuck in the collective
            h = schedule.take_over(lock, 5.0)
            assert h.held and not h.forced, h
            handoffs.append(h.seconds)
            lock.release()
            if holder.wait(10) != 0:
                raise SystemExit("holder failed")
        free_s, handoff = summarise(free), summarise(handoffs)
        print(f"free node lock               {free_s.ms()}  (reference)")
        print(f"hand-off from verification   {handoff.ms()}  (2 hung ranks killed and reaped)")
        out.update(free_lock_p50_ms=free_s.p50 * 1e3, handoff_p50_ms=handoff.p50 * 1e3,
                   handoff_max_ms=max(handoffs) * 1e3)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(json.dumps({k: round(v, 1) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
