"""Model, optimizer and scheduler state round-trips through CheckpointManager, or it raises.

Real PyTorch on CPU, one process: what load_latest() gives back must let
``optimizer.load_state_dict`` rebuild the optimizer exactly, the objects passed as
``model=``/``optimizer=``/``scheduler=`` resume whole, and a load template that would
leave saved state behind is refused before anything loads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_resilience.checkpoint import CheckpointError, TemplateMismatch, train_state
from slurm_resilience.checkpoint.manager import CheckpointManager

Optim = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optim] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def _setup(make_opt: Optim, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = make_opt(model.parameters())
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        loss = model(torch.randn(4, 5, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal values of equal types all the way down (int keys stay int, tensors bitwise)."""
    assert type(got) is type(want) or (isinstance(got, dict) and isinstance(want, dict)), \
        (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), (where, list(got), list(want))
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _assert_resumed(got: tuple[torch.nn.Module, torch.optim.Optimizer, Any],
                    want: tuple[torch.nn.Module, torch.optim.Optimizer, Any]) -> None:
    """Same weights, optimizer state and param groups, scheduler state; and one more step
    of training gives the same weights on both."""
    _assert_same(got[0].state_dict(), want[0].state_dict(), "model")
    _assert_same(got[1].state_dict(), want[1].state_dict(), "optim")
    _assert_same(got[2].state_dict(), want[2].state_dict(), "sched")
    _train(*got, 1)
    _train(*want, 1)
    _assert_same(got[0].state_dict(), want[0].state_dict(), "model after a step")


def test_load_without_template_returns_the_saved_structure(tmp_path: Path) -> None:
    """Empty dicts and lists, None, int keys, tuples and nesting come back exactly as saved."""
    model = torch.nn.Linear(3, 2)
    state = {"sgd": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(), "cfg": {},
             "none": None, "empty": [], "nest": {"a": {"b": {}}, 7: [torch.ones(2), {}]},
             "t": (1, "x"), "w": torch.arange(4)}
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    mgr.close()
    got = CheckpointManager(tmp_path).load_latest()
    assert got is not None and got.step == 1
    _assert_same(got.state, state)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_and_scheduler_load_state_dict_from_a_load_without_template(
        name: str, tmp_path: Path) -> None:
    """Saved state_dict() copies, loaded without a template, rebuild a fresh model,
    optimizer and LR scheduler through their load_state_dict exactly."""
    want = _setup(OPTIMIZERS[name], seed=0)
    _train(*want, 3)
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"model": want[0].state_dict(), "optim": want[1].state_dict(),
                 "sched": want[2].state_dict()})
    mgr.close()
    got = CheckpointManager(tmp_path).load_latest()
    assert got is not None
    fresh = _setup(OPTIMIZERS[name], seed=1)
    fresh[0].load_state_dict(got.state["model"])
    fresh[1].load_state_dict(got.state["optim"])
    fresh[2].load_state_dict(got.state["sched"])
    _assert_resumed(fresh, want)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_objects_passed_by_keyword_resume_whole(name: str, tmp_path: Path) -> None:
    """save(model=, optimizer=, scheduler=) and load_latest with fresh objects restore the
    weights, the optimizer's state and learning rate and the scheduler, plus own entries."""
    want = _setup(OPTIMIZERS[name], seed=0)
    _train(*want, 3)
    assert want[1].param_groups[0]["lr"] != OPTIMIZERS[name]([torch.zeros(1)]).defaults["lr"]
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"epoch": 2}, model=want[0], optimizer=want[1], scheduler=want[2])
    mgr.close()
    fresh = _setup(OPTIMIZERS[name], seed=1)
    extra = {"epoch": 0}
    got = CheckpointManager(tmp_path).load_latest(extra, model=fresh[0], optimizer=fresh[1],
                                                  scheduler=fresh[2])
    assert got is not None and got.step == 3 and got.state is extra and extra["epoch"] == 2
    _assert_resumed(fresh, want)


def test_train_state_entries_work_with_dcp_by_hand(tmp_path: Path) -> None:
    """train_state() is what save() stores: a plain load_latest() shows its keys, and
    dcp.load of it through storage_reader restores the objects."""
    import torch.distributed.checkpoint as dcp

    want = _setup(OPTIMIZERS["adam"], seed=0)
    _train(*want, 3)
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, model=want[0], optimizer=want[1], scheduler=want[2])
    mgr.close()
    got = CheckpointManager(tmp_path).load_latest()
    assert got is not None and sorted(got.state) == ["model", "optim", "scheduler"]
    fresh = _setup(OPTIMIZERS["adam"], seed=1)
    reader = CheckpointManager(tmp_path)
    step = reader.latest_step()
    assert step == 3
    dcp.load(train_state(model=fresh[0], optimizer=fresh[1], scheduler=fresh[2]),
             storage_reader=reader.storage_reader(step))
    _assert_resumed(fresh, want)


