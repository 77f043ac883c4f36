"""A rank that died on a node runs that node's HealthCheckProgram at once (bounded)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_resilience import log
from slurm_resilience.config import Config
from slurm_resilience.hang.deathcheck import GRACE_S, PLAIN_PATH, DeathCheck
from slurm_resilience.hooks.context import ENV_AFTER_RANK_DEATH
from slurm_resilience.proc import CommandError, Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeClock

PROGRAM = "/opt/site/bin/healthcheck"


class Slurm:
    """``scontrol show config`` with the HealthCheckProgram a test sets; counts the asks."""

    def __init__(self, program: str = PROGRAM, fails: bool = False):
        self.program, self.fails, self.asked = program, fails, 0

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        if list(argv[1:]) == ["--version"]:
            return Completed(tuple(argv), 0, "slurm 22.05.8\n", "", 0.0)
        assert list(argv[1:3]) == ["show", "config"], argv
        self.asked += 1
        if self.fails:
            raise CommandError(argv, "slurm_load_ctl_conf error: Socket timed out")
        return Completed(tuple(argv), 0, f"HealthCheckInterval = 300 sec\n"
                                         f"HealthCheckProgram      = {self.program}\n", "", 0.0)


class Program:
    """The program's runs: (argv, env, timeout); answers with ``rc``."""

    def __init__(self, rc: int = 0, error: str = ""):
        self.rc, self.error = rc, error
        self.runs: list[tuple[list[str], dict[str, str], float]] = []

    def __call__(self, argv: Sequence[str], env: dict[str, str], timeout: float) -> Completed:
        self.runs.append((list(argv), env, timeout))
        if self.error:
            raise CommandError(argv, self.error)
        return Completed(tuple(argv), self.rc, "", "drained node1: XID 79", 0.4)


@pytest.fixture
def logged(tmp_path: Path) -> Iterator[Callable[[], list[dict[str, str]]]]:
    """The events logged so far, as the agent's JSON log holds them."""
    path = tmp_path / "agent.jsonl"
    log.configure(mode="json", level="info", file=str(path))
    try:
        yield lambda: [json.loads(line) for line in path.read_text().splitlines()]
    finally:
        log.reset()


def run_now(fn: Callable[[], None]) -> None:
    fn()


def check(cfg: Config, slurm: Slurm, program: Program, clock: FakeClock,
          aside: Callable[[Callable[[], None]], None] = run_now) -> DeathCheck:
    return DeathCheck(lambda: cfg, "node1", SlurmAdapter(runner=slurm), clock,  # type: ignore[arg-type]
                      run=program, aside=aside)


def test_a_death_runs_slurms_health_check_program_as_slurmd_would() -> None:
    cfg, slurm, program, clock = Config(), Slurm(), Program(), FakeClock()
    d = check(cfg, slurm, program, clock)
    assert d.rank_died(42, [1])
    assert program.runs == [([PROGRAM], {"SLURMD_NODENAME": "node1", "PATH": PLAIN_PATH,
                                         ENV_AFTER_RANK_DEATH: "1"},
                             cfg.hooks.healthcheck_timeout_s + GRACE_S)]
    # A user decides when their ranks die: one run per check_on_rank_death_s (30 s).
    clock.advance(29)
    assert not d.rank_died(43, [0]) and len(program.runs) == 1
    clock.advance(1)
    assert d.rank_died(43, [0]) and len(program.runs) == 2
    assert slurm.asked == 1  # HealthCheckProgram is read once
    program.rc = 1  # the gate failed (it drained the node itself): said, not acted on here
    clock.advance(30)
    assert d.rank_died(44, [0]) and d.runs == 3


def test_one_run_at_a_time() -> None:
    held: list[Callable[[], None]] = []
    d = check(Config(), Slurm(), Program(), FakeClock(), aside=held.append)
    assert d.rank_died(42, [0])
    d.last = -1e9  # even past the interval, a run in flight is not doubled
    assert not d.rank_died(42, [1])
    held.pop()()
    assert d.rank_died(42, [1])


def test_zero_turns_it_off() -> None:
    base = Config()
    cfg = replace(base, health=replace(base.health, check_on_rank_death_s=0))
    slurm, program = Slurm(), Program()
    assert not check(cfg, slurm, program, FakeClock()).rank_died(42, [0])
    assert slurm.asked == 0 and program.runs == []


@pytest.mark.parametrize("value", ["(null)", "", "healthcheck.sh"])
def test_no_usable_program_is_said_once_and_nothing_runs(
        value: str, logged: Callable[[], list[dict[str, str]]]) -> None:
    clock, program = FakeClock(), Program()
    d = check(Config(), Slurm(value), program, clock)
    for _ in range(3):
        d.rank_died(42, [0])
        clock.advance(60)
    assert program.runs == []
    said = [e for e in logged() if "no HealthCheckProgram" in e["event"]]
    assert len(said) == 1 and said[0]["level"] == "warning"


def test_slurm_unreadable_or_a_program_that_cant_start_is_said_and_asked_again(
        logged: Callable[[], list[dict[str, str]]]) -> None:
    clock, slurm, program = FakeClock(), Slurm(fails=True), Program()
    d = check(Config(), slurm, program, clock)
    d.rank_died(42, [0])
    assert program.runs == []
    assert [e["level"] for e in logged() if "couldn't read HealthCheckProgram" in e["event"]] \
        == ["warning"]
    slurm.fails = False
    program.error = "couldn't start: [Errno 2] No such file or directory"
    clock.advance(30)
    assert d.rank_died(42, [0])
    assert slurm.asked == 2 and len(program.runs) == 1
    failed = [e for e in logged() if "couldn't run HealthCheckProgram" in e["event"]]
    assert failed and failed[0]["level"] == "error" and "Errno 2" in failed[0]["error"]
    assert not d.busy  # the next death runs again
