"""CheckpointManager: background saves, snapshots, load_latest, multi-rank commit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slurm_resilience.checkpoint.commit import (
    CheckpointError,
    committed_steps,
    read_marker,
    saved_in_this_run,
)
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.checkpoint.stagein_status import StageinStatus

REPO = Path(__file__).resolve().parents[2]


def _state(value: float) -> dict[str, object]:
    return {"model": {"w": torch.full((64, 64), value)}, "opt": {"step": int(value),
                                                                 "m": [torch.ones(3) * value]}}


def test_save_snapshots_then_load_latest_returns_newest(tmp_path: Path) -> None:
    """State mutated right after save() does not leak into the checkpoint; newest step loads."""
    mgr = CheckpointManager(tmp_path)
    st = _state(1.0)
    mgr.save(5, st)
    st["model"]["w"].fill_(99.0)  # type: ignore[index]
    mgr.save(10, _state(2.0))
    mgr.wait()
    assert committed_steps(tmp_path) == [5, 10]
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 10
    assert torch.equal(loaded.state["model"]["w"], torch.full((64, 64), 2.0))
    assert loaded.state["opt"]["step"] == 2
    mgr2 = CheckpointManager(tmp_path)
    os.rename(tmp_path / "step-00000010", tmp_path / "gone")
    old = mgr2.load_latest()
    assert old is not None and old.step == 5 and float(old.state["model"]["w"][0, 0]) == 1.0


def test_committed_step_that_cannot_be_loaded_raises_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A committed step whose data file is gone raises an error naming the step and the
    cause, never a silent fresh start; allow_fresh_start turns it into a loud warning."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1.0))
    mgr.save(2, _state(2.0))
    mgr.wait()
    (tmp_path / "step-00000002" / "rank-00000" / "data.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"couldn't load committed step 2: .*data\.distcp"):
        mgr.load_latest(_state(0.0))
    assert CheckpointManager(tmp_path, allow_fresh_start=True).load_latest() is None
    assert "STARTING FROM SCRATCH" in capsys.readouterr().err


def test_corrupt_bytes_are_caught_in_the_same_read_pass(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """A flipped byte in a committed step's data fails its block CRC32C while the restore
    reads it: the restore falls back, loudly, to the step before; when no step verifies it
    raises naming each step, file and block, never wrong tensors and never a fresh start."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1.0))
    mgr.save(2, _state(2.0))
    mgr.wait()
    for step in (2, 1):
        f = tmp_path / f"step-0000000{step}" / "rank-00000" / "data.distcp"
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
        if step == 2:
            state = _state(0.0)
            loaded = mgr.load_latest(state)
            assert loaded is not None and loaded.step == 1
            assert all(bool((t == 1.0).all()) for t in state.values()
                       if isinstance(t, torch.Tensor))
            assert "committed step 2 does not verify; falling back" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=r"couldn't load committed step 2: step 2: .*"
                                              r"rank-00000/data\.distcp bytes 0-\d+ \(block 0\) "
                                              r"have CRC32C.*; step 1: .*no older committed "
                                              r"step verifies"):
        mgr.load_latest(_state(0.0))


def _flip(step_dir: Path) -> None:
    f = step_dir / "rank-00000" / "data.distcp"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))


