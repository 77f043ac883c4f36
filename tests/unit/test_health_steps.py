"""Hook steps of the health gate: quiet prolog, drain reasons, resume only our own drains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from slurm_resilience import config, events, log
from slurm_resilience.health import steps
from slurm_resilience.hooks.context import ENV_AFTER_RANK_DEATH, HookContext
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
        ("health", "mlx5_3 port1 DOWN (expected ACTIVE 400Gb/s)", True)]


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
    first = resume_runner("IDLE+DRAIN", "SR: health: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]")
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", first)) == []
    assert first.calls == []  # one pass is not enough
    second = resume_runner("IDLE+DRAIN", "SR: health: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]")
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", second)) == []
    assert second.calls[-1] == ["scontrol", "update", "NodeName=node1", "State=RESUME"]


def test_a_healthcheck_after_a_rank_died_drains_but_never_resumes(cfg_path: Path) -> None:
    """The agent's run after a job's rank died here (hang/deathcheck.py) fails on a fault
    like any run, but its passes don't count toward the streak that resumes our drain: a
    user whose ranks keep dying can't bring the node back sooner."""
    death = {ENV_AFTER_RANK_DEATH: "1"}
    faults.inject(cfg_path.parent, NODE, "ib-down:mlx5_3:1")
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", env=death))
    faults.heal(cfg_path.parent, NODE)
    drained = "SR: health: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]"
    for _ in range(3):
        runner = resume_runner("IDLE+DRAIN", drained)
        assert steps.healthcheck(ctx(cfg_path, "healthcheck", runner, env=death)) == []
        assert ["scontrol", "update", "NodeName=node1", "State=RESUME"] not in runner.calls
    first = resume_runner("IDLE+DRAIN", drained)  # slurmd's own runs: still two to resume
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", first)) == []
    assert first.calls == []
    second = resume_runner("IDLE+DRAIN", drained)
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", second)) == []
    assert second.calls[-1] == ["scontrol", "update", "NodeName=node1", "State=RESUME"]


@pytest.mark.parametrize(("state", "reason"), [
    ("IDLE+DRAIN", "maintenance [alice@t]"),                       # an admin's drain
    ("IDLE+DRAIN", "SR: test: disk on fire [root@t]"),             # another SR: capability
    ("IDLE+DRAIN", "SR: health,nccl: mlx5_3 port1 DOWN (expected ACTIVE) (+1 more) [root@t]"),
    ("IDLE+DRAIN", "SR: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]"),   # untagged, unknown
    ("DOWN+DRAIN", "SR: health: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]"),  # a state
    ("IDLE+DRAIN+MAINT", "SR: health: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]"),
])
def test_healthcheck_never_resumes_other_drains_or_states(cfg_path: Path, state: str,
                                                          reason: str) -> None:
    """Foreign reasons, other capabilities' SR: reasons and unknown states are left alone."""
    drain_then_heal(cfg_path)
    for _ in range(3):
        runner = resume_runner(state, reason)
        assert steps.healthcheck(ctx(cfg_path, "healthcheck", runner)) == []
        assert not any("State=RESUME" in arg for call in runner.calls for arg in call)


def test_a_long_reason_of_ours_still_auto_resumes(cfg_path: Path) -> None:
    """A health drain cut short (by us or by Slurm) is recognised by its owner tag and resumed."""
    from slurm_resilience.hooks import runner
    from slurm_resilience.hooks.context import Problem

    many = [Problem("health", f"gpu{i} XID 79 (GPU fell off the bus) " + "x" * 200, more=4)
            for i in range(3)]
    reason = runner.drain_reason("SR:", many)
    assert len(reason) <= 200 and reason.startswith("SR: health: gpu0 XID 79")
    assert reason.endswith("... (+14 more)")
    stored = reason[:150] + " [root@t]"  # and then cut further on the way back
    drain_then_heal(cfg_path)
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", resume_runner("IDLE+DRAIN", stored))) \
        == []
    second = resume_runner("IDLE+DRAIN", stored)
    assert steps.healthcheck(ctx(cfg_path, "healthcheck", second)) == []
    assert second.calls[-1] == ["scontrol", "update", "NodeName=node1", "State=RESUME"]


