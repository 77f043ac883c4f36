"""GB200 NVL72: the NVML fabric stand-in built from real captures, the collector's NVLink
domain (cluster UUID, clique id), the gate's fabric verdict on those captures, the record the
gate keeps, and the block topology the generator writes per Slurm version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import GpuCheckSection
from slurm_resilience.fakes import nvml as fake
from slurm_resilience.fakes import nvml_fabric
from slurm_resilience.health import gate
from slurm_resilience.health.checks import gpu as gpu_check
from slurm_resilience.health.collectors import nvml as collector
from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot
from slurm_resilience.health.findings import Severity
from slurm_resilience.health.nvlink_domain import RECORD, GpuFabric, NodeFabric
from slurm_resilience.topology import block

FABRIC = REAL_FIXTURES / "nvlink-fabric"
REPO = Path(__file__).resolve().parents[2]
UNHEALTHY = "nvidia-smi-q-fabric_gb200_clique2_summary-unhealthy_excerpt.txt"
NO_DOMAIN = "nvidia-smi-q-fabric_gb200_status-insufficient-resources_excerpt.txt"
NCCL = "nccl-info-mnnvl_gb200-4gpu_healthmask-0xaa.txt"
GPUD = "gpud-fabric-states_gb200_clique4026_excerpt.json"
pytest.importorskip("pynvml")


def entries(name: str) -> list[dict[str, Any]]:
    text = (FABRIC / name).read_text()
    if name.startswith("nccl"):
        return nvml_fabric.from_nccl_log(text)
    if name.endswith(".json"):
        return nvml_fabric.from_gpud_json(text)
    return nvml_fabric.from_nvidia_smi(text)


def collect(tmp_path: Path, fabrics: list[dict[str, Any]], node: str = "n1") -> NvmlSnapshot:
    """The collector against the stand-in whose GPUs answer ``fabrics``."""
    scenario = fake.default_scenario(len(fabrics))
    for gpu, fab in zip(scenario["gpus"], fabrics, strict=True):
        gpu["fabric"] = fab
    fake.write_scenario(str(tmp_path / f"{node}.json"), scenario)
    return collector.collect("fake", str(tmp_path), node)


def fabric_fails(snap: NvmlSnapshot) -> list[str]:
    findings = gpu_check.check(snap, GpuCheckSection(), gpu_check.GpuState(),
                               kind="healthcheck").findings
    return [f.message for f in findings if f.severity is Severity.FAIL and "fabric" in f.message]


# -- the stand-in, faithful to the captures ---------------------------------------------------

def test_captures_become_nvml_answers() -> None:
    """Each capture's rows map to nvml.h's values: states, statuses, summary and mask."""
    assert entries(UNHEALTHY) == [{
        "state": 3, "status": 0, "health_summary": 2, "clique_id": 2,
        "cluster_uuid": "dc6e40c4-d722-4357-9ba6-5291dd461278",
        "health_mask": 2}]  # Bandwidth: Full = DEGRADED_BW_FALSE (2) at shift 0
    assert entries(NO_DOMAIN) == [{
        "state": 3, "status": 23, "health_mask": 0, "health_summary": 0, "clique_id": 0,
        "cluster_uuid": block.ZERO_UUID}]
    nccl = entries(NCCL)
    assert len(nccl) == 4 and all(e == nccl[0] for e in nccl)
    assert (nccl[0]["clique_id"], nccl[0]["health_mask"]) == (0x7FFE, 0xAA)
    assert [e["clique_id"] for e in entries(GPUD)] == [4026, 4026]
    # The sandbox's NVL72 GPUs answer what the real tray's NCCL line shows.
    assert fake.nvl72_fabric() == nccl[0]


def test_0xaa_is_the_healthy_mask() -> None:
    """Every 2-bit field FALSE (nvml.h): no fault, whatever NCCL issue 2186 read into it."""
    from slurm_resilience.health.checks import gpu_fabric

    assert gpu_fabric.mask_faults(0xAA) == []
    assert gpu_fabric.mask_faults(0xA9) == ["degraded bandwidth"]
    assert gpu_fabric.mask_faults(0x9A) == ["route unhealthy"]


def test_full_nvidia_smi_health_rows() -> None:
    """The V3 rows of a newer driver: each TRUE row sets its field to 1."""
    text = """    Fabric
        State                             : Completed
        Status                            : Success
        CliqueId                          : 7
        ClusterUUID                       : dc6e40c4-d722-4357-9ba6-5291dd461278
        Health
            Summary                       : Unhealthy
            Bandwidth                     : Degraded
            Route Recovery in progress    : False
            Route Unhealthy               : True
            Access Timeout Recovery       : False
            Incorrect Configuration       : None
