"""GB200 NVL72 blocks against real slurmctld: a 6-node sandbox with TopologyPlugin=
topology/block, two NVLink domains of 3 nodes whose stand-in GPUs answer NVML's fabric info
as the real GB200 capture did (one clique per domain). The block topology comes from the
generator (topology.conf with BlockName= on 23.11-25.05, topology.yaml from 25.05), the
nodes' health gates record their NVLink domain, and multi-node jobs land in one block.

Slurm 22.05 (the host's) has no topology/block: this module runs on the 24.11 and 26.05 legs
(.ci/leg-tests); on 22.05 the generator refuses block output (tests/unit/test_nvl72_blocks.py)
and the tree from ibnetdiscover stays the topology.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _finish, _start

from slurm_resilience import config
from slurm_resilience.health import gate
from slurm_resilience.health.nvlink_domain import RECORD
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.topology import block

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BLOCK = {"TopologyPlugin": "topology/block"}
RECORD_WAIT_S = 120  # HealthCheckInterval is 10 s; a loaded machine may run it late


def installed_slurm() -> tuple[int, int]:
    """slurmctld's version (``slurmctld -V`` needs no configuration, unlike 26.05's scontrol)."""
    out = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    assert m, f"no version in slurmctld -V: {out!r}"
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="module")
def box() -> Iterator[Sandbox]:
    version = installed_slurm()
    if version < block.BLOCK_SINCE:
        pytest.skip(f"Slurm {version[0]}.{version[1]:02d} has no topology/block (23.11+): "
                    "this module runs on the 24.11 and 26.05 legs")
    started = _start(nodes=6, leaves=2, slurm_overrides=BLOCK)
    yield started
    _finish(started)


def blocks_of(box: Sandbox) -> dict[str, str]:
    """Node → block name, from the installed topology file."""
    etc = box.layout.etc
    out: dict[str, str] = {}
    yaml_file = etc / "topology.yaml"
    if yaml_file.exists():
        import yaml

        doc = yaml.safe_load(yaml_file.read_text())
        pairs = [(b["block"], b["nodes"]) for b in doc[0]["block"]["blocks"]]
    else:
        pairs = re.findall(r"^BlockName=(\S+) Nodes=(\S+)", (etc / "topology.conf").read_text(),
                           re.M)
    for name, nodes in pairs:
        listed = box.run(["scontrol", "show", "hostnames", nodes]).stdout.split()
        out.update(dict.fromkeys(listed, name))
    return out


def test_slurmctld_loads_the_generated_block_topology(box: Sandbox) -> None:
    """The file this Slurm reads is the generator's, and slurmctld reports its two blocks."""
    version = installed_slurm()
    name = block.output_for(version)
    text = (box.layout.etc / name).read_text()
    assert "--from-nvlink-domains" in text
    if name == "topology.yaml":
        assert not (box.layout.etc / "topology.conf").exists()
    # e.g. "BlockName=nvl-2b19cdc2-32766 BlockIndex=0 Nodes=node[1-3] BlockSize=3"
    shown = box.run(["scontrol", "show", "topology"]).stdout
    blocks = sorted(set(blocks_of(box).values()))
    assert len(blocks) == 2
    assert re.findall(r"BlockName=(\S+)", shown) == blocks, shown
    log = (box.layout.log_dir / "slurmctld.log").read_text(errors="replace")
    assert "leaf-pin: loaded 2 NVLink blocks (largest 3 nodes), mode tree" in log
    assert {n: b for n, b in blocks_of(box).items()} == {
        "node1": blocks[0], "node2": blocks[0], "node3": blocks[0],
        "node4": blocks[1], "node5": blocks[1], "node6": blocks[1]}


def test_a_multi_node_job_lands_within_one_block(box: Sandbox) -> None:
    """With node1 busy, a 3-node job fits only in the second block, and a 2-node job beside
    it in the first: each lands within one block, never across."""
    of = blocks_of(box)
    holder = box.sbatch(["sleep", "300"], args=["-N1", "-w", "node1", "--exclusive",
                                                "--output=/dev/null"])
    try:
        box.wait_job(holder, {"RUNNING"}, timeout=120)
        jobs = [box.sbatch(["sleep", "2"], args=[f"-N{n}", "--exclusive", "--output=/dev/null"])
                for n in (3, 2)]
        for job_id in jobs:
            info = box.wait_job(job_id, timeout=180)
            assert info.state == "COMPLETED", (job_id, info.state, info.reason)
            spans = {of[n] for n in info.nodes}
            assert len(spans) == 1, f"job {job_id} on {info.nodes} spans blocks {spans}"
            assert info.switches == 1  # job_submit.lua asked for one block
    finally:
        box.run(["scancel", str(holder)])


def test_gates_record_the_domains_and_generate_rebuilds_the_installed_file(
        box: Sandbox, tmp_path: Path) -> None:
    """Each node's health check records its GPUs' NVLink domain; `topology generate` from
    those records, and from the same records scraped from every node's agent (no shared
    filesystem), writes the file slurmctld loaded."""
    cfg = config.load(str(box.layout.resilience_conf))
    paths = {n: Path(gate.state_dir(cfg, n)) / f"{RECORD}.json" for n in box.nodes}
    deadline = time.monotonic() + RECORD_WAIT_S
    while not all(p.exists() for p in paths.values()):
        if time.monotonic() > deadline:
            missing = [n for n, p in paths.items() if not p.exists()]
            raise AssertionError(f"no {RECORD}.json after {RECORD_WAIT_S}s on {missing}")
        time.sleep(1)
    cliques = {n: {g["clique_id"] for g in json.loads(p.read_text())["gpus"]}
               for n, p in paths.items()}
    assert cliques == {n: {c} for n, c in box.layout.clique_of().items()}
    version = installed_slurm()
    name = block.output_for(version)
    for source in (["--from-nvlink-domains", *map(str, paths.values())], ["--from-agents"]):
        out = tmp_path / source[0].lstrip("-")
        done = subprocess.run(
            [sys.executable, "-m", "slurm_resilience", "--config",
             str(box.layout.resilience_conf), "topology", "generate", *source,
             "--slurm-conf", str(box.layout.slurm_conf), "--slurm-version",
             f"{version[0]}.{version[1]:02d}", "--out-dir", str(out)],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env=dict(os.environ, SLURM_CONF=str(box.layout.slurm_conf)))
        assert done.returncode == 0, (source[0], done.stderr)
        assert "left out" not in done.stderr, done.stderr
        assert (out / name).read_text() == (box.layout.etc / name).read_text(), source[0]