def test_a_step_the_restore_passed_over_is_saved_again_not_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The requeued run's restore passes over a corrupt step 10 and resumes from 5; its
    save(10) sets the corrupt copy aside and writes the new step 10, where it used to
    skip it as 'already committed' (the corrupt one stayed, the new state was lost)."""
    first = CheckpointManager(tmp_path)
    first.save(5, _state(5.0))
    first.save(10, _state(10.0))
    first.close()
    _flip(tmp_path / "step-00000010")
    rerun = CheckpointManager(tmp_path)
    resumed = rerun.load_latest(_state(0.0))
    assert resumed is not None and resumed.step == 5
    rerun.save(10, _state(11.0))
    rerun.close()
    assert "restore passed over it" in capsys.readouterr().err
    got = CheckpointManager(tmp_path).load_latest(_state(0.0))
    assert got is not None and got.step == 10
    assert torch.equal(got.state["model"]["w"], torch.full((64, 64), 11.0))
    assert [p.name.startswith(".passed-over-step-00000010.") for p in tmp_path.iterdir()
            if p.name.startswith(".")] == [True]


def test_save_skips_a_committed_step_only_when_this_run_loaded_or_saved_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'Already committed' skips a save only of a step this run saved or loaded; an earlier
    run's step that this run did not resume from raises, naming it (never a silent skip)."""
    first = CheckpointManager(tmp_path)
    first.save(5, _state(5.0))
    first.save(5, _state(6.0))
    first.close()
    assert "step 5 is already committed (this run loaded or saved it)" in capsys.readouterr().err
    other = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"step 5 is already committed in .* neither "
                                              r"loaded nor saved it"):
        other.save(5, _state(7.0))
    assert other.load_latest() is not None
    other.save(5, _state(7.0))
    other.close()
    got = CheckpointManager(tmp_path).load_latest()
    assert got is not None and float(got.state["model"]["w"][0, 0]) == 5.0


def test_run_with_uri_but_no_agent_raises_instead_of_using_local_steps(tmp_path: Path) -> None:
    """With a run URI but no reachable agent the run's S3 steps are unknown: load_latest
    raises (naming the agent) rather than silently loading an older local step."""
    first = CheckpointManager(tmp_path)
    first.save(1, _state(1.0))
    first.wait()
    mgr = CheckpointManager(tmp_path, uri="s3://ckpt/u/run", job_id=7,
                            agent_socket=str(tmp_path / "no-agent.sock"))
    with pytest.raises(CheckpointError, match="stage-in failed: the node agent is unreachable"):
        mgr.load_latest()


def test_step_without_dcp_metadata_raises(tmp_path: Path) -> None:
    """A committed step without .metadata (an older format, or an incomplete stage-in) is an
    error naming the step."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, _state(3.0))
    mgr.wait()
    (tmp_path / "step-00000003" / "rank-00000" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"committed step 3: this node has no "
                                              r"rank-00000/\.metadata"):
        mgr.load_latest()


def test_load_latest_fills_the_callers_state_in_place(tmp_path: Path) -> None:
    """load_latest(state) copies into the caller's tensors (no new ones) and returns the step."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(4, _state(4.0))
    dest = _state(0.0)
    w = dest["model"]["w"]  # type: ignore[index]
    got = mgr.load_latest(dest)
    assert got is not None and got.step == 4 and got.state is dest
    assert dest["model"]["w"] is w and float(w[0, 0]) == 4.0  # type: ignore[index]
    assert dest["opt"]["step"] == 4 and float(dest["opt"]["m"][0][1]) == 4.0  # type: ignore[index]


def test_stateful_objects_save_and_load_like_dcp(tmp_path: Path) -> None:
    """A top-level Stateful value (a module wrapper, as torchtitan passes) is saved through
    its state_dict() and restored through load_state_dict()."""
    model = torch.nn.Linear(3, 2)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": model, "step": 1})
    other = torch.nn.Linear(3, 2)
    got = mgr.load_latest({"model": other, "step": 0})
    assert got is not None and got.step == 1 and got.state["step"] == 1
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def test_keys_that_would_share_a_name_are_refused(tmp_path: Path) -> None:
    """{"enc.w": a, "enc": {"w": b}} and keys 0 and "0" would land on one name: save()
    refuses with both keys named; "enc/w" next to enc->w stays two distinct names."""
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"keys \['enc.w'\] and \['enc'\]\['w'\] would "
                                              r"both be stored as 'enc.w'"):
        mgr.save(1, {"enc.w": torch.ones(1), "enc": {"w": torch.zeros(1)}})
    with pytest.raises(CheckpointError, match=r"keys \[0\] and \['0'\] would both"):
        mgr.save(1, {0: torch.ones(1), "0": torch.zeros(1)})
    assert committed_steps(tmp_path) == []
    mgr.save(1, {"enc/w": torch.ones(2), "enc": {"w": torch.zeros(2)}})
    got = mgr.load_latest()
    assert got is not None
    assert torch.equal(got.state["enc/w"], torch.ones(2))
    assert torch.equal(got.state["enc"]["w"], torch.zeros(2))