"""
    (e,) = nvml_fabric.from_nvidia_smi(text)
    assert e["health_mask"] == 0x1 | 2 << 2 | 1 << 4 | 2 << 6 | 1 << 8
    with pytest.raises(nvml_fabric.CaptureError, match="unknown fabric state 'Exploded'"):
        nvml_fabric.from_nvidia_smi(text.replace("Completed", "Exploded"))


def test_collector_reads_the_domain_from_nvml(tmp_path: Path) -> None:
    """clusterUuid (16 bytes) and cliqueId come back as nvidia-smi prints them."""
    snap = collect(tmp_path, entries(UNHEALTHY) + entries(GPUD))
    got = [(g.fabric.cluster_uuid, g.fabric.clique_id) for g in snap.gpus if g.fabric]
    assert got == [("dc6e40c4-d722-4357-9ba6-5291dd461278", 2),
                   ("9c6f5af3-53bf-49b5-a436-b66766c413c3", 4026),
                   ("9c6f5af3-53bf-49b5-a436-b66766c413c3", 4026)]
    again = NvmlSnapshot.from_json(json.loads(json.dumps(snap.to_json())))
    assert again.gpus[0].fabric == snap.gpus[0].fabric


# -- the gate ---------------------------------------------------------------------------------

def test_gate_fails_the_unhealthy_and_unregistered_captures(tmp_path: Path) -> None:
    assert fabric_fails(collect(tmp_path, entries(UNHEALTHY))) == [
        "gpu0 fabric health UNHEALTHY (expected HEALTHY)"]
    assert fabric_fails(collect(tmp_path, entries(NO_DOMAIN))) == [
        "gpu0 fabric status INSUFFICIENT_RESOURCES (expected success: the GPU joined no "
        "NVLink domain)"]
    route = dict(entries(NCCL)[0], health_mask=0x9A, health_summary=2)
    assert fabric_fails(collect(tmp_path, [route])) == [
        "gpu0 fabric health UNHEALTHY: route unhealthy (expected HEALTHY)"]


def test_gate_passes_the_healthy_captures(tmp_path: Path) -> None:
    assert fabric_fails(collect(tmp_path, entries(NCCL))) == []
    assert fabric_fails(collect(tmp_path, entries(GPUD))) == []


def test_gate_records_the_node_domain_when_it_changes(tmp_path: Path, monkeypatch: Any) -> None:
    """The gate keeps nvlink-domain.json in the node's health state, rewritten on a change."""
    store = gate.StateStore(str(tmp_path / "state"))
    snap = collect(tmp_path, entries(NCCL))
    monkeypatch.setattr(gate.time, "time", lambda: 100.0)
    gate._record_nvlink_domain(store, "n1", snap)
    first = NodeFabric.from_json(store.load(RECORD))
    assert first.node == "n1" and first.time == 100.0 and len(first.gpus) == 4
    assert {(g.cluster_uuid, g.clique_id) for g in first.gpus} == {
        (entries(NCCL)[0]["cluster_uuid"], 0x7FFE)}
    monkeypatch.setattr(gate.time, "time", lambda: 200.0)
    gate._record_nvlink_domain(store, "n1", snap)
    assert NodeFabric.from_json(store.load(RECORD)).time == 100.0  # unchanged: not rewritten
    gate._record_nvlink_domain(store, "n1", collect(tmp_path, entries(UNHEALTHY)))
    assert NodeFabric.from_json(store.load(RECORD)).gpus[0].clique_id == 2


# -- blocks -----------------------------------------------------------------------------------

def node(name: str, fabrics: list[dict[str, Any]]) -> NodeFabric:
    return NodeFabric(name, 0.0, [GpuFabric(i, f["state"], f["status"], f["cluster_uuid"],
                                            f["clique_id"], f["health_mask"],
                                            f["health_summary"]) for i, f in enumerate(fabrics)])


def rack(prefix: str, clique: int, count: int) -> list[NodeFabric]:
    return [node(f"{prefix}{i:02d}", [fake.nvl72_fabric(clique)] * 4) for i in range(1, count + 1)]


