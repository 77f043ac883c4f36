"""Leaf pinning against real slurmctld: a 3 leaves x 3 nodes sandbox with topology/tree,
job_submit.lua and the data file written by the topology generator."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import _finish, _start

from slurm_resilience.sandbox import slurmconf
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.slurm.parse import JobInfo, parse_job
from slurm_resilience.topology import generate, install, synthetic

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
WAIT4SWITCH_S = 60
NO_HOOKS = {"Prolog": "", "Epilog": "", "HealthCheckProgram": ""}


def configure(box: Sandbox, **settings: Any) -> None:
    """Regenerate topology.conf and the Lua data with ``settings``, and make slurmctld reload."""
    base = dict(box.base_resilience_sections().get("topology", {}))
    base.update(settings)
    L = box.layout
    install.write_generated(L.etc, slurmconf.topology_conf(L), base, L.slurm_conf)
    install.reload_job_submit(L.etc / "job_submit.lua")


def ctld_log(box: Sandbox) -> str:
    return (box.layout.log_dir / "slurmctld.log").read_text(errors="replace")


@dataclass
class Campaign:
    """What one randomized run did and where its multi-node jobs landed."""

    submitted: int = 0
    multi: int = 0
    in_leaf: int = 0
    excused: int = 0  # spanned only after waiting past wait4switch: no leaf had room
    pinned: int = 0  # jobs whose record shows Switches= set by the plugin
    seconds: float = 0.0

    @property
    def fraction(self) -> float:
        judged = self.multi - self.excused
        return self.in_leaf / judged if judged else 1.0

    def line(self, name: str) -> str:
        return (f"{name}: {self.submitted} jobs, {self.multi} multi-node, {self.in_leaf} within "
                f"one leaf ({self.fraction:.1%}), {self.excused} excused, {self.pinned} pinned, "
                f"{self.seconds:.0f}s")


def _jobs(box: Sandbox, ids: set[int]) -> dict[int, JobInfo]:
    out = box.run(["scontrol", "show", "job", "-o"]).stdout
    jobs = [parse_job(line) for line in out.splitlines() if line.startswith("JobId=")]
    return {j.job_id: j for j in jobs if j.job_id in ids}


def _wait_done(box: Sandbox, ids: set[int], timeout: float) -> dict[int, JobInfo]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = _jobs(box, ids)
        if len(jobs) == len(ids) and all(j.state in DONE for j in jobs.values()):
            return jobs
        if time.monotonic() > deadline:
            stuck = {i: (j.state, j.reason) for i, j in jobs.items() if j.state not in DONE}
            raise TimeoutError(f"jobs not finished after {timeout:g}s: {stuck}")
        time.sleep(0.5)


def campaign(box: Sandbox, *, seed: int, batches: int = 10, per_batch: int = 11) -> Campaign:
    """Randomized 1-3-node exclusive sleep jobs in batches, a random drain before each batch."""
    rng = random.Random(seed)
    ctl = box.adapter()
    leaf_of: Mapping[str, str] = box.layout.leaf_of()
    result = Campaign()
    drained: str | None = None
    start = time.monotonic()
    for _ in range(batches):
        if drained:
            ctl.resume(drained)
        drained = rng.choice(box.nodes) if rng.random() < 0.8 else None
        if drained:
            ctl.drain(drained, "topology test: random drain")
        ids = set()
        for _ in range(per_batch):
            nodes = rng.randint(1, 3)
            ids.add(box.sbatch(["sleep", rng.choice(["1", "2"])],
                               args=[f"-N{nodes}", "--exclusive", "--output=/dev/null"]))
        for job in _wait_done(box, ids, timeout=150).values():
            result.submitted += 1
            if job.state != "COMPLETED":
                raise AssertionError(f"job {job.job_id} ended {job.state}: {job.reason}")
            if len(job.nodes) < 2:
                continue
            result.multi += 1
            result.pinned += job.switches in (1, 2, 3)
            if len({leaf_of[n] for n in job.nodes}) == 1:
                result.in_leaf += 1
            elif job.start_time - job.submit_time >= WAIT4SWITCH_S:
                result.excused += 1
    if drained:
        ctl.resume(drained)
    result.seconds = time.monotonic() - start
    return result


@pytest.fixture(scope="module")
def box() -> Iterator[Sandbox]:
    """One 9-node, 3-leaf sandbox for this module (starting one takes seconds). Placement
    does not involve our prolog, epilog or health check, so they are left out: ~100 jobs
    then take about a minute instead of several."""
    started = _start(nodes=9, leaves=3, slurm_overrides=NO_HOOKS)
    yield started
    _finish(started)


def test_generated_files_are_installed_and_loaded(box: Sandbox) -> None:
    """The sandbox's topology.conf and Lua data come from the generator; slurmctld loads both."""
    etc = box.layout.etc
    assert "generated by slurm-resilience topology generate" in (etc / "topology.conf").read_text()
    assert (etc / generate.DATA_FILE).exists()
    assert "leaf-pin: loaded 3 leaves (largest 3 nodes), mode tree" in ctld_log(box)


def test_randomized_jobs_stay_in_one_leaf_and_control_reports_baseline(box: Sandbox) -> None:
    """≥100 random 1-3-node jobs with random drains: with the plugin every multi-node job lies
    in one leaf (unless it waited past wait4switch); the plugin-off control gives the baseline."""
    configure(box, mode="tree", wait4switch_s=WAIT4SWITCH_S)
    pinned = campaign(box, seed=11)
    configure(box, mode="off")
    # The control only shows the baseline (no job pinned): half as many jobs say it.
    control = campaign(box, seed=11, batches=5)
    print("\n" + pinned.line("leaf-pin tree") + "\n" + control.line("control (plugin off)"))
    assert pinned.submitted >= 100
    assert pinned.pinned == pinned.multi
    assert pinned.fraction == 1.0, pinned.line("leaf-pin tree")
    assert control.pinned == 0