def test_a_drain_remembered_by_an_older_version_still_resumes(cfg_path: Path) -> None:
    """Untagged reasons that an older version remembered as its own are still resumed."""
    from slurm_resilience.health.gate import StateStore, state_dir

    drain_then_heal(cfg_path)
    store = StateStore(state_dir(config.load(str(cfg_path)), NODE))
    store.save(steps.OURS, {**store.load(steps.OURS),
                            "reasons": ["mlx5_3 port1 DOWN (expected ACTIVE)"]})
    for _ in range(2):
        runner = resume_runner("IDLE+DRAIN", "SR: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]")
        steps.healthcheck(ctx(cfg_path, "healthcheck", runner))
    assert runner.calls[-1] == ["scontrol", "update", "NodeName=node1", "State=RESUME"]


def unusable_state_dir(cfg_path: Path) -> None:
    """Put a regular file where the node's state directory should be."""
    state = cfg_path.parent / "nodes" / NODE / "state"
    state.parent.mkdir(parents=True, exist_ok=True)
    if state.is_dir():
        import shutil
        shutil.rmtree(state)
    state.write_text("not a directory\n")


@pytest.mark.parametrize("kind", ["prolog", "epilog", "healthcheck"])
def test_a_lost_gpu_blocks_even_when_the_state_dir_is_unusable(
        cfg_path: Path, kind: str) -> None:
    """Bookkeeping that can't write its state never hides a finding: a lost GPU still fails
    the hook under the default fail-open policy (the reproduced case)."""
    from slurm_resilience.hooks import runner

    faults.inject(cfg_path.parent, NODE, "gpu-missing:3")
    unusable_state_dir(cfg_path)
    c = ctx(cfg_path, kind)
    assert c.cfg.hooks.on_internal_error == "fail-open"
    events = cfg_path.parent / "events.jsonl"
    log.configure(mode="json", file=str(events))
    spec = {"prolog": "slurm_resilience.health.steps:prolog",
            "epilog": "slurm_resilience.health.steps:epilog",
            "healthcheck": "slurm_resilience.health.steps:healthcheck"}[kind]
    try:
        problems = runner.run_steps(c, [spec])
    finally:
        log.reset()
    assert [p.step for p in problems] == ["health"]
    assert problems[0].reason == "7 GPUs visible (expected 8)"
    said = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert "hook step crashed" not in said
    assert any("couldn't record" in e for e in said), said  # the bookkeeping failure is said


JOB = ("JobId=42 JobName=t UserId=alice(1000) JobState={state} Reason={reason} "
       "Restarts={restarts} NodeList=node1")


@pytest.mark.parametrize(("state", "reason", "restarts", "kept", "counted", "released"), [
    # slurmctld still taking it off the node: a health-check pass in this window used to
    # drop the job, and its requeue was never counted
    ("REQUEUED", "None", 0, True, 0, False),
    ("COMPLETING", "None", 0, True, 0, False),
    ("CONFIGURING", "None", 0, True, 0, False),
    ("PENDING", "None", 0, True, 0, False),  # not requeued yet
    ("PENDING", "launch_failed_requeued_held", 1, False, 1, True),  # held: let go
    ("PENDING", "ReqNodeNotAvail", 1, False, 1, False),  # nohold_on_prolog_fail
    ("RUNNING", "None", 1, False, 1, False),  # requeued, already running elsewhere
    ("CANCELLED", "None", 0, False, 0, False),  # ended without a requeue
])
def test_a_job_our_prolog_failed_is_counted_once_when_requeued(
        cfg_path: Path, state: str, reason: str, restarts: int, kept: bool, counted: int,
        released: bool) -> None:
    """A failed job stays on the list until it is seen requeued (counted once, released if
    held) or ended; a pass while it is being requeued keeps it."""
    runner = FakeRunner({"scontrol": [completed(JOB.format(state=state, reason=reason,
                                                           restarts=restarts))]})
    c = ctx(cfg_path, "healthcheck", runner)
    c.adapter.events_path = str(cfg_path.parent / "events.json")
    steps._release_held(c, [42])
    assert steps._store(c).load(steps.OURS).get("failed_jobs") == ([42] if kept else [])
    assert events.read(c.adapter.events_path)["counters"].get("requeue|prolog", 0) == counted, \
        events.read(c.adapter.events_path)
    assert (["scontrol", "release", "42"] in runner.calls) is released, runner.calls