def test_nodes_group_into_one_block_per_domain() -> None:
    records = rack("gb-a", 0x7FFE, 18) + rack("gb-b", 0x7FFF, 18)
    p = block.plan(records)
    assert [(b.name, len(b.nodes)) for b in p.blocks] == [
        ("nvl-2b19cdc2-32766", 18), ("nvl-2b19cdc2-32767", 18)]
    assert p.left_out == {} and p.warnings == []
    conf = block.topology_conf(p)
    assert "BlockName=nvl-2b19cdc2-32766 Nodes=gb-a[01-18]\n" in conf
    assert conf.endswith("BlockSizes=18\n")
    assert "blocks:\n    - block: nvl-2b19cdc2-32766\n      nodes: gb-a[01-18]" in \
        block.topology_yaml(p)


def test_split_unregistered_unhealthy_and_missing_nodes_are_reported() -> None:
    healthy = fake.nvl72_fabric()
    split = node("gb-a03", [healthy, healthy, fake.nvl72_fabric(9), fake.nvl72_fabric(9)])
    unregistered = node("gb-a04", entries(NO_DOMAIN) * 4)
    degraded = node("gb-a05", [dict(healthy, health_mask=0xA9, health_summary=3)] + [healthy] * 3)
    h100 = node("hgx01", [fake.default_gpu(0)["fabric"] | {"cluster_uuid": block.ZERO_UUID,
                                                           "clique_id": 0}] * 8)
    records = [*rack("gb-a", 32766, 2), split, unregistered, degraded, h100]
    p = block.plan(records, known=["gb-a01", "gb-a02", "gb-a03", "gb-a04", "gb-a05", "hgx01",
                                   "gb-a06"])
    assert [b.nodes for b in p.blocks] == [("gb-a01", "gb-a02", "gb-a05")]
    assert p.left_out == {
        "gb-a03": "split over 2 NVLink domains: gpu0,1 in clique 32766 of "
                  "2b19cdc2-5bb1-4331-935b-fb73549bcc28; gpu2,3 in clique 9 of "
                  "2b19cdc2-5bb1-4331-935b-fb73549bcc28",
        "gb-a04": "gpu0 fabric not registered (state COMPLETED, status INSUFFICIENT_RESOURCES)",
        "hgx01": "in no NVLink domain (cluster UUID all zeros)",
        "gb-a06": "no NVLink domain record (has its health check run?)"}
    assert p.warnings == [
        "gb-a05: gpu0 fabric health LIMITED_CAPACITY: degraded bandwidth (mask 0xa9)"]


def test_the_file_follows_the_slurm_version() -> None:
    p = block.plan(rack("gb-a", 1, 2))
    assert block.render(p, (23, 11))[0] == "topology.conf"
    assert block.render(p, (25, 2))[0] == "topology.conf"
    assert block.render(p, (25, 5))[0] == "topology.yaml"
    assert block.render(p, (26, 5))[0] == "topology.yaml"
    with pytest.raises(block.VersionError, match=r"Slurm 22\.05 has no topology/block .*"
                                                 r"keep its tree topology"):
        block.render(p, (22, 5))


def test_cli_generate_from_records(tmp_path: Path) -> None:
    """`topology generate --from-nvlink-domains` writes the block file and the Lua data, and
    names each node it left out; on 22.05 it refuses, naming the tree as the way."""
    paths = []
    for rec in [*rack("gb-a", 5, 3), node("gb-a04", entries(NO_DOMAIN) * 4)]:
        path = tmp_path / f"{rec.node}.json"
        path.write_text(json.dumps(rec.to_json()))
        paths.append(str(path))
    conf = tmp_path / "sr.yaml"
    conf.write_text("")

    def generate(version: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "slurm_resilience", "--config", str(conf), "topology",
             "generate", "--from-nvlink-domains", *paths, "--slurm-version", version,
             "--out-dir", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=120, cwd=REPO)

    done = generate("24.11")
    assert done.returncode == 0, done.stderr
    assert "gb-a04: left out of every block: gpu0 fabric not registered" in done.stderr
    assert "BlockName=nvl-2b19cdc2-5 Nodes=gb-a[01-03]" in \
        (tmp_path / "out" / "topology.conf").read_text()
    lua = (tmp_path / "out" / "slurm-resilience-topology.lua").read_text()
    assert 'unit = "block"' in lua and 'large_jobs = "leave"' in lua
    assert generate("26.05").returncode == 0
    assert (tmp_path / "out" / "topology.yaml").exists()
    old = generate("22.05")
    assert old.returncode == 1
    assert "Slurm 22.05 has no topology/block (it came in 23.11)" in old.stderr



