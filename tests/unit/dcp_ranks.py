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

from slurm_resilience.checkpoint.commit import step_name
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
    from slurm_resilience.checkpoint.ranges import LocalRanges

    class Recorded(LocalRanges):
        """LocalRanges that also counts the bytes the restore asks for."""

        asked = 0

        def ensure(self, step: int, ranges: Any) -> None:
            self.asked += sum(r.length for r in ranges)
            super().ensure(step, ranges)

    mesh = init_device_mesh("cpu", (world,))
    state = _sharded(mesh, fill=False)
    source = Recorded(job)
    got = CheckpointManager(job, ranges=source).load_latest(state)
    assert got is not None and got.step == 3, got
    (job.parent / f"asked-{world}-{rank}").write_text(str(source.asked))
    for key, want in _globals().items():
        dt = state["model"][key]
        assert (isinstance(dt, DTensor) and dt.to_local().numel() < want.numel()) or key == "c"
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


def _dshard(rank: int, world: int, value: float) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.full((world * 1000,), value), mesh, [Shard(0)])}


def async_gated(rank: int, world: int, job: Path) -> None:
    """dcp.async_save through storage_writer(): nothing committed while writes are held."""
    import threading

    import torch.distributed.checkpoint as dcp

    from slurm_resilience.checkpoint.commit import committed_steps, read_manifest
    from slurm_resilience.checkpoint.dcp_writer import StagingWriter

    gate = threading.Event()

    class HeldWriter(StagingWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            gate.wait(60)
            return super().write_data(plan, planner)

    ckpt = CheckpointManager(job)
    ckpt.save(1, _dshard(rank, world, 1.0))
    ckpt.wait()
    state = _dshard(rank, world, 2.0)
    writer = ckpt.storage_writer(2)
    held = HeldWriter(job, 2, snapshot=writer._snapshot)
    fut = dcp.async_save(state, storage_writer=held, process_group=ckpt.group)
    ckpt.commit(2, fut)
    state["w"].to_local().fill_(99.0)  # staged already: must not reach the checkpoint
    assert committed_steps(job) == [1], committed_steps(job)
    assert not (job / "step-00000002" / "COMMIT.json").exists()
    gate.set()
    ckpt.wait()
    assert committed_steps(job) == [1, 2]
    files = {f.path: f for f in read_manifest(job / "step-00000002" / f"rank-{rank:05d}").files}
    assert files["data.distcp"].size == 1000 * 4 and files["data.distcp"].blocks
    assert (".metadata" in files) == (rank == 0)
    dest = _dshard(rank, world, 0.0)
    got = ckpt.load_latest(dest)
    assert got is not None and got.step == 2 and torch.equal(dest["w"].full_tensor(),
                                                             torch.full((world * 1000,), 2.0))
    print(f"OK {rank}", flush=True)


def async_killed(rank: int, world: int, job: Path) -> None:
    """Rank 1 dies (like SIGKILL) halfway through writing step 2 of a dcp.async_save."""
    import os

    import torch.distributed.checkpoint as dcp

    from slurm_resilience.checkpoint import commit

    ckpt = CheckpointManager(job)
    ckpt.save(1, _dshard(rank, world, 1.0))
    ckpt.wait()
    if rank == 1:
        real = commit.ChecksummingWriter.write

        def dying(self: Any, data: Any) -> int:
            view = memoryview(data).cast("B")
            if len(view) >= 4000:  # the tensor bytes: write half, then die without cleanup
                real(self, view[: len(view) // 2])
                os._exit(9)
            return int(real(self, data))

        commit.ChecksummingWriter.write = dying  # type: ignore[method-assign]
    fut = dcp.async_save(_dshard(rank, world, 2.0), storage_writer=ckpt.storage_writer(2),
                         process_group=ckpt.group)
    ckpt.commit(2, fut)
    try:
        ckpt.wait()
    except Exception as exc:  # noqa: BLE001 - rank 0 sees its peer die
        print(f"rank {rank}: save of step 2 failed as expected: {exc}"[:200], flush=True)
        os._exit(3)
    os._exit(4)  # step 2 must not have succeeded


def load_one(rank: int, world: int, job: Path) -> None:
    """load_latest into a sharded state; writes the step and the first value per rank."""
    dest = _dshard(rank, world, 0.0)
    got = CheckpointManager(job).load_latest(dest)
    full = dest["w"].full_tensor()
    (job.parent / f"loaded-{rank}").write_text(
        f"{got.step if got else None} {float(full.min())} {float(full.max())}")


def disagree(rank: int, world: int, job: Path) -> None:
    """Each rank on its own 'node' dir; rank 1's node lacks both steps' markers."""
    node = job.parent / f"node{rank}"
    node.mkdir()
    ckpt = CheckpointManager(node, local_leader=True)
    for step in (1, 2):
        ckpt.save(step, _dshard(rank, world, float(step)))
        ckpt.wait()
    if rank == 1:
        for step in (1, 2):
            (node / step_name(step) / "COMMIT.json").unlink()
    try:
        ckpt.load_latest(_dshard(rank, world, 0.0))
    except Exception as exc:  # noqa: BLE001 - the message is what the test compares
        (job.parent / f"error-{rank}").write_text(str(exc))


def async_process(rank: int, world: int, job: Path) -> None:
    """dcp.async_save with the process executor: the writer is pickled to DCP's daemon."""
    import os
    import zlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from slurm_resilience.checkpoint.commit import committed_steps

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(30000 + zlib.crc32(str(job).encode()) % 20000)
    ckpt = CheckpointManager(job)
    fut = dcp.async_save(_dshard(rank, world, 5.0), storage_writer=ckpt.storage_writer(5),
                         process_group=ckpt.group,
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    ckpt.commit(5, fut)
    ckpt.wait()
    assert committed_steps(job) == [5]
    dest = _dshard(rank, world, 0.0)
    got = ckpt.load_latest(dest)
    want = torch.full((world * 1000,), 5.0)
    assert got is not None and torch.equal(dest["w"].full_tensor(), want)
    print(f"OK {rank}", flush=True)


def refuse_bad_save(rank: int, world: int, job: Path) -> None:
    """Rank 1's state can't be pickled: save() must raise on both ranks, writing nothing."""
    mgr = CheckpointManager(job)
    mgr.save(1, {f"w{rank}": torch.full((10,), float(rank))})
    mgr.wait()
    bad: Any = (lambda: 0) if rank == 1 else 0
    message = ""
    try:
        mgr.save(2, {"w": torch.zeros(1), "bad": bad})
        mgr.wait()
    except Exception as exc:  # noqa: BLE001 - the message is what the test compares
        message = str(exc)
    dest = {f"w{rank}": torch.zeros(10)}
    got = mgr.load_latest(dest)
    (job.parent / f"refused-{rank}").write_text(
        f"{got.step if got else None} {float(dest[f'w{rank}'][0])} {message}")


def reshard_flip(rank: int, world: int, job: Path) -> None:
    """Row shards saved, column shards loaded, so every rank reads every block only in part;
    a flipped bit in rank 1's file of step 2 makes every rank fall back to step 1 (every
    element step 1's), and with step 1 gone a fresh start leaves each rank's fresh shard as
    it was, though rank 0's own bytes of step 2 verified."""
    from slurm_resilience.checkpoint.blocks import BLOCK_SIZE

    mesh = init_device_mesh("cpu", (world,))

    def full(seed: int) -> torch.Tensor:
        return torch.randn(512, 1024, generator=torch.Generator().manual_seed(seed))

    ckpt = CheckpointManager(job)
    for step in (1, 2):
        ckpt.save(step, {"w": distribute_tensor(full(step), mesh, [Shard(0)])})
    ckpt.close()
    dist.barrier()
    if rank == 0:
        f = job / "step-00000002" / "rank-00001" / "data.distcp"
        data = bytearray(f.read_bytes())
        data[BLOCK_SIZE + 3] ^= 1
        f.write_bytes(bytes(data))
    dist.barrier()
    dest = {"w": distribute_tensor(torch.zeros(512, 1024), mesh, [Shard(1)])}
    got = CheckpointManager(job).load_latest(dest)
    assert got is not None and got.step == 1, got
    assert torch.equal(dest["w"].full_tensor(), full(1))
    dist.barrier()
    if rank == 0:
        (job / "step-00000001").rename(job / "aside")
    dist.barrier()
    fresh = {"w": distribute_tensor(full(99), mesh, [Shard(1)])}
    before = fresh["w"].to_local().clone()
    assert CheckpointManager(job, allow_fresh_start=True).load_latest(fresh) is None
    assert torch.equal(fresh["w"].to_local(), before)
    print(f"OK {rank}", flush=True)


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
