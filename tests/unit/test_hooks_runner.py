"""The hook runner: config discovery, steps, watchdog policy, exit codes."""

from __future__ import annotations

import json
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_resilience.config import Config, load_text
from slurm_resilience.hooks import runner
from slurm_resilience.hooks.context import HookContext, Problem
from slurm_resilience.proc import CommandTimeout
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeRunner, completed


@pytest.fixture
def step_module() -> Iterator[types.ModuleType]:
    mod = types.ModuleType("sr_test_steps")

    def ok(ctx: HookContext) -> list[Problem]:
        return []

    def sick(ctx: HookContext) -> list[Problem]:
        return [Problem("sick", "gpu3 XID 79 (GPU fell off the bus) 12:01:07")]

    def crash(ctx: HookContext) -> list[Problem]:
        raise RuntimeError("bug in a step")

    mod.ok, mod.sick, mod.crash = ok, sick, crash  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _ctx(cfg: Config | None = None) -> HookContext:
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "0", "SLURMD_NODENAME": "node2"}
    return HookContext.from_env("prolog", cfg or Config(), env)


def test_context_reads_slurmd_environment() -> None:
    """Job id, uid, user and node come from the variables slurmd sets."""
    ctx = _ctx()
    assert (ctx.job_id, ctx.uid, ctx.user, ctx.node) == (12, 0, "root", "node2")


def test_config_beside_slurm_conf_is_found(tmp_path: Path) -> None:
    """Hooks find slurm-resilience.yaml beside the slurm.conf slurmd gives them."""
    (tmp_path / "slurm.conf").write_text("")
    (tmp_path / "slurm-resilience.yaml").write_text("")
    env = {"SLURM_CONF": str(tmp_path / "slurm.conf")}
    assert runner.config_path(env) == str(tmp_path / "slurm-resilience.yaml")
    assert runner.config_path({"SLURM_RESILIENCE_CONFIG": "/x.yaml", **env}) == "/x.yaml"
    assert runner.config_path({}) is None


def test_problems_are_collected(step_module: types.ModuleType) -> None:
    """Each step's problems are gathered in order."""
    found = runner.run_steps(_ctx(), ["sr_test_steps:ok", "sr_test_steps:sick"])
    assert [p.reason for p in found] == ["gpu3 XID 79 (GPU fell off the bus) 12:01:07"]


def test_crashing_step_fails_open_by_default(step_module: types.ModuleType) -> None:
    """A bug in a step is logged and, under fail-open, lets the job run."""
    assert runner.run_steps(_ctx(), ["sr_test_steps:crash"]) == []


def test_crashing_step_fails_closed_when_configured(step_module: types.ModuleType) -> None:
    """Under fail-closed a crashing step drains the node with a reason naming it."""
    cfg = load_text(Config, "hooks:\n  on_internal_error: fail-closed\n")
    found = runner.run_steps(_ctx(cfg), ["sr_test_steps:crash"])
    assert found[0].reason == "prolog step crash crashed: RuntimeError"