def test_copy_of_optimizer_state_in_template_raises_before_loading(tmp_path: Path) -> None:
    """The old README's {"model": ..., "optim": opt.state_dict()} raises naming the key
    and the remedy, even with allow_fresh_start, and leaves the model untouched."""
    want = _setup(OPTIMIZERS["adam"], seed=0)
    _train(*want, 3)
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"model": want[0].state_dict(), "optim": want[1].state_dict()})
    mgr.close()
    model, opt, _ = _setup(OPTIMIZERS["adam"], seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with pytest.raises(TemplateMismatch, match=r"key \['optim'\] is a copy of an optimizer's "
                       r"state .*load_latest\(model=model, optimizer=opt"):
        CheckpointManager(tmp_path, allow_fresh_start=True).load_latest(state)
    _assert_same(model.state_dict(), before)


def test_copy_of_scheduler_state_in_template_raises(tmp_path: Path) -> None:
    """A scheduler's state_dict() copy in a template raises: the scheduler would not resume."""
    want = _setup(OPTIMIZERS["sgd"], seed=0)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"sched": want[2].state_dict()})
    mgr.close()
    with pytest.raises(TemplateMismatch, match=r"\['sched'\] is a copy of an LR scheduler"):
        CheckpointManager(tmp_path).load_latest({"sched": want[2].state_dict()})


def test_template_without_place_for_saved_entries_raises_naming_them(tmp_path: Path) -> None:
    """A fresh Adam passed as a Stateful has no state tensors for the saved moments: the
    load raises naming them instead of resuming without them."""
    want = _setup(OPTIMIZERS["adam"], seed=0)
    _train(*want, 2)
    mgr = CheckpointManager(tmp_path)
    mgr.save(2, {"optim": want[1]})
    mgr.close()
    _, opt, _ = _setup(OPTIMIZERS["adam"], seed=1)
    with pytest.raises(TemplateMismatch, match=r"no place for 12 saved entries "
                       r"\(optim\.state\.0\.exp_avg, "):
        CheckpointManager(tmp_path).load_latest({"optim": opt})
    assert not opt.state  # nothing loaded


def test_key_given_twice_and_optimizer_without_model_raise(tmp_path: Path) -> None:
    """A state key that a keyword object would also use, or optimizer= without model=,
    raises a CheckpointError naming it before anything is saved."""
    model, opt, _ = _setup(OPTIMIZERS["sgd"], seed=0)
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="has a key 'model' and the model= argument"):
        mgr.save(1, {"model": 1}, model=model)
    with pytest.raises(CheckpointError, match="optimizer= needs model="):
        mgr.save(1, optimizer=opt)
    with pytest.raises(CheckpointError, match="the state is empty"):
        mgr.save(1)
    assert not list(tmp_path.iterdir())


def _one_rank_copies_the_optimizer_state(rank: int, world: int, job: Path) -> None:
    """Rank 1 loads into a copy of opt.state_dict(), rank 0 into the objects: both raise
    (rank 0 naming the other rank), and rank 0's fresh model keeps its weights."""
    want = _setup(OPTIMIZERS["adam"], seed=0)
    _train(*want, 2)
    ckpt = CheckpointManager(job)
    ckpt.save(2, model=want[0], optimizer=want[1], scheduler=want[2])
    ckpt.close()
    model, opt, sched = _setup(OPTIMIZERS["adam"], seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        if rank == 1:
            ckpt.load_latest({"optim": opt.state_dict()}, model=model)
        else:
            ckpt.load_latest(model=model, optimizer=opt, scheduler=sched)
    except TemplateMismatch as exc:
        (job.parent / f"refused-{rank}").write_text(str(exc))
    _assert_same(model.state_dict(), before)


def test_a_template_mismatch_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """With 2 gloo ranks, one rank's bad template makes load_latest raise TemplateMismatch on
    both before anything loads (no rank waits in DCP's collectives for the other)."""
    import dcp_ranks

    assert dcp_ranks.run_ranks(_one_rank_copies_the_optimizer_state, 2, tmp_path) == [0, 0]
    assert "another rank's state can't take the step" in (tmp_path / "refused-0").read_text()
    assert "key ['optim'] is a copy of an optimizer's" in (tmp_path / "refused-1").read_text()