@pytest.mark.parametrize(("value", "what"), [
    (lambda: 0, "of type builtins.function"),
    (torch.zeros(3, 3).to_sparse(), "torch.sparse_coo tensor"),
    (torch.empty(4, device="meta"), "a meta tensor"),
])
def test_unsupported_values_raise_naming_key_and_type(tmp_path: Path, value: object,
                                                      what: str) -> None:
    """A value DCP can't save exactly raises before anything is written, naming the key
    and the type, never a crash."""
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=rf"couldn't save key \['opt'\]\['bad'\].*{what}"):
        mgr.save(1, {"w": torch.ones(1), "opt": {"bad": value}})
    assert not (tmp_path / "step-00000001").exists()


def test_snapshot_buffers_are_reused_between_saves(tmp_path: Path) -> None:
    """The second save copies into the first save's buffers: one extra copy of the state,
    never one per save; release_buffers() or keep_buffers=False frees them."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1.0))
    mgr.wait()
    before = {k: b.data_ptr() for k, b in mgr._snap.buffers.items()}
    mgr.save(2, _state(2.0))
    mgr.wait()
    assert {k: b.data_ptr() for k, b in mgr._snap.buffers.items()} == before
    assert mgr._snap.nbytes == (64 * 64 + 3) * 4
    mgr.release_buffers()
    assert mgr._snap.nbytes == 0
    lean = CheckpointManager(tmp_path, keep_buffers=False)
    lean.save(3, _state(3.0))
    lean.wait()
    assert lean._snap.nbytes == 0


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    """An empty staging dir (nothing committed anywhere) means a fresh start: None."""
    assert CheckpointManager(tmp_path).load_latest() is None
    assert CheckpointManager(tmp_path).load_latest({"w": torch.zeros(1)}) is None


def test_missing_staging_dir_is_a_clear_error(tmp_path: Path) -> None:
    """Without the prolog's staging dir the manager says what is missing."""
    with pytest.raises(CheckpointError, match="does not exist; the prolog creates it"):
        CheckpointManager(tmp_path / "nope")


def test_from_env_rejects_uri_outside_user_prefix(tmp_path: Path) -> None:
    """A run URI outside the caller's allowed prefix fails at from_env, before any write."""
    conf = tmp_path / "c.yaml"
    conf.write_text(f"checkpoint:\n  allowed_prefix: s3://ckpt/{{user}}/\n"
                    f"  staging_root: {tmp_path}\n")
    env = {"SLURM_RESILIENCE_CONFIG": str(conf), "SLURM_RESILIENCE_CKPT_DIR": str(tmp_path),
           "SLURM_RESILIENCE_CKPT_URI": "s3://ckpt/someone-else/run"}
    with pytest.raises(CheckpointError, match="outside the prefix"):
        CheckpointManager.from_env(env)
    assert sorted(os.listdir(tmp_path)) == ["c.yaml"]


