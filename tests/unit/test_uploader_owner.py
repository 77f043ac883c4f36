"""The uploader's records have one owner thread: others send it commands, never touch them."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.config import Config, load_text
from slurm_resilience.uploader.journal import StepState, new_record
from slurm_resilience.uploader.owner import Command, NotOwnerThread, Owner
from slurm_resilience.uploader.records import FailJob, Forget, StepReport
from slurm_resilience.uploader.service import Uploader

ROOT = Peer(pid=1, uid=0, gid=0)
WAIT_S = 60.0  # generous: the machine is loaded; nothing here waits on time passing


@dataclass(frozen=True)
class _Hold(Command[Uploader, None]):
    """Keeps the owner busy until ``release`` is set (a stuck owner, made on purpose)."""

    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def apply(self, up: Uploader) -> None:
        self.started.set()
        assert self.release.wait(WAIT_S), "the test never released the owner"


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Uploader]:
    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme/{{node}}"]) + "\n")
    # A short answer bound: the owner below is held on an event, so it never answers in
    # time however fast or slow the machine is.
    uploader = Uploader(cfg, "n1", owner_timeout_s=0.5)
    uploader.jobs[7] = new_record(7, 1000, 1000, "alice", str(tmp_path / "nvme" / "n1"))
    yield uploader
    uploader.owner.timeout_s = WAIT_S
    uploader.close()


def _held(up: Uploader) -> tuple[_Hold, threading.Thread]:
    hold = _Hold()
    t = threading.Thread(target=up.ask, args=(hold, WAIT_S), daemon=True)
    t.start()
    assert hold.started.wait(WAIT_S)
    return hold, t


def test_records_change_only_on_the_owner_thread(up: Uploader) -> None:
    """A worker (any other thread) can't write the journal, start a stage-in or apply a
    report itself; the same report sent as a command changes the record."""
    rec = copy.deepcopy(up.jobs[7])
    with pytest.raises(NotOwnerThread, match="only the owner thread 'ckpt-records-n1'"):
        up.write(rec)
    with pytest.raises(NotOwnerThread):
        up.start_stagein(rec)
    report = StepReport(7, 3, {"state": StepState.COMMITTED})
    with pytest.raises(NotOwnerThread):
        report.apply(up)
    with pytest.raises(NotOwnerThread):
        FailJob(7, "a bug").apply(up)
    assert "3" not in up.jobs[7]["steps"] and up.jobs[7]["state"] == "active"
    up.tell(report)
    assert up.jobs[7]["steps"]["3"]["state"] == StepState.COMMITTED
    assert not up.journal.path(0).exists() and up.journal.path(7).is_file()


def test_a_request_gets_an_error_naming_a_stuck_owner(up: Uploader) -> None:
    """While the owner is stuck, a request answers an error that says so (and what it is
    busy with); a command that never started is withdrawn, not applied later."""
    hold, t = _held(up)
    with pytest.raises(RequestError, match=r"no answer to Lookup within 0.5s: the owner "
                                           r"is still busy with _Hold"):
        up.on_status({"job_id": 7}, ROOT)
    with pytest.raises(RequestError, match="withdrawn and will not run"):
        up.on_job_start({"job_id": 8, "uid": 1000, "gid": 1000, "user": "alice"}, ROOT)
    hold.release.set()
    t.join(WAIT_S)
    up.owner.timeout_s = WAIT_S  # free again: answers come, however loaded the machine
    assert up.on_status({"job_id": 7}, ROOT)["ok"] is True
    assert 8 not in up.jobs  # the withdrawn job_start never ran


def test_the_owner_answers_a_commands_error_to_its_caller_and_goes_on() -> None:
    @dataclass(frozen=True)
    class Add(Command[list[int], int]):
        n: int

        def apply(self, state: list[int]) -> int:
            if self.n < 0:
                raise ValueError(f"negative: {self.n}")
            state.append(self.n)
            return sum(state)

    owner: Owner[list[int]] = Owner([], "test-owner", WAIT_S)
    try:
        assert owner.ask(Add(2)) == 2
        with pytest.raises(ValueError, match="negative: -1"):
            owner.ask(Add(-1))
        assert owner.ask(Add(3)) == 5
    finally:
        owner.stop()
    assert owner.state == [2, 3]


def test_the_agents_tick_never_waits_for_a_stuck_owner(up: Uploader) -> None:
    """The tick is queued to the owner, not waited for; while one is queued, another is
    not added (a stuck owner doesn't pile ticks up)."""
    hold, t = _held(up)
    up.tick()
    first = up._ticking
    up.tick()
    assert first is not None and up._ticking is first and not first.done()
    hold.release.set()
    t.join(WAIT_S)
    first.result(WAIT_S)  # the owner ran it once it was free


def test_a_late_report_about_a_forgotten_job_does_not_bring_its_record_back(
        up: Uploader) -> None:
    """A worker's report that arrives after the job was forgotten is dropped: the owner
    never writes a journal record for a job it no longer tracks."""
    up.tell(StepReport(7, 1, {"state": StepState.PENDING}))
    assert up.journal.path(7).is_file()
    up.tell(Forget(7))
    up.tell(StepReport(7, 1, {"state": StepState.COMMITTED}))
    assert 7 not in up.jobs and not up.journal.path(7).exists()
