"""Rank processes for the DCP checkpoint tests: real gloo on CPU, a file rendezvous.

``run_ranks(scenario, world, workdir)`` forks ``world`` ranks; every rank of a scenario
shares ``workdir/job`` as its staging dir, as if on one node. A failing check raises,
so the rank exits non-zero.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from slurm_resilience.checkpoint.manager import CheckpointManager


def _globals() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5),
            "b": torch.arange(6 * 16, dtype=torch.float64).reshape(6, 16) / 7,
            "c": torch.full((3,), 7.0)}


def _sharded(mesh: Any, fill: bool) -> dict[str, Any]:
    g = _globals()
    if not fill:
        g = {k: torch.zeros_like(v) for k, v in g.items()}
    return {"model": {"a": distribute_tensor(g["a"], mesh, [Shard(0)]),
                      "b": distribute_tensor(g["b"], mesh, [Shard(1)]),
                      "c": distribute_tensor(g["c"], mesh, [Replicate()])},
            "extra": {"n": 11 if fill else 0, "v": torch.arange(4) if fill else torch.zeros(4)}}


def reshard_save(rank: int, world: int, job: Path) -> None:
    mesh = init_device_mesh("cpu", (world,))
    ckpt = CheckpointManager(job)
    ckpt.save(3, _sharded(mesh, fill=True))
    ckpt.close()
    print(f"OK {rank} saved", flush=True)


def reshard_load(rank: int, world: int, job: Path) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = _sharded(mesh, fill=False)
    got = CheckpointManager(job).load_latest(state)
    assert got is not None and got.step == 3, got
    for key, want in _globals().items():
        dt = state["model"][key]
        assert isinstance(dt, DTensor) and dt.to_local().numel() < want.numel() or key == "c"
        full = dt.full_tensor()
        assert full.dtype == want.dtype and torch.equal(full, want), (key, full, want)
    assert state["extra"]["n"] == 11 and torch.equal(state["extra"]["v"], torch.arange(4))
    print(f"OK {rank} loaded {got.step}", flush=True)


def _fsdp(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    return {"model": msd, "optim": osd}


def fsdp_save(rank: int, world: int, job: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp(world, seed=0)
    _train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    assert any(isinstance(v, DTensor) for v in msd.values())
    ckpt = CheckpointManager(job)
    ckpt.save(4, {"model": msd, "optim": osd})
    ckpt.close()
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, job.parent / "expected.pt")
    print(f"OK {rank} saved", flush=True)


def fsdp_load(rank: int, world: int, job: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp(world, seed=1)
    msd, osd = get_state_dict(model, opt)
    got = CheckpointManager(job).load_latest({"model": msd, "optim": osd})
    assert got is not None and got.step == 4
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    full = _full(model, opt)
    if rank == 0:
        want = torch.load(job.parent / "expected.pt", weights_only=False)
        for k, v in want["model"].items():
            assert torch.equal(full["model"][k], v), k
        for fqn, st in want["optim"]["state"].items():
            for name, v in st.items():
                got_v = full["optim"]["state"][fqn][name]
                assert torch.equal(torch.as_tensor(got_v), torch.as_tensor(v)), (fqn, name)
        assert full["optim"]["param_groups"][0]["lr"] == want["optim"]["param_groups"][0]["lr"]
    _train(model, opt, 1)  # the restored model and optimizer train on
    print(f"OK {rank} loaded {got.step}", flush=True)


def run_ranks(scenario: Callable[[int, int, Path], None], world: int, work: Path,
              timeout_s: float = 120.0) -> list[int]:
    """Run ``scenario(rank, world, work/"job")`` in ``world`` forked ranks (torch is already
    imported here, so ranks start at once); returns their exit codes."""
    import multiprocessing as mp

    (work / "job").mkdir(parents=True, exist_ok=True)
    rdv = work / f"rdv-{scenario.__name__}-{world}-{len(list(work.glob('rdv-*')))}"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(scenario, r, world, work, rdv))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [int(p.exitcode if p.exitcode is not None else -1) for p in procs]


def _rank_main(scenario: Callable[[int, int, Path], None], rank: int, world: int, work: Path,
               rdv: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    try:
        scenario(rank, world, work / "job")
    finally:
        dist.destroy_process_group()
