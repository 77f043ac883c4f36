"""Unit tests of the heartbeat slot, the training-side writer and pure hang detection."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO, as_user, make_traversable

from slurm_resilience import heartbeat
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.hang import detect
from slurm_resilience.heartbeat import slot as S
from slurm_resilience.heartbeat.writer import Heartbeat, process_start_ticks
from slurm_resilience.testing import FakeClock

CFG = HeartbeatSection(step_timeout_s=10, warmup_timeout_s=30, warmup_steps=2,
                       section_timeouts_s={"checkpoint": 100.0}, nccl_timeout_s=120,
                       nccl_margin_s=20)


def _read(path: Path) -> S.SlotView:
    return S.read_consistent(lambda: path.read_bytes())


def _slot(tmp_path: Path, **kw: object) -> tuple[Heartbeat, Path]:
    path = tmp_path / S.slot_filename(int(kw.get("rank", 0)))  # type: ignore[call-overload]
    args = {"rank": 0, "world_size": 2, **kw}
    return Heartbeat(str(path), **args), path  # type: ignore[arg-type]


def test_fresh_slot_decodes_with_header_and_no_beats(tmp_path: Path) -> None:
    """A new slot carries rank, world size, pid, job id and restart count, and no beat yet."""
    hb, path = _slot(tmp_path, rank=1, world_size=4, local_rank=1, job_id=77, restart_count=2,
                     step_timeout_s=5.0)
    v = _read(path)
    assert (v.rank, v.world_size, v.local_rank, v.job_id, v.restart_count) == (1, 4, 1, 77, 2)
    assert v.pid == os.getpid() and v.pid_start == process_start_ticks()
    assert v.beats == 0 and v.step == -1 and v.ckpt_step == -1 and v.section == ""
    assert v.job_step_timeout_s == 5.0
    assert os.stat(path).st_mode & 0o777 == 0o600
    hb.close()


def test_beats_record_step_and_step_time_stats(tmp_path: Path) -> None:
    """Beats store the step, count and step-time statistics (the first interval excluded),
    and the slot maps its monotonic times to Unix time."""
    clock = FakeClock(500.0, wall=1_700_000_000.0)
    path = tmp_path / S.slot_filename(0)
    hb = Heartbeat(str(path), rank=0, world_size=2, clock=clock)
    for step, dt in enumerate([30.0, 2.0, 1.0, 4.0, 2.0]):  # the first: start-up, excluded
        clock.advance(dt)
        hb.beat(step)
    v = _read(path)
    assert v.step == 4 and v.beats == 5 and v.last_dt == 2.0
    assert (v.min_dt, v.max_dt) == (1.0, 4.0)
    assert v.min_dt < v.ewma_dt < v.max_dt
    assert v.wall(v.last_beat) == 1_700_000_000.0 + 39.0
    hb.close()


def test_section_sets_name_and_leaving_counts_as_progress(tmp_path: Path) -> None:
    """A section is visible in the slot; leaving it restores the outer one and is progress."""
    hb, path = _slot(tmp_path)
    hb.beat(0)
    with hb.section("checkpoint"):
        v = _read(path)
        assert v.section == "checkpoint" and v.section_timeout_s == 0.0
        with hb.section("eval", timeout_s=7):
            assert _read(path).section == "eval"
        inner_exit = _read(path)
        assert inner_exit.section == "checkpoint"
    after = _read(path)
    assert after.section == "" and after.last_progress >= after.last_beat


def test_bad_section_name_is_refused(tmp_path: Path) -> None:
    """Section names must be short plain ASCII, since they go into the slot and reports."""
    hb, _ = _slot(tmp_path)
    with pytest.raises(ValueError, match="section name"), hb.section("bad name\n"):
        pass


def test_decode_rejects_garbage() -> None:
    """Wrong size, magic or non-finite numbers are format errors, never trusted."""
    with pytest.raises(S.SlotFormatError, match="bytes"):
        S.decode(b"x" * 10)
    with pytest.raises(S.SlotFormatError, match="magic"):
        S.decode(b"x" * S.SIZE)
    good = bytearray(S.SIZE)
    good[: S.HEADER.size] = S.encode_header(
        rank=0, world_size=1, local_rank=0, pid=1, pid_start=1, job_id=1, restart_count=0,
        clock_offset=float("nan"), created=0.0, job_step_timeout_s=0.0)
    with pytest.raises(S.SlotFormatError, match="finite"):
        S.decode(bytes(good))


def test_reader_waits_for_writer_to_finish() -> None:
    """An odd seqlock (write in progress) makes the reader retry until it is even."""
    base = bytearray(S.SIZE)
    base[: S.HEADER.size] = S.encode_header(
        rank=0, world_size=1, local_rank=0, pid=1, pid_start=1, job_id=1, restart_count=0,
        clock_offset=0.0, created=0.0, job_step_timeout_s=0.0)
    busy = bytearray(base)
    S.SEQ.pack_into(busy, S.SEQ_OFF, 3)
    S.SEQ.pack_into(base, S.SEQ_OFF, 4)
    reads = iter([bytes(busy), bytes(busy), bytes(base), bytes(base)])
    assert S.read_consistent(lambda: next(reads)).job_id == 1
    with pytest.raises(S.SlotFormatError, match="kept changing"):
        S.read_consistent(lambda: bytes(busy), attempts=3)


def test_module_api_is_noop_outside_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SLURM_JOB_ID beat/section/checkpointed do nothing and raise nothing."""
    monkeypatch.setattr(heartbeat, "_current", None)
    monkeypatch.setattr(heartbeat, "_disabled", False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    heartbeat.beat(1)
    with heartbeat.section("checkpoint"):
        heartbeat.checkpointed(1)
    assert heartbeat.current() is None


def test_module_api_writes_slot_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a job the slot is created in the job's run dir with env rank and options."""
    (tmp_path / "job-42").mkdir(mode=0o700)
    monkeypatch.setattr(heartbeat, "_current", None)
    monkeypatch.setattr(heartbeat, "_disabled", False)
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_RESILIENCE_RUN_DIR": str(tmp_path), "SLURM_RESILIENCE_HANG_TIMEOUT": "12.5",
           "SLURM_RESILIENCE_HANG": "observe", "SLURM_RESTART_COUNT": "1"}
    hb = heartbeat.init(env)
    assert hb is not None
    heartbeat.beat(9)
    heartbeat.checkpointed(8)
    v = _read(tmp_path / "job-42" / "hb-rank-3.slot")
    assert (v.rank, v.world_size, v.step, v.ckpt_step, v.restart_count) == (3, 4, 9, 8, 1)
    assert v.job_step_timeout_s == 12.5 and v.flags & S.FLAG_OBSERVE
    heartbeat.done()
    assert _read(tmp_path / "job-42" / "hb-rank-3.slot").flags & S.FLAG_DONE
    hb.close()
    monkeypatch.setattr(heartbeat, "_current", None)


