"""A save at the fault (checkpoint/rescue.py, rescue_restore.py): the last finished step of a
replicated state, written by one rank while its main thread is blocked in a collective with
a hung peer (or as the training raises), and a relaunch that resumes from it, a spare
getting it from a node that has it. Real gloo ranks (forked, CPU) and real DDP."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import dcp_ranks
import pytest
import torch

from slurm_resilience import heartbeat
from slurm_resilience.checkpoint import rescue as R
from slurm_resilience.checkpoint.commit import step_name
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.heartbeat.writer import Heartbeat, Progress

JOB = 31


def progress(**kw: object) -> Progress:
    base = {"beats": 10, "step": 10, "last": 100.0, "step_s": 0.5, "in_section": False,
            "over": False, "step_timeout_s": 0.0}
    base.update(kw)
    return Progress(**base)  # type: ignore[arg-type]


def test_a_silent_loop_is_due_after_five_step_times_and_never_twice_at_one_beat() -> None:
    p = progress()
    assert R.silence_after(p) == 2.5
    assert not R.due(p, 102.4, -1)
    assert R.due(p, 102.6, -1)
    assert not R.due(p, 102.6, 10)  # rescued (or refused) at this beat already
    assert R.silence_after(progress(step_s=0.01)) == R.MIN_SILENCE_S
    assert R.silence_after(progress(step_s=60.0, step_timeout_s=120.0)) == 60.0
    assert not R.due(progress(in_section=True), 1e9, -1)  # a save or an eval: its own timeout
    assert not R.due(progress(over=True), 1e9, -1)
    assert not R.due(progress(beats=1), 1e9, -1)  # no step time yet


def test_keys_hash_tells_states_with_other_keys_apart_and_a_dtensor_is_never_rescued(
        tmp_path: Path) -> None:
    a = {"model": {"w": torch.zeros(2), "b": torch.zeros(1)}, "n": 3}
    assert R.keys_hash(a) == R.keys_hash({"n": 5, "model": {"b": torch.ones(1),
                                                            "w": torch.ones(2)}})
    assert R.keys_hash(a) != R.keys_hash({**a, "rank1_rng": torch.zeros(1)})
    assert R.keys_hash(a) not in (0, R.SHARDED)
    assert dcp_ranks.run_ranks(_dtensor_hash, 1, tmp_path) == [0]


def _dtensor_hash(rank: int, world: int, job: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    assert R.keys_hash({"w": distribute_tensor(torch.zeros(4), mesh, [Shard(0)])}) == R.SHARDED


def test_a_state_in_device_memory_is_named_and_never_saved_at_the_fault() -> None:
    assert R._device_of({"m": {"w": torch.zeros(2)}, "n": [1, torch.ones(1)]}) == ""
    assert R._device_of({"m": {"w": torch.zeros(2, device="meta")}}) == "meta"


def _one_rank(tmp_path: Path) -> tuple[CheckpointManager, R.Rescue, Heartbeat]:
    job = tmp_path / "job"
    job.mkdir()
    hb = Heartbeat(str(tmp_path / "slot"), rank=0, world_size=1)
    mgr = CheckpointManager(job)
    rescue = R.Rescue(mgr, hb)
    mgr._rescue, mgr._rescue_wanted = rescue, True
    return mgr, rescue, hb


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, hb: Heartbeat,
           steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        hb.beat(step)


def test_a_rescue_saves_the_last_beat_and_a_restore_takes_it_over_an_older_commit(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    mgr, rescue, hb = _one_rank(tmp_path)
    _train(model, opt, hb, range(1, 3))
    mgr.save(2, model=model, optimizer=opt)  # names the state and agrees on its keys
    mgr.wait()
    _train(model, opt, hb, range(3, 6))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    got = rescue.now("a test")
    assert got is not None and got.step == 5 and got.path.name == step_name(5)
    assert R.rescued_steps(R.rescue_root(mgr.job_dir)) == [5]
    assert "checkpoint: rescue: saved step 5 at the fault (a test)" in capfd.readouterr().err
    assert rescue.now("again") is got  # once per beat

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    again = CheckpointManager(mgr.job_dir)
    again._rescue, again._rescue_wanted = R.Rescue(again, hb), True
    loaded = again.load_latest(model=fresh, optimizer=fresh_opt)
    assert loaded is not None and loaded.step == 5
    assert loaded.path == R.rescue_root(mgr.job_dir) / step_name(5)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert fresh_opt.state_dict()["state"][0]["step"].item() == 5  # Adam's count came too
    # A newer committed step makes the rescue useless: it goes.
    again.save(6, model=fresh, optimizer=fresh_opt)
    again.wait()
    assert R.rescued_steps(R.rescue_root(mgr.job_dir)) == []


def test_a_rescue_is_refused_mid_optimizer_step_after_an_unbeaten_step_and_unagreed(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr, rescue, hb = _one_rank(tmp_path)
    _train(model, opt, hb, range(1, 3))
    assert rescue.refusal(hb.progress()).startswith("no state yet")
    mgr.save(2, model=model, optimizer=opt)
    mgr.wait()
    assert rescue.refusal(hb.progress()) == "step 2 is saved already"
    _train(model, opt, hb, range(3, 4))
    assert rescue.refusal(hb.progress()) == ""
    opt.step()  # a step the loop has not beaten yet: the state is past step 3
    assert "did not come right after the optimizer's last step" in \
        rescue.refusal(hb.progress())
    hb.beat(4)
    hb.beat(5)  # a micro-batch's beat: two beats since the optimizer's step
    assert "did not come right after" in rescue.refusal(hb.progress())
    opt.step()
    hb.beat(6)
    assert rescue.refusal(hb.progress()) == ""
    rescue.opt.inside = 1  # as the pre-hook leaves it while a step runs
    assert rescue.refusal(hb.progress()) == "the optimizer is inside a step"
    assert rescue.now("mid-step") is None
    assert "not saving at the fault (mid-step): the optimizer is inside" in capfd.readouterr().err
    rescue.opt.inside = 0
    rescue.agree(R.SHARDED, -R.SHARDED)
    assert rescue.refusal(hb.progress()) == "the state is sharded or differs between ranks"
    assert R.rescued_steps(R.rescue_root(mgr.job_dir)) == []


def test_a_rescue_the_loop_outran_is_not_kept_and_one_that_fails_to_load_is_passed_over(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr, rescue, hb = _one_rank(tmp_path)
    _train(model, opt, hb, range(1, 3))
    mgr.save(2, model=model, optimizer=opt)
    mgr.wait()
    _train(model, opt, hb, range(3, 5))
    real = hb.progress
    calls = {"n": 0}

    def moving() -> Progress:
        calls["n"] += 1
        p = real()
        return p if calls["n"] == 1 else p._replace(beats=p.beats + 1)

    # The loop beats again while the rescue is written: what it wrote is not step 4.
    rescue.hb.progress = moving  # type: ignore[method-assign]
    assert rescue.now("outrun") is None
    assert "step 4 not saved at the fault (outrun): the loop moved on" in \
        capfd.readouterr().err
    assert R.rescued_steps(R.rescue_root(mgr.job_dir)) == []
    rescue.hb.progress = real  # type: ignore[method-assign]

    _train(model, opt, hb, range(5, 6))
    got = rescue.now("kept")
    assert got is not None and got.step == 5
    data = got.path / "rank-00000" / "data.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a bit flipped on the disk
    data.write_bytes(bytes(raw))
    again = CheckpointManager(mgr.job_dir)
    again._rescue, again._rescue_wanted = R.Rescue(again, hb), True
    fresh = torch.nn.Linear(4, 3)
    loaded = again.load_latest(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=1))
    assert loaded is not None and loaded.step == 2  # the committed step, loudly
    err = capfd.readouterr().err
    assert "couldn't load the rescue of step 5 (saved at the fault)" in err, err
    assert "every rank resumes from the newest committed step instead" in err


# -- two ranks: a hang, and a crash --------------------------------------------------------------

def _env(work: Path, rank: int, node: str) -> None:
    run = work / "run"
    (run / f"job-{JOB}").mkdir(parents=True, exist_ok=True)
    os.environ.update({"SLURM_JOB_ID": str(JOB), "SLURM_RESILIENCE_RUN_DIR": str(run),
                       "SLURMD_NODENAME": node, "RANK": str(rank), "WORLD_SIZE": "2"})
    heartbeat._current, heartbeat._disabled = None, False


def _ddp(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 6))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _loop(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(torch.full((2, 6), float(step))).pow(2).sum().backward()
        opt.step()
        heartbeat.beat(step)


def hang_rank_1(rank: int, world: int, job: Path) -> None:
    """Both ranks train to step 7 (saving step 4); rank 1 then stops, and rank 0 blocks in
    step 8's all-reduce until its rescue thread saved step 7 (rank 0 is node a)."""
    work = job.parent
    _env(work, rank, "ab"[rank])
    mine = work / "ab"[rank]
    mine.mkdir(exist_ok=True)
    model, opt = _ddp()
    ckpt = CheckpointManager(mine, rank=rank, world_size=world, local_leader=True,
                             rescue=True)
    _loop(model, opt, range(1, 5))
    ckpt.save(4, model=model, optimizer=opt)
    _loop(model, opt, range(5, 8))
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, work / f"want-{rank}")
    if rank == 0:  # rank 1 is hung: it never comes to step 8's all-reduce
        threading.Thread(target=lambda: _loop(model, opt, range(8, 9)), daemon=True).start()
    deadline = time.monotonic() + 60
    while not (R.rescue_root(work / "a") / step_name(7) / "COMMIT.json").exists():
        assert time.monotonic() < deadline, "no rescue within 60 s"
        time.sleep(0.1)
    time.sleep(0.5)  # node b's own rescue too (rank 1's main thread sleeps in the loop)
    os._exit(0)  # the blocked all-reduce never returns


