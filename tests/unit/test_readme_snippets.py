"""The READMEs' checkpoint snippets, run verbatim: each resumes model, optimizer and scheduler.

Each ```python block is taken from the markdown at test time and run twice in fresh
processes (real PyTorch on CPU; DDP and FSDP2 on gloo ranks, FSDP2 resuming at another
world size) between a prelude that builds ``model``, ``opt``, ``sched``, ``steps``,
``every`` and ``train_step()`` and an epilogue that dumps the full state. The first run
trains and saves; the second starts from other weights, resumes and trains no further,
so its dump must equal the first one tensor for tensor and value for value.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)

PRELUDE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    wrap, out = os.environ["SNIPPET_WRAP"], os.environ["SNIPPET_OUT"]
    if wrap != "plain":
        dist.init_process_group("gloo", init_method="file://" + os.environ["SNIPPET_RDV"],
                                rank=rank, world_size=world)
    torch.manual_seed(int(os.environ["SNIPPET_SEED"]))
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4))
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    elif wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(net[0], mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        model = net
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    steps, every = 4, 2
    gen = torch.Generator().manual_seed(11 + rank)

    def train_step():
        x = torch.randn(5, 6, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return 5
""")

EPILOGUE = textwrap.dedent("""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=full)
    dump = {"start": start, "model": msd, "optim": osd, "sched": sched.state_dict(),
            "lr": [g["lr"] for g in opt.param_groups]}
    if "progress" in globals():
        dump["progress"] = dict(progress)
    if rank == 0:
        torch.save(dump, out)
    if wrap != "plain":
        dist.barrier()
        dist.destroy_process_group()
""")


def _blocks(path: Path, section: str | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end >= 0 else len(text)]
    return BLOCK.findall(text)


# (markdown file, section or None for the whole file, block index) -> the model's wrapping,
# the ranks that train and save, the ranks that resume (FSDP2 reshards 2 -> 1).
SNIPPETS: dict[tuple[str, str | None, int], tuple[str, int, int]] = {
    ("README.md", "For ML researchers", 0): ("ddp", 2, 2),
    ("slurm_resilience/checkpoint/README.md", None, 0): ("fsdp2", 2, 1),
    ("slurm_resilience/checkpoint/README.md", None, 1): ("plain", 1, 1),
}


def test_every_checkpoint_snippet_is_covered() -> None:
    """Each python block of the covered README sections has a run below (a new one fails)."""
    found = {(f, s, i) for f, s in {(f, s) for f, s, _ in SNIPPETS}
             for i in range(len(_blocks(REPO / f, s)))}
    assert found == set(SNIPPETS)


def _run(code: str, wrap: str, world: int, seed: int, work: Path, tag: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    config = work / "config.yaml"
    config.write_text("{}\n")
    out = work / f"dump-{tag}.pt"
    env.update({"SLURM_RESILIENCE_CONFIG": str(config),
                "SLURM_RESILIENCE_CKPT_DIR": str(work / "job"), "WORLD_SIZE": str(world),
                "SNIPPET_WRAP": wrap, "SNIPPET_OUT": str(out), "SNIPPET_SEED": str(seed),
                "SNIPPET_RDV": str(work / f"rdv-{tag}"), "OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"{tag} rank exited {p.returncode}:\n{text}"
    return dict(torch.load(out, weights_only=False))


def _assert_same(got: Any, want: Any, where: str = "") -> None:
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


@pytest.mark.parametrize("snippet", list(SNIPPETS), ids=lambda s: f"{s[0]}-{s[2]}")
def test_snippet_resumes_model_optimizer_and_scheduler(snippet: tuple[str, str | None, int],
                                                       tmp_path: Path) -> None:
    """A README snippet run verbatim resumes every weight, Adam moment and step count, the
    learning rate its scheduler moved, the scheduler's counters and its own entries."""
    path, section, index = snippet
    wrap, world, resume_world = SNIPPETS[snippet]
    code = PRELUDE + _blocks(REPO / path, section)[index] + EPILOGUE
    (tmp_path / "job").mkdir()
    saved = _run(code, wrap, world, seed=1, work=tmp_path, tag="train")
    assert not saved["start"] and saved["lr"] == [2.5e-3]  # StepLR moved it from 1e-2
    assert saved["optim"]["state"], "Adam has state after training"
    resumed = _run(code, wrap, resume_world, seed=2, work=tmp_path, tag="resume")
    assert resumed["start"] == 4
    for key in ("model", "optim", "sched", "lr", "progress"):
        if key in saved:
            _assert_same(resumed[key], saved[key], key)