def test_the_agent_exports_the_record_and_topology_reads_it_back(tmp_path: Path) -> None:
    """The agent's /metrics carries each GPU's domain and health; scraped back, it is the
    record the gate saved. An agent that could not be scraped, or has no record, is named."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    from slurm_resilience.health import nvlink_domain
    from slurm_resilience.metrics import cluster
    from slurm_resilience.metrics.collector import nvlink_metrics
    from slurm_resilience.topology import block_cli

    rec = node("gb-a01", [fake.nvl72_fabric(), dict(fake.nvl72_fabric(), health_mask=0x9A,
                                                    health_summary=2)])
    rec.time = 1234.0
    path = tmp_path / "nvlink-domain.json"
    path.write_text(json.dumps(rec.to_json()))
    assert nvlink_domain.read(str(path)) == rec
    assert nvlink_domain.read(str(tmp_path / "none.json")) is None
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"bad\.json: not an NVLink domain record"):
        nvlink_domain.read(str(tmp_path / "bad.json"))

    def exported(record: NodeFabric | None) -> str:
        class One(Collector):
            def collect(self) -> Any:
                yield from nvlink_metrics(record)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(One())
        return generate_latest(registry).decode()

    text = exported(rec)
    assert 'slurm_resilience_gpu_nvlink_domain_info{clique_id="32766",cluster_uuid=' \
           '"2b19cdc2-5bb1-4331-935b-fb73549bcc28",gpu="0"} 1.0' in text
    scrapes = [cluster.Scrape("gb-a01", "http://a:1/metrics", cluster.parse(text)),
               cluster.Scrape("gb-a02", "http://b:1/metrics", cluster.parse(exported(None))),
               cluster.Scrape("gb-a03", "http://c:1/metrics", error="URLError: refused")]
    records, failed = block_cli.records_from_scrapes(scrapes)
    assert records == [rec]
    assert failed == {
        "gb-a02": "its agent exports no NVLink domain (has its health check run?)",
        "gb-a03": "couldn't scrape its agent at http://c:1/metrics: URLError: refused"}


def test_sandbox_block_mode_installs_the_file_its_slurm_reads(tmp_path: Path) -> None:
    """A sandbox with TopologyPlugin=topology/block: one NVLink domain per leaf, from the real
    capture's fabric; topology.conf with BlockName= for 24.11, topology.yaml (and no
    topology.conf) for 26.05; a node in no block is refused."""
    from slurm_resilience.sandbox import control, slurmconf
    from slurm_resilience.sandbox.layout import Layout
    from slurm_resilience.topology import install

    layout = Layout(state_dir=tmp_path, nodes=4, leaves=2, port_base=20000,
                    slurm_overrides=(("TopologyPlugin", "topology/block"),))
    assert layout.block_topology and not Layout(state_dir=tmp_path, nodes=4, leaves=2,
                                                port_base=20000).block_topology
    assert layout.clique_of() == {"node1": 0x7FFE, "node2": 0x7FFE, "node3": 0x7FFF,
                                  "node4": 0x7FFF}
    layout.etc.mkdir(parents=True)
    layout.slurm_conf.write_text(slurmconf.slurm_conf(layout, job_submit_lua=True))
    records = control.block_records(layout)
    install.write_blocks(layout.etc, records, (24, 11), {}, layout.slurm_conf)
    conf = (layout.etc / "topology.conf").read_text()
    assert "BlockName=nvl-2b19cdc2-32766 Nodes=node[1-2]" in conf
    assert "BlockName=nvl-2b19cdc2-32767 Nodes=node[3-4]" in conf
    assert 'unit = "block"' in (layout.etc / "slurm-resilience-topology.lua").read_text()
    install.write_blocks(layout.etc, records, (26, 5), {}, layout.slurm_conf)
    assert not (layout.etc / "topology.conf").exists()
    assert "block: nvl-2b19cdc2-32767" in (layout.etc / "topology.yaml").read_text()
    with pytest.raises(install.InstallError, match="node4: no NVLink domain record"):
        install.write_blocks(layout.etc, records[:3], (24, 11), {}, layout.slurm_conf)