def relaunch_with_spare(rank: int, world: int, job: Path) -> None:
    """Node a keeps its rescue; rank 1 runs on a spare, c, whose dir is empty."""
    work = job.parent
    _env(work, rank, "ac"[rank])
    mine = work / "ac"[rank]
    mine.mkdir(exist_ok=True)
    model, opt = _ddp(seed=99)
    ckpt = CheckpointManager(mine, rank=rank, world_size=world, local_leader=True,
                             rescue=True)
    got = ckpt.load_latest(model=model, optimizer=opt)
    assert got is not None and got.step == 7, got
    want = torch.load(work / "want-0")
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert opt.state_dict()["state"][0]["step"].item() == 7
    assert R.rescued_steps(R.rescue_root(mine)) == [7]  # the spare got a verified copy
    _loop(model, opt, range(8, 10))
    ckpt.save(9, model=model, optimizer=opt)
    ckpt.close()
    assert R.rescued_steps(R.rescue_root(mine)) == []
    print(f"OK {rank}", flush=True)


def test_a_hang_is_rescued_by_the_blocked_rank_and_a_relaunch_on_a_spare_resumes_from_it(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    codes = dcp_ranks.run_ranks(hang_rank_1, 2, tmp_path, timeout_s=90)
    assert codes[0] == 0, (codes, capfd.readouterr().err[-3000:])
    err = capfd.readouterr().err
    assert "checkpoint: rescue: saved step 7 at the fault (no beat for" in err, err[-3000:]
    assert dcp_ranks.run_ranks(relaunch_with_spare, 2, tmp_path) == [0, 0], \
        capfd.readouterr().err[-3000:]
    err = capfd.readouterr().err
    assert "resuming from step 7, saved at the fault" in err and "sent to c" in err, err


def crash_rank_1(rank: int, world: int, job: Path) -> None:
    """Rank 1 dies at step 6; rank 0's all-reduce raises, and the exception's way out of
    the script (sys.excepthook, as the interpreter calls it) saves step 5."""
    work = job.parent
    _env(work, rank, "ab"[rank])
    mine = work / "ab"[rank]
    mine.mkdir(exist_ok=True)
    model, opt = _ddp()
    ckpt = CheckpointManager(mine, rank=rank, world_size=world, rescue=True)
    _loop(model, opt, range(1, 3))
    ckpt.save(2, model=model, optimizer=opt)
    _loop(model, opt, range(3, 6))
    if rank == 1:
        os._exit(9)
    try:
        _loop(model, opt, range(6, 7))
    except Exception:  # noqa: BLE001 - handed to the hook as an uncaught exception would be
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
    assert R.rescued_steps(R.rescue_root(mine)) == [5]


def test_a_peer_crash_is_rescued_as_the_exception_leaves_the_script(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    codes = dcp_ranks.run_ranks(crash_rank_1, 2, tmp_path, timeout_s=90)
    err = capfd.readouterr().err
    assert codes[0] == 0, (codes, err[-3000:])
    assert "checkpoint: rescue: saved step 5 at the fault (the training raised" in err, err


def one_rank_without_heartbeat(rank: int, world: int, job: Path) -> None:
    """Rank 1 has no heartbeat (its node's run dir is missing), so no rescue: saves and a
    restore (one staging dir, as on one node) still meet in the same all-reduces, and the
    rescue is off on rank 0 too."""
    work = job.parent
    _env(work, rank, "ab"[rank])
    if rank == 1:
        heartbeat._disabled = True
    model, opt = _ddp()
    ckpt = CheckpointManager(job, rank=rank, world_size=world, rescue=True)
    assert (ckpt._rescue is None) == (rank == 1)
    _loop(model, opt, range(1, 3))
    ckpt.save(2, model=model, optimizer=opt)
    ckpt.close()
    if ckpt._rescue is not None:
        assert ckpt._rescue.agreed == R.SHARDED
    again = CheckpointManager(job, rank=rank, world_size=world, rescue=True)
    got = again.load_latest(model=model, optimizer=opt)
    assert got is not None and got.step == 2
    print(f"OK {rank}", flush=True)


def test_a_rank_that_could_not_start_its_rescue_turns_it_off_for_every_rank(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    codes = dcp_ranks.run_ranks(one_rank_without_heartbeat, 2, tmp_path, timeout_s=90)
    err = capfd.readouterr().err
    assert codes == [0, 0], err[-3000:]
    assert "checkpoint: rescue: off: this rank has no heartbeat" in err, err
    assert "checkpoint: rescue: off for this state" in err, err
