"""Hook steps without Slurm: the prolog's cached fast path, the nccl-test command, faults."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_resilience.config import Config, load_text
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.nccl import cache, faults, steps, worker


def config_text(tmp_path: Path, min_busbw: float = 0.0001, **extra: str) -> str:
    lines = [
        "node:", f"  state_dir: {tmp_path}/state/{{node}}", f"  run_dir: {tmp_path}/run/{{node}}",
        "logging:", f"  file: {tmp_path}/log.jsonl", "  syslog: false",
        "nccl:", "  enabled: true", "  backend: gloo", "  processes: 2", "  sizes: [64KiB]",
        "  warmup_iters: 1", "  iters: 3", "  timeout_s: 30", "  idle_verify: false",
        "  thresholds:",
        f"    - {{model: cpu, gpus: 2, size: 64KiB, min_busbw_gbps: {min_busbw}}}",
    ]
    lines += [f"  {k}: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def context(tmp_path: Path, env: dict[str, str] | None = None) -> HookContext:
    cfg = load_text(Config, config_text(tmp_path))
    return HookContext(kind="prolog", cfg=cfg, node="n1", env=env or {}, job_id=7)


def fresh_pass(ctx: HookContext) -> None:
    cache.store(steps.cache_path(ctx), {"verdict": "pass", "reasons": ["ok"],
                                        "fingerprint": cache.fingerprint(ctx.cfg.nccl)})


def test_prolog_with_a_fresh_result_runs_nothing_and_asks_no_one(tmp_path: Path) -> None:
    """Fresh cached pass: the prolog step returns no problem, creates no Slurm adapter,
    starts no rank and never imports torch."""
    script = f"""
import json, sys
from slurm_resilience.config import Config, load_text
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.nccl import cache, steps
ctx = HookContext(kind="prolog", cfg=load_text(Config, {config_text(tmp_path)!r}), node="n1",
                  env={{}}, job_id=7)
cache.store(steps.cache_path(ctx), {{"verdict": "pass", "reasons": ["ok"],
                                    "fingerprint": cache.fingerprint(ctx.cfg.nccl)}})
