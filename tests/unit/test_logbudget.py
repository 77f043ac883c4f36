"""The log budget: a few lines per key and window, then one summary line; keys bounded;
users' text cut short and escaped. Time is an injected clock, never slept."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import events_saying, logged

from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import OTHER_KEYS, LogBudget, flush_all, user_text
from slurm_resilience.testing import FakeClock

log = get_logger("test")


def test_a_flood_writes_the_budget_then_one_summary_per_window(events: Path) -> None:
    """4,096 refusals of one job in a minute write 10 lines, and the window's end writes one
    summary counting all of them; the next window starts a fresh budget."""
    clock = FakeClock(1000.0)
    budget = LogBudget(log, "refused heartbeat slots", lines=10, window_s=60, clock=clock)
    start, written = clock.now, 0
    for i in range(4096):
        clock.advance(0.01)
        written += budget.log("job 12", "refused heartbeat slot", slot=i)
    assert written == 10
    assert len(logged(events)) == 10
    clock.advance(start + 61 - clock.now)
    assert budget.flush() == 1
    summary = logged(events)[-1]
    assert summary["event"] == ("4,096 refused heartbeat slots of job 12 in the last "
                                "minute (4,086 not logged)")
    assert (summary["count"], summary["not_logged"], summary["summary"]) == (4096, 4086, True)
    assert budget.log("job 12", "refused heartbeat slot", slot=0)
    assert len(logged(events)) == 12


def test_keys_have_budgets_of_their_own(events: Path) -> None:
    """One user's flood spends that key's lines only: another job's first refusal is logged."""
    clock = FakeClock(1000.0)
    budget = LogBudget(log, "refused requests", lines=2, clock=clock)
    for _ in range(50):
        budget.log("uid 1001", "request refused")
    assert budget.log("uid 1002", "request refused")
    assert len(events_saying(events, "request refused")) == 3


def test_a_window_within_budget_writes_no_summary(events: Path) -> None:
    """A key that stayed within its lines needs no summary: the lines already said it all."""
    clock = FakeClock(1000.0)
    budget = LogBudget(log, "refused messages", lines=3, clock=clock)
    budget.log("peer 10.0.0.5", "refused a message")
    clock.advance(61)
    assert budget.flush() == 0
    assert budget.stats().keys == 0
    assert len(logged(events)) == 1


def test_the_summary_is_written_by_the_next_event_when_nothing_flushes(events: Path) -> None:
    """Without a flush, the next use of the budget ends the due windows, and the summary
    says how long the window really was."""
    clock = FakeClock(1000.0)
    budget = LogBudget(log, "refused requests", lines=1, clock=clock)
    budget.log("uid 1001", "request refused")
    budget.log("uid 1001", "request refused")
    clock.advance(300)
    budget.log("uid 1002", "request refused")
    texts = [e["event"] for e in logged(events)]
    assert texts == ["request refused",
                     "2 refused requests of uid 1001 in the last 5 minutes (1 not logged)",
                     "request refused"]


def test_flush_all_writes_every_budgets_due_summaries(events: Path) -> None:
    """The agent's loop flushes every budget of the process with one call."""
    clock = FakeClock(1000.0)
    budgets = [LogBudget(log, f"events {i}", lines=1, clock=clock) for i in range(3)]
    for budget in budgets:
        budget.log("k", "x")
        budget.log("k", "x")
    clock.advance(60)
    assert flush_all() >= 3
    assert len(events_saying(events, "of k in the last minute (1 not logged)")) == 3


def test_many_keys_share_one_entry_past_the_bound(events: Path) -> None:
    """Varying the key (new job ids, new peers) buys no more lines past ``max_keys``: the
    rest share one "other keys" budget, so the table and the log stay bounded."""
    clock = FakeClock(1000.0)
    budget = LogBudget(log, "refused slots", lines=2, max_keys=4, clock=clock)
    for key in range(1000):
        budget.log(f"job {key}", "refused slot")
    assert budget.stats().keys == 4
    assert budget.stats().lines == 3 + 2  # one event for each of 3 keys, 2 of the rest
    clock.advance(60)
    budget.flush()
    summary = logged(events)[-1]
    assert summary["key"] == OTHER_KEYS and summary["count"] == 997


def test_a_line_can_go_out_at_another_level(events: Path) -> None:
    """A handler's crash is an error even when it shares a budget with refusals."""
    budget = LogBudget(log, "refused requests", clock=FakeClock(1000.0))
    budget.log("uid 1", "handler failed", level="error")
    assert logged(events)[-1]["level"] == "error"


def test_bad_budgets_are_refused() -> None:
    """A level that is not a log level, or an empty budget, fails at construction."""
    with pytest.raises(ValueError, match="valid levels are"):
        LogBudget(log, "x", level="loud")
    with pytest.raises(ValueError, match="at least 1"):
        LogBudget(log, "x", lines=0)


def test_user_text_is_short_and_one_printable_line() -> None:
    """A user's payload is cut at the limit and its escapes and newlines made visible."""
    text = user_text("\x1b]0;owned\x07\nSR: fake line" + "A" * 10_000)
    assert len(text) < 300 and "\n" not in text and "\x1b" not in text
    assert text.startswith("\\x1b]0;owned\\x07\\nSR: fake line")
    assert text.endswith("more]")