def test_feature_mode_constraints_in_slurm(box: Sandbox) -> None:
    """Feature mode: Slurm accepts and honours [leaf…], user&[…] and (a|b)&[…]; a user's own
    bracket is kept; the SPANK --leaf-pin=off option opts a job out."""
    configure(box, mode="feature")
    cases = {"": "[leaf01|leaf02|leaf03]", "leaf02": "leaf02&[leaf01|leaf02|leaf03]",
             "leaf01|leaf03": "(leaf01|leaf03)&[leaf01|leaf02|leaf03]",
             "[leaf02|leaf03]": "[leaf02|leaf03]"}
    ids = {}
    for own, _ in cases.items():
        args = ["-N2", "--output=/dev/null"] + ([f"--constraint={own}"] if own else [])
        ids[own] = box.sbatch(["sleep", "1"], args=args)
    jobs = _wait_done(box, set(ids.values()), timeout=60)
    for own, expected in cases.items():
        job = jobs[ids[own]]
        assert job.features == expected
        assert job.state == "COMPLETED"
        assert len({box.leaf_of(n) for n in job.nodes}) == 1
    spank = box.layout.repo / "spank" / "slurm_resilience.so"
    if spank.exists():
        jid = box.sbatch(["true"], args=["-N2", "--leaf-pin=off", "--output=/dev/null"])
        job = box.wait_job(jid)
        assert job.features == ""
        assert "left alone: SPANK SLURM_RESILIENCE_LEAF_PIN=off" in ctld_log(box)
    configure(box, mode="tree")


def test_user_switches_and_opt_out_env_in_slurm(box: Sandbox) -> None:
    """A job's own --switches is kept; SLURM_RESILIENCE_LEAF_PIN=off in a batch job's
    environment leaves it unpinned."""
    configure(box, mode="tree", wait4switch_s=30)
    own = box.sbatch(["true"], args=["-N2", "--switches=2@1", "--output=/dev/null"])
    off = box.sbatch(["true"], args=["-N2", "--output=/dev/null"],
                     env={"SLURM_RESILIENCE_LEAF_PIN": "off"})
    pinned = box.sbatch(["true"], args=["-N2", "--output=/dev/null"])
    assert box.wait_job(own).switches == 2
    assert box.wait_job(off).switches != 1
    pinned_job = box.wait_job(pinned)
    assert (pinned_job.switches, pinned_job.switch_wait_s) == (1, 30)
    assert "left alone: environment SLURM_RESILIENCE_LEAF_PIN=off" in ctld_log(box)


def test_cli_generate_apply_features(box: Sandbox, tmp_path: Path) -> None:
    """`topology generate --from-topology-conf ... --apply-features` writes the outputs and gives
    each node its leaf feature through the adapter, keeping its other features; a second run
    changes nothing."""
    L = box.layout
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"slurm": {"conf": str(L.slurm_conf)},
                                   "topology": {"leaf_feature_prefix": "ib_"}}))
    argv = [str(L.repo / ".venv" / "bin" / "slurm-resilience"), "--config", str(cfg),
            "topology", "generate", "--from-topology-conf", str(L.topology_conf),
            "--slurm-conf", str(L.slurm_conf), "--out-dir", str(tmp_path / "out"),
            "--apply-features"]
    out = box.run(argv).stdout
    assert "leaf features set on 9 node(s)" in out
    assert (tmp_path / "out" / "leaf-features.conf").read_text().count("NodeName=") == 3
    nodes = {n.name: n.features for n in box.adapter().list_nodes()}
    assert nodes["node1"] == ("leaf01", "ib_leaf01")
    assert nodes["node9"] == ("leaf03", "ib_leaf03")
    assert "leaf features set on 0 node(s)" in box.run(argv).stdout


def test_rail_optimised_capture_installs_and_places_by_rail_group(box: Sandbox,
                                                                 tmp_path: Path) -> None:
    """A rail-optimised capture (each node's 2 HCAs on 2 leaves) generated with the CLI into
    the sandbox: slurmctld accepts the rail groups as leaves and a 3-node job lands in one."""
    L = box.layout
    capture = tmp_path / "ibnetdiscover.out"
    capture.write_text(synthetic.fat_tree(6, 2, 3, rails=2, host_prefix="node", width=1))
    saved = {p: p.read_text() for p in (L.topology_conf, L.etc / generate.DATA_FILE)}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"topology": {"leaf_feature_prefix": ""}}))
    try:
        box.run([str(L.repo / ".venv" / "bin" / "slurm-resilience"), "--config", str(cfg),
                 "topology", "generate", "--from-ibnetdiscover", str(capture),
                 "--slurm-conf", str(L.slurm_conf), "--out-dir", str(L.etc)])
        box.restart_slurmctld()
        box.wait_nodes_ready(30)
        topo = box.run(["scontrol", "show", "topology"]).stdout
        assert "SwitchName=rg-leaf0001 Level=0" in topo and "Nodes=node[1-3]" in topo
        assert "leaf-pin: loaded 3 leaves (largest 3 nodes), mode tree" in ctld_log(box)
        job = box.wait_job(box.sbatch(["true"], args=["-N3", "--output=/dev/null"]))
        assert job.switches == 1
        groups = [{"node1", "node2", "node3"}, {"node4", "node5", "node6"},
                  {"node7", "node8", "node9"}]
        assert set(job.nodes) in groups
    finally:
        for path, text in saved.items():
            path.write_text(text)
        box.restart_slurmctld()
        box.wait_nodes_ready(30)
