"""Active diagnostics scheduled: the epilog after a GPU failure, and idle nodes under the
NCCL node lock (a job's hand-off stops them). dcgmi is a stand-in on PATH printing a
recorded DCGM JSON document."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REAL_FIXTURES

from slurm_resilience import config
from slurm_resilience.config import budgets
from slurm_resilience.fakes import kmsg
from slurm_resilience.health import gate, idle_diag, steps, xid_repairs
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.nccl import steps as nccl_steps
from slurm_resilience.nccl.schedule import NodeLock, holder_pid, take_over
from slurm_resilience.sandbox import hardware
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeRunner, completed

NODE = "node1"
DCGM = REAL_FIXTURES / "dcgm"
FAIL_DOC = DCGM / "dcgmi-diag-r2-j_dcgm4-schema_h100x2_memory-fail_handwritten.txt"
PASS_DOC = DCGM / "dcgmi-diag-r2-j_dcgm3-schema_h100x2_pass_handwritten.txt"


def write_config(tmp_path: Path, **diag: Any) -> Path:
    hardware.prepare_node_hardware(tmp_path, [NODE])
    root = f"{tmp_path}/nodes/{{node}}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "node": {"state_dir": f"{root}/state", "run_dir": f"{root}/run"},
        "logging": {"file": f"{tmp_path}/log.jsonl", "syslog": False},
        "health": {
            "backend": "fake", "scenario_dir": f"{tmp_path}/scenarios",
            "gpu": {"expected_count": 8},
            "xid": {"source": "file", "path": f"{root}/kmsg", "boot_id_file": f"{root}/boot_id"},
            "infiniband": {"sysfs_root": f"{root}/sys/class/infiniband"},
            "nvme": {"path": f"{root}/nvme", "size_limit": 100 << 30, "min_free": 1 << 30,
                     "smart": False},
            "diag": {"tool": "dcgmi", **diag}}}))
    return path


def stand_in_dcgmi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "dcgmi"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tool


def ctx(path: Path, kind: str) -> HookContext:
    return HookContext(kind=kind, cfg=config.load(str(path)), node=NODE,  # type: ignore[arg-type]
                       env={}, job_id=42, _adapter=SlurmAdapter(runner=FakeRunner()))


def fatal_xid(path: Path) -> None:
    hw = hardware.locate(path.parent, NODE)
    bus = json.loads(hw.scenario.read_text())["gpus"][1]["pci_bus_id"]
    kmsg.append_xid(str(hw.kmsg), bus, 79)


def test_epilog_runs_dcgm_after_a_gpu_failure_and_drains_on_its_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fatal Xid in the epilog's own checks runs dcgmi diag at after_failure_level; its
    memory Fail joins the drain. A healthy epilog runs nothing."""
    path = write_config(tmp_path, after_failure=True, after_failure_level=3,
                        after_failure_timeout_s=30)
    calls = tmp_path / "calls"
    stand_in_dcgmi(tmp_path, monkeypatch, f'echo "$@" >> {calls}\ncat {FAIL_DOC}\nexit 226')
    assert steps.epilog(ctx(path, "epilog")) == []
    assert not calls.exists(), "a healthy epilog ran the diagnostics"
    fatal_xid(path)
    problems = steps.epilog(ctx(path, "epilog"))
    assert calls.read_text().split() == ["diag", "-r", "3", "-j"]
    assert any("XID 79" in p.reason for p in problems)
    assert any("DCGM memory Fail" in p.reason for p in problems)


def test_a_clean_epilog_diagnostic_is_recorded_as_a_repair(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, after_failure=True, after_failure_timeout_s=30)
    stand_in_dcgmi(tmp_path, monkeypatch, f"cat {PASS_DOC}")
    fatal_xid(path)
    c = ctx(path, "epilog")
    steps.epilog(c)
    repairs, _ = xid_repairs.load(gate.state_dir(c.cfg, NODE))
    assert [r.evidence for r in repairs] == ["active diagnostic passed"] * 2


def test_epilog_budget_must_hold_the_diagnostic(tmp_path: Path) -> None:
    path = write_config(tmp_path, after_failure=True, after_failure_timeout_s=240)
    with pytest.raises(config.ConfigError, match=r"health\.diag\.after_failure_timeout_s=240"):
        config.load(str(path))


def test_idle_runs_are_due_on_their_interval_and_hold_the_prolog_handoff(
        tmp_path: Path) -> None:
    last = idle_diag.IdleRecord(1000.0, True)
    assert not idle_diag.due(None, 5000.0, 0)  # off by default
    assert idle_diag.due(None, 5000.0, 3600)
    assert not idle_diag.due(last, 4000.0, 3600)
    assert idle_diag.due(last, 4600.0, 3600)
    cfg = config.load(str(write_config(tmp_path, idle_interval_s=3600)))
    assert [w.key for w in budgets.hook_waits(cfg)["hooks.prolog_timeout_s"]] == [
        "health.collector_timeout_s", "node.job_tmpfs (mount, umount)",
        "nccl.handoff_timeout_s", "nccl margin"]
    assert [w.key for w in budgets.hook_waits(cfg)["hooks.healthcheck_timeout_s"]] == [
        "health.collector_timeout_s", "slurm.timeout_s (x4)"]


