"""The hook runner: config discovery, steps, watchdog policy, exit codes."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_resilience.config import Config, load_text
from slurm_resilience.hooks import runner
from slurm_resilience.hooks.context import HookContext, Problem


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
    monkeypatch.setattr("slurm_resilience.hooks.context.from_config",
                        lambda cfg: made.append(cfg))
    env = {"SLURM_RESILIENCE_CONFIG": str(cfgfile), "SLURM_JOB_ID": "3",
           "SLURMD_NODENAME": "node1"}
    assert runner.main("prolog", [], env) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert made == []
    assert '"hook ok"' in (tmp_path / "ev.jsonl").read_text()


def test_bad_config_lets_jobs_run_but_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken config file makes the prolog complain on stderr but not block jobs."""
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("hooks:\n  prolog_timeout: 3\n")
    code = runner.main("prolog", [], {"SLURM_RESILIENCE_CONFIG": str(cfgfile)})
    assert code == 0
    assert "hooks.prolog_timeout: unknown key" in capsys.readouterr().err