def test_bad_timeout_env_is_a_clear_error(tmp_path: Path) -> None:
    """A non-numeric SLURM_RESILIENCE_HANG_TIMEOUT names the variable and value."""
    with pytest.raises(ValueError, match="SLURM_RESILIENCE_HANG_TIMEOUT='soon'"):
        heartbeat.init({"SLURM_JOB_ID": "1", "SLURM_RESILIENCE_HANG_TIMEOUT": "soon",
                        "SLURM_RESILIENCE_RUN_DIR": str(tmp_path)})


# -- detection -------------------------------------------------------------------------------

def _view(**kw: object) -> S.SlotView:
    base = S.SlotView(rank=0, world_size=2, local_rank=0, pid=1, pid_start=1, job_id=5,
                      restart_count=0, clock_offset=0.0, created=0.0, job_step_timeout_s=0.0,
                      flags=0, step=10, last_beat=100.0, beats=11, last_dt=1.0, ewma_dt=1.0,
                      min_dt=1.0, max_dt=1.0, ckpt_step=-1, section_start=0.0,
                      section_timeout_s=0.0, section="")
    return replace(base, **kw)  # type: ignore[arg-type]


def _judge(views: list[S.SlotView], now: float, cfg: HeartbeatSection = CFG,
           tuned: float | None = None) -> detect.JobVerdict:
    return detect.judge(5, views, now, cfg, alive={v.rank: True for v in views}, tuned=tuned)


def test_rank_silent_past_step_timeout_is_hung() -> None:
    """A warmed-up rank with no beat for longer than the step timeout is hung; others ok."""
    v = _judge([_view(rank=0, last_beat=100.0), _view(rank=1, last_beat=105.0)], now=111.0)
    assert [r.state for r in v.ranks] == ["hung", "ok"]
    assert v.hung[0].timeout_kind == "step" and v.hung[0].idle_s == 11.0


def test_rank_within_step_timeout_is_ok() -> None:
    """A rank that beat within the step timeout is not hung."""
    assert not _judge([_view(last_beat=100.0)], now=109.0).hung


def test_warmup_uses_longer_timeout() -> None:
    """Before the first beats the warm-up timeout applies, not the step timeout."""
    v = _judge([_view(beats=0, step=-1, last_beat=0.0, created=100.0)], now=125.0)
    assert not v.hung and v.ranks[0].timeout_kind == "warmup"
    assert _judge([_view(beats=2, last_beat=100.0)], now=131.0).hung


def test_long_checkpoint_section_is_not_a_hang() -> None:
    """Inside section('checkpoint') the section timeout applies, longer than the step one."""
    view = _view(section="checkpoint", section_start=100.0, last_beat=99.0)
    v = _judge([view], now=150.0)
    assert not v.hung and v.ranks[0].timeout_kind == "section checkpoint"
    assert _judge([view], now=201.0).hung


def test_job_timeout_is_bounded_by_nccl_cap() -> None:
    """A job's own timeout applies but never above nccl_timeout_s - nccl_margin_s."""
    timeout, kind = detect.rank_timeout(_view(job_step_timeout_s=5000.0), CFG, None)
    assert (timeout, kind) == (100.0, "job")
    assert detect.rank_timeout(_view(job_step_timeout_s=0.01), CFG, None) == (1.0, "job")