def test_a_failed_idle_run_keeps_the_node_drained_until_one_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle runner records DCGM's Fail; HealthCheckProgram drains with it (not yet due
    again: nothing spawned), and a passing run ends it."""
    path = write_config(tmp_path, idle_interval_s=3600)
    tool = stand_in_dcgmi(tmp_path, monkeypatch, f"cat {FAIL_DOC}\nexit 226")
    cfg = config.load(str(path))
    record = idle_diag.run_idle(cfg, NODE, lambda: True)
    assert record is not None and not record.healthy
    c = ctx(path, "healthcheck")
    problems = steps._idle_diag(c)
    assert [p.reason for p in problems] == [record.reason]
    assert steps._store(c).load(steps.OURS)["drained"] is True
    assert "gpu1 DCGM memory Fail" in record.reason
    assert idle_diag.run_idle(cfg, NODE, lambda: False) is None  # a job got the node
    tool.write_text(f"#!/bin/sh\ncat {PASS_DOC}\n")
    assert idle_diag.run_idle(cfg, NODE, lambda: True) == idle_diag.IdleRecord(
        pytest.approx(time.time(), abs=600), True, "")  # type: ignore[arg-type]
    assert steps._idle_diag(ctx(path, "healthcheck")) == []


@pytest.mark.parametrize("through_prolog", [False, True])
def test_a_job_takes_the_node_back_from_an_idle_diagnostic(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through_prolog: bool) -> None:
    """dcgmi hangs; the prolog's hand-off (take_over, or the NCCL prolog step with the NCCL
    gate off) stops the runner and its dcgmi, gets the lock without a forced kill, and
    nothing is recorded."""
    path = write_config(tmp_path, idle_interval_s=3600)
    pid_file = tmp_path / "dcgmi.pid"
    stand_in_dcgmi(tmp_path, monkeypatch, f"echo $$ > {pid_file}\nexec sleep 600")
    code = ("import sys; from slurm_resilience import config; "
            "import slurm_resilience.health.idle_diag as idle_diag; "
            f"idle_diag.run_idle(config.load({str(path)!r}), {NODE!r}, lambda: True)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            env=dict(os.environ))
    try:
        lock_path = str(tmp_path / "nodes" / NODE / "run" / "nccl.lock")
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().strip()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holder_pid(lock_path) == proc.pid
        dcgmi_pid = int(pid_file.read_text())
        if through_prolog:
            # The NCCL gate is off; its prolog step still takes the node back.
            c = ctx(path, "prolog")
            assert not c.cfg.nccl.enabled
            assert nccl_steps.prolog(c) == []
            assert "nccl_handoff_s" in c.notes
        else:
            lock = NodeLock(lock_path)
            handoff = take_over(lock, 30.0)
            lock.release()
            assert handoff.held and handoff.locked and not handoff.forced
        assert holder_pid(lock_path) is None
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while Path(f"/proc/{dcgmi_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{dcgmi_pid}").exists(), "the stand-in dcgmi kept running"
        store = gate.StateStore(gate.state_dir(config.load(str(path)), NODE))
        assert store.load(idle_diag.RECORD) == {}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_healthcheck_spawns_the_idle_runner_only_when_due_free_and_idle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Due and idle: the detached runner is started (its module in argv, so the hand-off
    knows it as ours); the lock held by a test: nothing started and no Slurm call; a
    recent run: not due."""
    path = write_config(tmp_path, idle_interval_s=3600)
    started: list[list[str]] = []

    class Spawned:
        pid = 4242

    def popen(argv: list[str], **kwargs: Any) -> Spawned:
        started.append(list(argv))
        assert kwargs["start_new_session"] is True
        return Spawned()

    monkeypatch.setattr(subprocess, "Popen", popen)
    line = "NodeName=node1 CPUAlloc=0 CPUTot=2 State=IDLE Partitions=debug Reason=(null)"
    runner = FakeRunner({"scontrol": [completed(line)]})
    c = HookContext(kind="healthcheck", cfg=config.load(str(path)), node=NODE, env={},
                    _adapter=SlurmAdapter(runner=runner))
    assert steps._idle_diag(c) == []
    assert len(started) == 1 and "slurm_resilience.health.idle_diag" in started[0]
    lock = NodeLock(str(tmp_path / "nodes" / NODE / "run" / "nccl.lock"))
    assert lock.try_acquire()
    calls = len(runner.calls)
    try:
        steps._idle_diag(c)
    finally:
        lock.release()
    assert len(started) == 1 and len(runner.calls) == calls
    gate.StateStore(gate.state_dir(c.cfg, NODE)).save(
        idle_diag.RECORD, idle_diag.IdleRecord(time.time(), True).to_state())
    steps._idle_diag(c)
    assert len(started) == 1