def test_save_killed_mid_write_leaves_previous_step(tmp_path: Path) -> None:
    """A process killed while writing step 2 leaves only .tmp; load_latest returns step 1."""
    script = textwrap.dedent(f"""
        import os, torch
        from slurm_resilience.checkpoint import commit, manager
        mgr = manager.CheckpointManager({str(tmp_path)!r})
        mgr.save(1, {{"w": torch.ones(300000)}}); mgr.wait()
        real = commit.ChecksummingWriter.write
        def dying(self, data):
            view = memoryview(data).cast("B")
            if len(view) > 100000:  # the tensor data: write half of it, then die
                real(self, view[: len(view) // 2])
                os._exit(9)  # like SIGKILL: no cleanup, no flush
            return real(self, data)
        commit.ChecksummingWriter.write = dying
        mgr.save(2, {{"w": torch.zeros(300000)}}); mgr.wait()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert (tmp_path / "step-00000002" / "rank-00000.tmp").is_dir()
    loaded = CheckpointManager(tmp_path).load_latest()
    assert loaded is not None and loaded.step == 1
    assert float(loaded.state["w"][0]) == 1.0


def test_two_ranks_refuse_a_save_one_rank_cannot_make(tmp_path: Path) -> None:
    """With 2 gloo ranks, a state rank 1 cannot save makes save() raise on both ranks before
    anything is written; step 1 stays the newest and each rank gets its own values back."""
    import dcp_ranks

    assert dcp_ranks.run_ranks(dcp_ranks.refuse_bad_save, 2, tmp_path) == [0, 0]
    assert committed_steps(tmp_path / "job") == [1]
    assert not (tmp_path / "job" / "step-00000002").exists()
    out0, out1 = ((tmp_path / f"refused-{r}").read_text() for r in (0, 1))
    assert out0.startswith("1 0.0 ") and "another rank's state can't be saved" in out0
    assert out1.startswith("1 1.0 ") and "couldn't save key ['bad'] of type builtins.function" \
        in out1


def test_state_round_trips_dtypes_shapes_and_nesting(tmp_path: Path) -> None:
    """Mixed dtypes (odd sizes included), empty and 0-d tensors, tuples and plain values
    come back equal, and the skeleton loads with weights_only."""
    state = {"h": torch.arange(7, dtype=torch.float16), "i": torch.tensor(3),
             "b": torch.zeros(0, 4), "d": torch.randn(3, 5, dtype=torch.float64),
             "t": (torch.ones(2, dtype=torch.bfloat16), [1, "x", None]), "lr": 0.1,
             "nc": torch.randn(4, 6).t()}
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    got = mgr.load_latest()
    assert got is not None
    for key in ("h", "i", "b", "d", "nc"):
        assert got.state[key].dtype == state[key].dtype  # type: ignore[union-attr]
        assert torch.equal(got.state[key], state[key])  # type: ignore[arg-type]
    assert torch.equal(got.state["t"][0], state["t"][0]) and got.state["t"][1] == [1, "x", None]
    assert got.state["lr"] == 0.1 and isinstance(got.state["t"], tuple)


def test_from_env_without_uri_uses_local_steps_and_never_waits_for_stage_in(
        tmp_path: Path) -> None:
    """A Slurm job without SLURM_RESILIENCE_CKPT_URI finds its staging dir from config and
    loads local steps at once (no agent, no stage-in wait)."""
    conf = tmp_path / "c.yaml"
    conf.write_text(f"checkpoint:\n  staging_root: {tmp_path}/{{node}}\n  stagein_timeout_s: 60\n"
                    f"agent:\n  socket: {tmp_path}/missing.sock\n")
    (tmp_path / "n1" / "job-5").mkdir(parents=True)
    env = {"SLURM_RESILIENCE_CONFIG": str(conf), "SLURM_JOB_ID": "5", "SLURMD_NODENAME": "n1"}
    mgr = CheckpointManager.from_env(env)
    assert mgr.job_dir == tmp_path / "n1" / "job-5" and mgr.agent_socket is None
    mgr.save(4, {"w": torch.ones(2)})
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 4


def test_a_relaunch_resumes_this_runs_newest_commit_not_the_step_its_stage_in_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeued run staged step 5 in at its start, then committed 10 and 15. A relaunch
    inside the allocation (same job, same requeue count) resumes from 15: the stage-in's
    answer is from before this run's own commits (retention may even have removed step 5).
    A newer local step of another run (20, left by an earlier run) is not taken on its own
    word: only the stage-in chooses among those."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    first = CheckpointManager(tmp_path)
    first.save(5, _state(5.0))
    first.save(20, _state(20.0))
    first.wait()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    run = CheckpointManager(tmp_path)
    run.save(10, _state(10.0))
    run.save(15, _state(15.0))
    run.wait()
    relaunched = CheckpointManager(tmp_path)
    monkeypatch.setattr(relaunched, "wait_stagein",
                        lambda: StageinStatus("done", step=5, source="s3"))
    loaded = relaunched.load_latest()
    assert loaded is not None and loaded.step == 15
    assert float(loaded.state["model"]["w"][0, 0]) == 15.0
    assert saved_in_this_run(read_marker(tmp_path / "step-00000015").save_id)
    assert not saved_in_this_run(read_marker(tmp_path / "step-00000020").save_id)
    assert not saved_in_this_run("")
