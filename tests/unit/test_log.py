"""Structured logging: JSON lines with context, and no secrets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_resilience import log


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    yield
    log.reset()


def test_json_lines_carry_component_node_and_job(tmp_path: Path) -> None:
    """Every JSON event names its component, node and job id."""
    f = tmp_path / "events.jsonl"
    log.configure(mode="json", level="info", file=str(f), node="node3", job_id=42)
    log.get_logger("health").info("gate ran", checks=5)
    event = json.loads(f.read_text().splitlines()[-1])
    assert event["component"] == "health"
    assert event["node"] == "node3"
    assert event["job_id"] == 42
    assert event["event"] == "gate ran"
    assert event["level"] == "info"
    assert "timestamp" in event


def test_secrets_never_reach_the_log(tmp_path: Path) -> None:
    """Values under secret-looking keys and credentials in URLs are redacted."""
    f = tmp_path / "events.jsonl"
    log.configure(mode="json", level="info", file=str(f))
    log.get_logger("s3").info(
        "upload", aws_secret_access_key="abc123", settings={"password": "hunter2"},
        url="https://AKIAXX:topsecret@s3.example.org/bucket",
    )
    text = f.read_text()
    assert "abc123" not in text and "hunter2" not in text and "topsecret" not in text
    event = json.loads(text.splitlines()[-1])
    assert event["aws_secret_access_key"] == "***"
    assert event["url"] == "https://***@s3.example.org/bucket"


def test_level_filters_events(tmp_path: Path) -> None:
    """Events below the configured level are dropped."""
    f = tmp_path / "events.jsonl"
    log.configure(mode="json", level="warning", file=str(f))
    logger = log.get_logger("x")
    logger.info("quiet")
    logger.warning("loud")
    assert [json.loads(x)["event"] for x in f.read_text().splitlines()] == ["loud"]


def test_cli_mode_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI renders readable key=value lines on stderr, not JSON."""
    log.configure(mode="cli", level="info")
    log.get_logger("cli").info("hello", node="node1")
    err = capsys.readouterr().err
    assert "hello" in err and "node=node1" in err and not err.lstrip().startswith("{")


def test_unknown_level_is_rejected() -> None:
    """A misspelt level is an error naming the valid ones."""
    with pytest.raises(ValueError, match="valid levels"):
        log.configure(level="verbose")


def test_user_text_never_splits_or_forges_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A newline, an escape sequence or a line separator in a job name stays on its line,
    in a value or quoted in the event text itself."""
    name = "train\nslurmctld: fake line\x1b[2J\u2028more"
    log.configure(mode="cli", level="info")
    try:
        log.get_logger("hooks").info(f"job {name} started", job_name=name,
                                     options={"COMMENT": "a\rb"})
    finally:
        log.reset()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\u2028" not in err
    assert "job train\\nslurmctld: fake line\\x1b[2J\\u2028more started" in err


def test_json_lines_bound_a_huge_user_value(tmp_path: Path) -> None:
    """A 100 kB job comment is cut to a bounded value that says how much was left out."""
    log.configure(mode="json", file=str(tmp_path / "ev.jsonl"))
    try:
        log.get_logger("hooks").warning("x", comment="c" * 100_000)
    finally:
        log.reset()
    event = json.loads((tmp_path / "ev.jsonl").read_text())
    assert event["comment"] == "c" * log.MAX_VALUE + "...[95904 more]"


def test_loggers_bind_context_as_structlog_does(tmp_path: Path) -> None:
    """bind adds keys to every later event of that logger; unbind drops them."""
    log.configure(mode="json", file=str(tmp_path / "ev.jsonl"))
    try:
        base = log.get_logger("agent")
        bound = base.bind(job_id=7)
        bound.warning("a")
        bound.unbind("job_id").warning("b")
    finally:
        log.reset()
    events = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("job_id")) for e in events] == [("a", 7), ("b", None)]
    assert all(e["component"] == "agent" for e in events)