problems = steps.prolog(ctx)
mods = sys.modules
print(json.dumps({{"problems": len(problems), "adapter": ctx._adapter is not None,
                  "torch": "torch" in mods, "gate": "slurm_resilience.nccl.gate" in mods,
                  "launcher": "slurm_resilience.nccl.launcher" in mods}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"problems": 0, "adapter": False, "torch": False, "gate": False,
                      "launcher": False}


def test_disabled_gate_does_nothing(tmp_path: Path) -> None:
    """nccl.enabled false: every step returns at once, even with no cached result."""
    cfg = load_text(Config, config_text(tmp_path).replace("enabled: true", "enabled: false"))
    ctx = HookContext(kind="prolog", cfg=cfg, node="n1", env={}, job_id=7)
    assert steps.prolog(ctx) == [] and steps.healthcheck(ctx) == [] and steps.epilog(ctx) == []
    assert ctx._adapter is None


def test_prolog_releases_the_node_lock_when_it_does_not_test(tmp_path: Path) -> None:
    """After a cached prolog the lock is free again for idle verification."""
    ctx = context(tmp_path)
    fresh_pass(ctx)
    assert steps.prolog(ctx) == []
    from slurm_resilience.nccl.schedule import NodeLock

    lock = NodeLock(steps.lock_path(ctx))
    assert lock.try_acquire()
    lock.release()


def run_cli(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    conf = tmp_path / "conf.yaml"
    conf.write_text(text)
    return subprocess.run([sys.executable, "-m", "slurm_resilience", "--config", str(conf),
                           "nccl-test", "--node", "n1", *args],
                          capture_output=True, text=True, check=False, timeout=120)


def test_nccl_test_command_passes_prints_json_and_caches(tmp_path: Path) -> None:
    """`slurm-resilience nccl-test --json` runs real gloo ranks, exits 0 and caches."""
    out = run_cli(tmp_path, config_text(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["verdict"] == "pass" and data["ranks"] == 2 and data["model"] == "cpu"
    assert data["variants"][0]["busbw_gbps"]["65536"] > 0
    entry = cache.read(str(tmp_path / "state" / "n1" / cache.FILENAME))
    assert entry is not None and entry["verdict"] == "pass"


def test_nccl_test_command_fails_with_measured_against_expected(tmp_path: Path) -> None:
    """An unreachable threshold: exit 1, and the table names measured < expected."""
    out = run_cli(tmp_path, config_text(tmp_path, min_busbw=10000.0))
    assert out.returncode == 1, out.stderr
    assert "< 10000 (2xcpu, 64KiB) (2 attempts)" in out.stdout
    assert "n1: FAIL 2xcpu gloo" in out.stdout


def test_nccl_test_command_refuses_while_the_node_is_tested(tmp_path: Path) -> None:
    """A test already holding the node lock: exit 3 and say who holds it."""
    from slurm_resilience.nccl.schedule import NodeLock

    lock = NodeLock(str(tmp_path / "run" / "n1" / "nccl.lock"))
    assert lock.try_acquire()
    try:
        out = run_cli(tmp_path, config_text(tmp_path))
    finally:
        lock.release()
    assert out.returncode == 3
    assert "being tested already" in out.stdout


def test_cached_failure_is_reported_once_then_kept_while_drained(tmp_path: Path) -> None:
    """A cached failure becomes a drain problem in the health check, marked reported."""
    ctx = context(tmp_path)
    cache.store(steps.cache_path(ctx), {"verdict": "fail", "reasons": ["nccl x < y"],
                                        "fingerprint": cache.fingerprint(ctx.cfg.nccl)})
    ctx.kind = "healthcheck"
    problems = steps.healthcheck(ctx)
    assert [p.reason for p in problems] == ["nccl x < y"]
    entry = cache.read(steps.cache_path(ctx))
    assert entry is not None and entry["reported"] <= time.time()
    assert cache.read(steps.drains_path(ctx)) == {"reasons": ["nccl x < y"]}


@pytest.mark.parametrize(("name", "fault"), [
    ("nccl-slow", faults.Fault("slow", None, 0.5)),
    ("nccl-wrong:5", faults.Fault("wrong", 5)),
    ("nccl-hang", faults.Fault("hang", 0)),
])
def test_sandbox_fault_names(name: str, fault: faults.Fault) -> None:
    """The sandbox names map to the faults the ranks read."""
    assert faults.from_sandbox_name(name) == fault


def test_sandbox_inject_and_heal_write_and_clear_the_fault_file(tmp_path: Path) -> None:
    """`sandbox inject node1 nccl-wrong:3` writes node1's fault file; heal removes it and
    makes the cached result stale, as a reboot would."""
    from slurm_resilience.sandbox import faults as registry

    node = tmp_path / "nodes" / "node1"
    (node / "state").mkdir(parents=True)
    cache.store(str(node / "state" / cache.FILENAME), {"verdict": "pass"})
    assert "rank 3 returns a wrong sum" in registry.inject(tmp_path, "node1", "nccl-wrong:3")
    assert faults.read(str(node / "nccl-fault.json")) == faults.Fault("wrong", 3)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "slurm-resilience.yaml").write_text("nccl: {enabled: false}\n")
    assert "the NCCL gate is off: set nccl.enabled: true in" in registry.inject(
        tmp_path, "node1", "nccl-hang")
    (tmp_path / "etc" / "slurm-resilience.yaml").write_text("nccl: {enabled: true}\n")
    assert "gate is off" not in registry.inject(tmp_path, "node1", "nccl-wrong:3")
    with pytest.raises(registry.FaultError, match="nccl-wrong:GPU"):
        registry.inject(tmp_path, "node1", "nccl-wrong")
    from slurm_resilience.sandbox import hardware, nccl_faults

    nccl_faults.heal(hardware.locate(tmp_path, "node1"))
    assert faults.read(str(node / "nccl-fault.json")) is None
    entry = cache.read(str(node / "state" / cache.FILENAME))
    assert entry is not None and entry["invalidated"].startswith("sandbox heal")


def test_gpu_labels_follow_cuda_visible_devices() -> None:
    """nccl ranks are named by physical GPU (CUDA_VISIBLE_DEVICES), gloo ranks by rank."""
    assert worker.gpu_label("nccl", 1, "4,5") == "gpu5"
    assert worker.gpu_label("nccl", 1, None) == "gpu1"
    assert worker.gpu_label("nccl", 1, "GPU-uuid-a,GPU-uuid-b") == "gpu1"
    assert worker.gpu_label("gloo", 1, "4,5") == "rank1"
    assert worker.expected_factor(8) == 36


def test_a_job_takes_the_node_from_a_manual_nccl_test(tmp_path: Path) -> None:
    """`nccl-test` by hand holds the node lock; a job's hand-off stops it (no forced kill):
    it reports 'aborted', exits 3, caches nothing and leaves no rank behind."""
    from slurm_resilience.nccl.schedule import NodeLock, holder_pid, take_over

    fault = tmp_path / "fault.json"
    faults.write(str(fault), faults.Fault("hang", 0))
    conf = tmp_path / "conf.yaml"
    conf.write_text(config_text(tmp_path, fault_file=str(fault)).replace(
        "timeout_s: 30", "timeout_s: 120"))
    proc = subprocess.Popen([sys.executable, "-m", "slurm_resilience", "--config", str(conf),
                             "nccl-test", "--node", "n1"], stdout=subprocess.PIPE, text=True)
    lock_path = str(tmp_path / "run" / "n1" / "nccl.lock")

    def ranks() -> list[str]:  # the ranks carry the fault file on their command line
        ours = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(fault).encode() in (entry / "cmdline"
                                                                    ).read_bytes():
                    ours.append(entry.name)
            except OSError:
                continue
        return ours

    # Wait (not a time bound) for the test to hold the lock and both ranks to run.
    deadline = time.monotonic() + 60
    while (holder_pid(lock_path) != proc.pid or len(ranks()) < 2) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    lock = NodeLock(lock_path)
    # A generous limit: "not forced" says the SIGTERM hand-off stopped it, how fast is
    # benchmarks' business.
    h = take_over(lock, 60.0)
    lock.release()
    out, _ = proc.communicate(timeout=60)
    assert h.held and h.locked and not h.forced
    assert proc.returncode == 3
    assert "n1: ABORTED" in out
    assert cache.read(str(tmp_path / "state" / "n1" / cache.FILENAME)) is None
    assert ranks() == [], "ranks of the stopped test are still running"


def test_a_healthcheck_after_a_rank_died_reports_but_never_resumes_or_tests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node agent's run after a job's rank died (hang/deathcheck.py) still reports a
    cached failure, but neither resumes our drain nor starts an idle test: those follow
    slurmd's own runs only."""
    from slurm_resilience.hooks.context import ENV_AFTER_RANK_DEATH

    calls: list[str] = []
    monkeypatch.setattr(steps, "maybe_resume", lambda ctx: calls.append("resume"))
    monkeypatch.setattr(steps, "start_idle_verification", lambda ctx: calls.append("test"))
    cfg = load_text(Config, config_text(tmp_path).replace("idle_verify: false",
                                                          "idle_verify: true"))
    death = HookContext(kind="healthcheck", cfg=cfg, node="n1",
                        env={ENV_AFTER_RANK_DEATH: "1"}, job_id=None)
    cache.store(steps.cache_path(death), {"verdict": "fail", "reasons": ["nccl x < y"],
                                          "fingerprint": cache.fingerprint(cfg.nccl)})
    assert [p.reason for p in steps.healthcheck(death)] == ["nccl x < y"]
    fresh_pass(death)
    cache.store(steps.drains_path(death), {"reasons": ["nccl x < y"]})
    assert steps.healthcheck(death) == [] and calls == []
    periodic = HookContext(kind="healthcheck", cfg=cfg, node="n1", env={}, job_id=None)
    steps.healthcheck(periodic)
    assert calls[:1] == ["resume"]
