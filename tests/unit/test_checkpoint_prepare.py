"""CheckpointManager.prepare: snapshot buffers allocated ahead of the first save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slurm_resilience.checkpoint.commit import CheckpointError
from slurm_resilience.checkpoint.manager import CheckpointManager


def _state(value: float) -> dict[str, object]:
    return {"model": {"w": torch.full((64, 64), value)}, "opt": {"step": int(value),
                                                                 "m": [torch.ones(3) * value]}}


def test_prepare_allocates_the_buffers_the_first_save_copies_into(tmp_path: Path) -> None:
    """After prepare(), the first save() reuses the prepared buffers (no allocation) and
    saves the state as it is at save time, not as it was at prepare time."""
    mgr = CheckpointManager(tmp_path)
    st = _state(1.0)
    mgr.prepare(st)
    prepared = {k: b.data_ptr() for k, b in mgr._snap.buffers.items()}
    assert mgr._snap.nbytes == (64 * 64 + 3) * 4
    st["model"]["w"].fill_(7.0)  # type: ignore[index]
    mgr.save(1, st)
    mgr.wait()
    assert {k: b.data_ptr() for k, b in mgr._snap.buffers.items()} == prepared
    loaded = CheckpointManager(tmp_path).load_latest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["model"]["w"], torch.full((64, 64), 7.0))
    assert torch.equal(loaded.state["opt"]["m"][0], torch.ones(3))


def test_save_after_shapes_changed_since_prepare_saves_the_new_state(tmp_path: Path) -> None:
    """A tensor reshaped, retyped or added after prepare() is saved as it is at save time
    (it gets a new buffer); keys dropped since prepare() free theirs."""
    mgr = CheckpointManager(tmp_path)
    mgr.prepare({"w": torch.zeros(4, 4), "gone": torch.zeros(8), "b": torch.zeros(2)})
    kept = mgr._snap.buffers[("b",)].data_ptr()
    st = {"w": torch.arange(12.0).reshape(3, 4).double(), "b": torch.ones(2),
          "new": torch.full((5,), 3, dtype=torch.int64)}
    mgr.save(2, st)
    mgr.wait()
    assert sorted(mgr._snap.buffers) == [("b",), ("new",), ("w",)]
    assert mgr._snap.buffers[("b",)].data_ptr() == kept
    loaded = CheckpointManager(tmp_path).load_latest()
    assert loaded is not None
    assert set(loaded.state) == {"w", "b", "new"}
    for key, value in st.items():
        assert loaded.state[key].dtype == value.dtype and torch.equal(loaded.state[key], value)


def test_prepare_refuses_what_save_would_refuse(tmp_path: Path) -> None:
    """prepare() checks the state as save() does: a value that can't be saved raises
    naming its key, and nothing is allocated."""
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"couldn't save key \['bad'\]"):
        mgr.prepare({"w": torch.ones(2), "bad": lambda: None})
    assert mgr._snap.nbytes == 0