def test_healthy_prolog_is_silent_and_calls_no_slurm(
    step_module: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A healthy prolog exits 0, prints nothing, and never creates a Slurm adapter."""
    monkeypatch.setitem(runner.STEPS, "prolog", ["sr_test_steps:ok"])
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(f"logging:\n  file: {tmp_path}/ev.jsonl\n  syslog: false\n")
    made: list[object] = []
    monkeypatch.setattr("slurm_resilience.slurm.adapter.from_config",
                        lambda cfg: made.append(cfg))
    env = {"SLURM_RESILIENCE_CONFIG": str(cfgfile), "SLURM_JOB_ID": "3",
           "SLURMD_NODENAME": "node1"}
    assert runner.main("prolog", [], env) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert made == []
    assert '"hook ok"' in (tmp_path / "ev.jsonl").read_text()


# Values a user's own SLURM_CONF/plugstack could hand the prolog: the SPANK plugin never
# checked them, so only the Python re-check stands between them and root.
FORGED = {
    "SPANK_SLURM_RESILIENCE_CKPT_URI": "s3://ckpt/../other-user/run",
    "SPANK_SLURM_RESILIENCE_HANG_TIMEOUT": "1",
    "SPANK_SLURM_RESILIENCE_HANG": "on\nlevel=info event=forged",
    "SPANK_SLURM_RESILIENCE_LEAF_PIN": "x" * 5000,
    "SPANK_SLURM_RESILIENCE_NCCL_TEST": "$(reboot)",
    "SPANK_SLURM_RESILIENCE_LD_PRELOAD": "/tmp/evil.so",
}


def test_forged_spank_variables_are_refused_by_the_python_recheck(
    step_module: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SPANK_SLURM_RESILIENCE_* set by something other than our plugin, with values the
    plugin would never pass: each reads as not given, and each refusal is logged once with
    the variable and why; the job still runs, and a valid option beside them is kept."""
    monkeypatch.setitem(runner.STEPS, "prolog", ["sr_test_steps:ok"])
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(f"logging:\n  file: {tmp_path}/ev.jsonl\n  syslog: false\n")
    env = {"SLURM_RESILIENCE_CONFIG": str(cfgfile), "SLURM_JOB_ID": "3",
           "SLURMD_NODENAME": "node1", **FORGED}
    ctx = HookContext.from_env("prolog", Config(), {**env, "SPANK_SLURM_RESILIENCE_HANG": "off"})
    assert ctx.job_option("CKPT_URI") == "" and ctx.job_option("hang") == "off"
    assert runner.main("prolog", [], env) == 0
    lines = (tmp_path / "ev.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    refused = {e["variable"]: e["why"] for e in events
               if e["event"] == "job option refused; the job runs without it"}
    assert refused == {
        "SPANK_SLURM_RESILIENCE_CKPT_URI": "expected s3://bucket/prefix without '..'",
        "SPANK_SLURM_RESILIENCE_HANG_TIMEOUT": "expected whole seconds, at least 10",
        "SPANK_SLURM_RESILIENCE_HANG": "must be 1-1023 printable ASCII characters without "
                                       "spaces",
        "SPANK_SLURM_RESILIENCE_LEAF_PIN": "must be 1-1023 printable ASCII characters "
                                           "without spaces",
        "SPANK_SLURM_RESILIENCE_NCCL_TEST": "expected 1",
        "SPANK_SLURM_RESILIENCE_LD_PRELOAD": "not an option of the slurm-resilience plugin",
    }
    assert not any(e.get("event") == "forged" for e in events)  # the newline forged no line
    assert [e.get("job_options") for e in events if e["event"] == "hook ok"] == [None]


def test_bad_config_keeps_gating_with_the_last_good_copy_and_says_where(
    step_module: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A typo in a file that loaded before: the prolog still runs its checks, with the
    last good copy's settings, says on stderr and in an error event which file, line and
    key broke, and still fails the job off a sick node."""
    from slurm_resilience.config import lastgood

    monkeypatch.setattr(lastgood, "STORE_DIR", str(tmp_path / "last-good"))
    seen: list[Config] = []
    original = step_module.sick

    def sick(ctx: HookContext) -> list[Problem]:
        seen.append(ctx.cfg)
        return original(ctx)  # type: ignore[no-any-return]

    monkeypatch.setattr(step_module, "sick", sick)
    monkeypatch.setitem(runner.STEPS, "prolog", ["sr_test_steps:sick"])
    drains: list[str] = []
    monkeypatch.setattr(runner, "act", lambda ctx, problems: drains.append(ctx.node))
    cfgfile = tmp_path / "c.yaml"
    good = (f"logging:\n  file: {tmp_path}/ev.jsonl\n  syslog: false\n"
            "hooks:\n  prolog_timeout_s: 7\n")
    cfgfile.write_text(good)
    env = {"SLURM_RESILIENCE_CONFIG": str(cfgfile), "SLURMD_NODENAME": "node1"}
    assert runner.main("prolog", [], env) == 1
    cfgfile.write_text(good + "  prolog_timeout: 3\n")
    assert runner.main("prolog", [], env) == 1
    assert drains == ["node1", "node1"]
    assert seen[1].hooks.prolog_timeout_s == 7 and seen[1].logging.file == seen[0].logging.file
    err = capsys.readouterr().err
    assert f"{cfgfile}:6: hooks.prolog_timeout: unknown key" in err
    assert "gating with " + str(tmp_path / "last-good") in err
    events = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    broken = [e for e in events if e["level"] == "error" and "config" in e["event"]]
    assert [(e["file"], e["line"], e["key"]) for e in broken] == [
        (str(cfgfile), 6, "hooks.prolog_timeout")]


def test_bad_config_with_no_copy_gates_with_the_built_in_defaults(
    step_module: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A file that never loaded on this node: the checks run with the built-in defaults,
    never none, and the health check exits 1 so slurmd logs it too."""
    from slurm_resilience.config import lastgood

    monkeypatch.setattr(lastgood, "STORE_DIR", str(tmp_path / "last-good"))
    monkeypatch.setitem(runner.STEPS, "healthcheck", ["sr_test_steps:ok"])
    monkeypatch.setattr(runner.log, "configure", lambda **kw: None)  # not the host's log
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("hooks:\n  prolog_timeout: 3\n")
    code = runner.main("healthcheck", [], {"SLURM_RESILIENCE_CONFIG": str(cfgfile)})
    assert code == 1
    err = capsys.readouterr().err
    assert "hooks.prolog_timeout: unknown key" in err
    assert err.rstrip().endswith("gating with built-in defaults")


IDLE = "NodeName=node2 CPUAlloc=0 CPUTot=2 State=IDLE Partitions=debug"


def _overrun_ctx(policy: str, answers: list[Any]) -> tuple[HookContext, FakeRunner]:
    fake = FakeRunner({"scontrol": answers})
    cfg = load_text(Config, f"hooks:\n  on_internal_error: {policy}\n")
    ctx = _ctx(cfg)
    ctx._adapter = SlurmAdapter(runner=fake)
    ctx.notes["step"] = "sr_test_steps:hang"
    return ctx, fake


def test_overrun_under_fail_closed_drains_with_our_reason_then_fails_the_prolog() -> None:
    """A prolog past its limit drains with an SR: reason naming the step, then exits 1."""
    ctx, fake = _overrun_ctx("fail-closed", [completed(IDLE), completed("")])
    assert runner.overrun(ctx, 20) == runner.EXIT_FAIL
    assert fake.calls[-1] == ["scontrol", "update", "NodeName=node2", "State=DRAIN",
                              "Reason=SR: hooks: prolog over its 20s limit in hang"]
    assert ctx.adapter.timeout == 5.0  # half the default 10 s grace per Slurm call


def test_overrun_under_fail_open_lets_the_job_run_and_calls_no_slurm() -> None:
    """Under fail-open an overrun is logged and the hook exits 0: no drain at all."""
    ctx, fake = _overrun_ctx("fail-open", [completed(IDLE)])
    assert runner.overrun(ctx, 20) == runner.EXIT_OK
    assert fake.calls == []


def test_overrun_whose_drain_fails_exits_0_rather_than_leave_slurms_reason() -> None:
    """If our drain can't be set (slurmctld away), the prolog exits 0, so that Slurm
    never drains with its own "Prolog error"."""
    ctx, fake = _overrun_ctx("fail-closed", [CommandTimeout(["scontrol"], "timed out")])
    assert runner.overrun(ctx, 20) == runner.EXIT_OK
    assert len(fake.calls) == 1


def test_watchdog_fires_on_a_stuck_step_and_exits_by_policy(
        step_module: types.ModuleType) -> None:
    """A step stuck past the limit: the watchdog drains with our reason and exits 1."""
    ctx, fake = _overrun_ctx("fail-closed", [completed(IDLE), completed("")])
    exited: list[int] = []
    released = threading.Event()

    def stuck(c: HookContext) -> list[Problem]:
        released.wait(60)
        return []

    def exit_(code: int) -> None:
        exited.append(code)
        released.set()

    step_module.stuck = stuck  # type: ignore[attr-defined]
    dog = runner.Watchdog(ctx, 0.05, exit=exit_).start()
    try:
        runner.run_steps(ctx, ["sr_test_steps:stuck"])
    finally:
        dog.cancel()
    assert exited == [runner.EXIT_FAIL]
    assert fake.calls[-1][-1] == "Reason=SR: hooks: prolog over its 0.05s limit in stuck"
