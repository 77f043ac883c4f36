"""Hook steps of the health gate: quiet prolog, drain reasons, resume only our own drains."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slurm_resilience import config
from slurm_resilience.health import steps
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.sandbox import faults, hardware
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeRunner, completed

NODE = "node1"
LINE = "NodeName=node1 CPUAlloc=0 CPUTot=2 State={state} Partitions=debug Reason={reason}"


@pytest.fixture
def cfg_path(tmp_path: Path) -> Path:
    hardware.prepare_node_hardware(tmp_path, [NODE])
    root = f"{tmp_path}/nodes/{{node}}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "node": {"state_dir": f"{root}/state"},
        "logging": {"file": f"{tmp_path}/log.jsonl", "syslog": False},
        "health": {
            "backend": "fake", "scenario_dir": f"{tmp_path}/scenarios",
            "resume_after_passes": 2, "gpu": {"expected_count": 8},
            "xid": {"source": "file", "path": f"{root}/kmsg", "boot_id_file": f"{root}/boot_id"},
            "infiniband": {"sysfs_root": f"{root}/sys/class/infiniband"},
            "nvme": {"path": f"{root}/nvme", "size_limit": 100 << 30, "min_free": 1 << 30,
                     "smart": False}}}))
    return path


def ctx(cfg_path: Path, kind: str, runner: FakeRunner | None = None,
        env: dict[str, str] | None = None) -> HookContext:
    adapter = SlurmAdapter(runner=runner or FakeRunner())
    return HookContext(kind=kind, cfg=config.load(str(cfg_path)), node=NODE,  # type: ignore[arg-type]
                       env=env or {}, job_id=42, _adapter=adapter)


def test_gres_and_job_gpu_counts() -> None:
    """GPU counts come from gres strings and from the ids a job was given."""
    assert steps.gres_gpus("gpu:h100:8(S:0-1)") == 8
    assert steps.gres_gpus("gpu:4,gpu:a100:4") == 8
    assert steps.gres_gpus("(null)") is None
    assert steps.job_gpus({"SLURM_JOB_GPUS": "0,3"}) == 4
    assert steps.job_gpus({}) is None


def test_healthy_prolog_makes_no_slurm_call(cfg_path: Path) -> None:
    """On healthy hardware the prolog returns no problem and never calls Slurm."""
    runner = FakeRunner()
    assert steps.prolog(ctx(cfg_path, "prolog", runner)) == []
    assert runner.calls == []


def test_failing_prolog_returns_one_short_reason(cfg_path: Path) -> None:
    """A fault gives one drain problem whose reason names what is wrong."""
    faults.inject(cfg_path.parent, NODE, "ib-down:mlx5_3:1")
    problems = steps.prolog(ctx(cfg_path, "prolog"))
    assert [(p.step, p.reason, p.drain) for p in problems] == [
        ("health", "mlx5_3 port1 DOWN (expected ACTIVE)", True)]


def resume_runner(state: str, reason: str) -> FakeRunner:
    return FakeRunner({"scontrol": [completed(LINE.format(state=state, reason=reason))] * 3
                       + [completed("")]})


def drain_then_heal(cfg_path: Path) -> None:
    faults.inject(cfg_path.parent, NODE, "ib-down:mlx5_3:1")
    assert steps.healthcheck(ctx(cfg_path, "healthcheck"))
    faults.heal(cfg_path.parent, NODE)


def test_healthcheck_resumes_our_drain_after_n_passes(cfg_path: Path) -> None:
    """After the fault is gone, the second clean run resumes the node drained by the gate."""
    drain_then_heal(cfg_path)
    first = resume_runner("IDLE+DRAIN", "SR: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]")
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", first)) == []
    assert first.calls == []  # one pass is not enough
    second = resume_runner("IDLE+DRAIN", "SR: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]")
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", second)) == []
    assert second.calls[-1] == ["scontrol", "update", "NodeName=node1", "State=RESUME"]


@pytest.mark.parametrize(("state", "reason"), [
    ("IDLE+DRAIN", "maintenance [alice@t]"),                       # an admin's drain
    ("IDLE+DRAIN", "SR: test: disk on fire [root@t]"),             # another SR: capability
    ("DOWN+DRAIN", "SR: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]"),   # a state we don't own
    ("IDLE+DRAIN+MAINT", "SR: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]"),
])
def test_healthcheck_never_resumes_other_drains_or_states(cfg_path: Path, state: str,
                                                          reason: str) -> None:
    """Foreign reasons, other capabilities' SR: reasons and unknown states are left alone."""
    drain_then_heal(cfg_path)
    for _ in range(3):
        runner = resume_runner(state, reason)
        assert steps.healthcheck(ctx(cfg_path, "healthcheck", runner)) == []
        assert not any("State=RESUME" in arg for call in runner.calls for arg in call)