def test_done_and_dead_ranks_are_not_hung() -> None:
    """A finished rank (done flag) or one whose process is gone is never a hang."""
    views = [_view(rank=0, flags=S.FLAG_DONE), _view(rank=1)]
    v = detect.judge(5, views, 500.0, CFG, alive={0: True, 1: False})
    assert [r.state for r in v.ranks] == ["done", "dead"]


def test_modes_and_per_job_opt_out() -> None:
    """Cluster observe mode or a rank's opt-out flag narrows the action."""
    assert _judge([_view()], 0.0).mode == "act"
    assert _judge([_view(flags=S.FLAG_OBSERVE)], 0.0).mode == "observe"
    assert _judge([_view(flags=S.FLAG_OFF)], 0.0).mode == "off"
    assert _judge([_view()], 0.0, replace(CFG, mode="observe")).mode == "observe"


def test_auto_tune_uses_max_step_time_and_never_shrinks() -> None:
    """Auto-tune = max step time over ranks times the factor, at least the previous value."""
    cfg = replace(CFG, auto_tune=True, auto_tune_factor=4, auto_tune_min_steps=5)
    views = [_view(rank=0, max_dt=2.0, beats=10), _view(rank=1, max_dt=3.0, beats=10)]
    assert detect.auto_tune(views, cfg, None) == 12.0
    assert detect.auto_tune(views, cfg, 50.0) == 50.0
    assert detect.auto_tune([_view(beats=3, max_dt=9.0)], cfg, None) is None
    v = _judge([_view(last_beat=100.0, max_dt=2.0, beats=10)], now=109.5, cfg=cfg)
    assert v.tuned_timeout_s == 8.0 and v.hung[0].timeout_kind == "auto"


def test_stragglers_are_persistently_slower_ranks() -> None:
    """A rank whose mean step time is well above the median is a straggler."""
    views = [_view(rank=r, ewma_dt=1.0) for r in range(3)] + [_view(rank=3, ewma_dt=2.0)]
    assert detect.stragglers(views) == (3,)
    assert detect.stragglers([_view(rank=r, ewma_dt=1.0) for r in range(4)]) == ()


def test_unreadable_cluster_config_disables_heartbeat_not_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken config file only turns hang detection off for the rank, with a message."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("heartbeat:\n  step_timeout: 3\n")
    monkeypatch.setattr(heartbeat, "_current", None)
    monkeypatch.setattr(heartbeat, "_disabled", False)
    assert heartbeat.init({"SLURM_JOB_ID": "9", "SLURM_RESILIENCE_CONFIG": str(bad)}) is None
    heartbeat.beat(1)
    assert "hang detection is off" in capsys.readouterr().err


def test_a_run_dir_the_job_cannot_write_turns_hang_detection_off_not_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        test_users: tuple[str, ...]) -> None:
    """A job that does not see its run-dir tmpfs (a private mount namespace made before the
    prolog) finds the root-only mount point: the rank trains on, and its stderr says why."""
    (tmp_path / "job-43").mkdir(mode=0o700)  # root's, as under an unseen mount
    pw = pwd.getpwnam(test_users[0])
    make_traversable(tmp_path)
    monkeypatch.setattr(heartbeat, "_current", None)
    monkeypatch.setattr(heartbeat, "_disabled", False)
    code = ("import sys; from slurm_resilience import heartbeat\n"
            "assert heartbeat.init(dict(SLURM_JOB_ID='43', SLURM_PROCID='0',"
            f" SLURM_RESILIENCE_RUN_DIR={str(tmp_path)!r})) is None\n"
            "heartbeat.beat(1); print('trained on')\n")
    out = subprocess.run([sys.executable, "-c", code], **as_user(pw.pw_uid),
                         capture_output=True, text=True, cwd="/", check=False,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "trained on\n"
    assert "couldn't create this rank's slot" in out.stderr
    assert "Permission denied; hang detection is off for this rank" in out.stderr


@pytest.mark.parametrize(("body", "done"), [("pass", True),
                                            ("raise RuntimeError('peer closed')", False)])
def test_a_rank_is_done_at_exit_unless_it_dies_on_an_exception(
        tmp_path: Path, body: str, done: bool) -> None:
    """A script that ends without calling done() is done at exit; one that ends on an
    uncaught exception (a collective raising when a peer died) crashed: not done, so the
    watcher sees it dead and goodput counts its run as failed."""
    (tmp_path / "job-7").mkdir()
    script = ("from slurm_resilience import heartbeat\n"
              "heartbeat.beat(1)\n"
              f"{body}\n")
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_RESILIENCE_RUN_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert (got.returncode == 0) == done, got.stderr
    view = _read(tmp_path / "job-7" / S.slot_filename(0))
    assert view.beats == 1
    assert bool(view.flags & S.FLAG_DONE) == done
