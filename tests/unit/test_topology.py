"""Topology discovery: ibnetdiscover parsing, the fabric model, validation and the CLI."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.cli import main
from slurm_resilience.config import ConfigError, load_text
from slurm_resilience.config.schema import Config
from slurm_resilience.config.topology import TopologySection
from slurm_resilience.slurm.parse import NodeInfo
from slurm_resilience.topology import generate, ibnetdiscover, model, synthetic, validate
from slurm_resilience.topology.model import SwitchLine

IBND = REAL_FIXTURES / "ibnetdiscover"
DGX = IBND / "ibnetdiscover_nvidia-dgx-h100-superpod-ndr_topograph-example_TRIMMED.txt"
KB = IBND / "ibnetdiscover_switchib-edr-plus-sx6012-fdr_mixed-speeds_nvidia-kb-example.txt"
OSC_P = IBND / "ibnetdiscover-p_osc-edr-excerpt_infiniband-exporter-test.txt"
HDR_P = IBND / "ibnetdiscover-p_hdr-leaf-spine-sharp-excerpt_infiniband-exporter-test2.txt"
GB200 = IBND / "ibnetdiscover_gb200-node_isolated-single-ca_topograph-example-bad.txt"
SUN = IBND / "ibnetdiscover_sun-dcs36-qdr_oracle-doc-example.txt"
IBM = IBND / "ibnetdiscover_single-switch-two-hosts_ibm-doc-example.txt"
MANPAGE = IBND / "ibnetdiscover_voltaire-sdr_manpage-example.txt"
PSMN = IBND / "ibnetdiscover_psmn-x5-cluster_voltaire-4036-qdr-11switch-89ca.txt"
CFG = TopologySection()



def fabric_of(path: Path, cfg: TopologySection = CFG, site: model.SiteMap | None = None
              ) -> model.Fabric:
    return model.from_discovery(ibnetdiscover.parse(path.read_text()), cfg, site, path.name)


# -- parser ---------------------------------------------------------------------------------------

def test_dgx_capture_parses_every_switch_and_peer() -> None:
    """The trimmed DGX H100 SuperPOD capture yields its 40 switches and the CAs its ports name."""
    disc = ibnetdiscover.parse(DGX.read_text())
    assert len(disc.of_kind("switch")) == 40
    assert len(disc.of_kind("ca")) > 173  # peers of switch ports whose CA stanza was cut
    assert disc.skipped == []
    hca = disc.nodes[ibnetdiscover.norm_guid("e09d7303007a4bd8")]
    assert hca.description == "a08-p1-dgx-04-c01 mlx5_5"


def test_ports_format_with_padded_descriptions_and_unlinked_ports() -> None:
    """`ibnetdiscover -p` lines parse, description padding is stripped, unlinked ports add nodes."""
    disc = ibnetdiscover.parse(HDR_P.read_text())
    assert disc.format == "ports"
    descs = {n.description for n in disc.of_kind("switch")}
    assert {"5FB0405-leaf-IB01", "5FB0406-spine-IB03", "5FB0406-spine-IB01"} <= descs
    assert len(disc.links) == 3


def test_stderr_noise_is_skipped_and_reported() -> None:
    """A umad error line in the capture is skipped, counted, and becomes a warning."""
    disc = ibnetdiscover.parse(KB.read_text())
    assert [n for n, _ in disc.skipped] == [1]
    fab = model.from_discovery(disc, CFG, source=KB.name)
    assert any("not understood" in w for w in fab.warnings)


def test_odd_whitespace_and_missing_blank_lines() -> None:
    """The Oracle example (no blank line after the header, a lone space between stanzas) parses."""
    fab = fabric_of(SUN)
    assert [(lf.name, lf.nodes) for lf in fab.leaves] == [("ibsw-0021283a8389a0a0", ("nsn33-43",))]


def test_garbage_is_a_parse_error() -> None:
    """Text with no stanza and no port line is refused with a clear error."""
    with pytest.raises(ibnetdiscover.ParseError, match="no Switch/Ca stanza"):
        ibnetdiscover.parse("ibwarn: mad_rpc_open_port: can't open UMAD port\n")


# -- names and hosts ------------------------------------------------------------------------------

@pytest.mark.parametrize(("desc", "host"), [
    ("a08-p1-dgx-04-c01 mlx5_5", "a08-p1-dgx-04-c01"),
    ("a06-p1-dgx-02-c01 HCA-6", "a06-p1-dgx-02-c01"),
    ("o0001 HCA-1", "o0001"),
    ("worker20 mlx5_3", "worker20"),
    ("MT4129 ConnectX7 Mellanox Technologies", None),
    ("some words here", None),
])
def test_host_from_node_description(desc: str, host: str | None) -> None:
    """The host is the first word when the second names an HCA; anything else names no host."""
    assert model.host_of_description(desc) == host


@pytest.mark.parametrize(("desc", "name"), [
    ("MF0;A09-P1-IBLEAF-04-04:MQM9701/U1", "A09-P1-IBLEAF-04-04"),
    ("MF0;switch-de779e:SX6012/U1", "switch-de779e"),
    ("Voltaire 4036 # hoibp0013", "hoibp0013"),
    ("ib-i1l1s01", "ib-i1l1s01"),
    ("SwitchIB Mellanox Technologies", None),
    ("Sun DCS 36 QDR switch localhost", None),
])
def test_switch_name_from_description(desc: str, name: str | None) -> None:
    """Managed-switch descriptions give their hostname; generic model strings give nothing."""
    assert model.derived_switch_name(desc) == name


def test_generic_switch_descriptions_fall_back_to_guid() -> None:
    """A switch whose description names only its model is named from its GUID."""
    names = {lf.name for lf in fabric_of(KB).leaves}
    assert names == {"ibsw-e41d2d030003e470", "switch-de779e"}


def test_names_do_not_depend_on_discovery_order() -> None:
    """Shuffling the stanzas of a capture gives byte-identical outputs."""
    text = DGX.read_text()
    stanzas = text.split("\n\n")
    head, body = stanzas[0], stanzas[1:]
    random.Random(7).shuffle(body)
    shuffled = "\n\n".join([head, *body])
    a = generate.render(model.from_discovery(ibnetdiscover.parse(text), CFG), CFG)
    b = generate.render(model.from_discovery(ibnetdiscover.parse(shuffled), CFG), CFG)
    assert a == b


def test_site_map_renames_switches_and_names_hosts() -> None:
    """The site map renames a switch (by GUID or derived name) and names a factory-described HCA."""
    site = model.SiteMap(
        switches={"e41d2d030003e470": "edr-leaf1", "switch-de779e": "fdr-leaf1"},
        hosts={},
    )
    assert {lf.name for lf in fabric_of(KB, site=site).leaves} == {"edr-leaf1", "fdr-leaf1"}
    disc = ibnetdiscover.parse(MANPAGE.read_text())
    assert not model.from_discovery(disc, CFG).leaves
    site = model.SiteMap(hosts={ibnetdiscover.norm_guid("0x8f10403960984"): "node7"})
    fab = model.from_discovery(disc, CFG, site)
    assert fab.leaf_of() == {"node7": "ibsw-0008f10400410015"}


# -- rail groups, unknown and storage HCAs --------------------------------------------------------

def test_rail_optimised_nodes_are_placed_by_rail_group() -> None:
    """Each DGX node sits in exactly one rail group, whose members are the leaves of its HCAs."""
    fab = fabric_of(DGX)
    counts: dict[str, int] = {}
    for leaf in fab.leaves:
        for node in leaf.nodes:
            counts[node] = counts.get(node, 0) + 1
    assert set(counts.values()) == {1}
    unit = next(lf for lf in fab.leaves if "a06-p1-dgx-02-c01" in lf.nodes)
    assert unit.rail_group
    assert {"A09-P1-IBLEAF-01-02", "A09-P1-IBLEAF-04-02"} <= set(unit.members)
    assert not validate.check_fabric(fab) or not any(f.error for f in validate.check_fabric(fab))


def test_factory_descriptions_and_placeholder_hosts_are_reported() -> None:
    """HCAs with 'MT4129 ConnectX7 ...' or 'localhost HCA-1' are reported, not made hosts."""
    fab = fabric_of(DGX)
    reported = {r.description for r in fab.unknown_hcas}
    assert "MT4129 ConnectX7 Mellanox Technologies" in reported
    assert "localhost HCA-1" in reported
    assert "localhost" not in fab.nodes and "ubuntu" not in fab.nodes
    assert all(r.switch for r in fab.unknown_hcas)
    assert "B11-P1-CUFM-02" not in fab.nodes  # UFM server: fabric infrastructure


def test_storage_hcas_are_kept_out() -> None:
    """An HCA matching storage_hca_patterns is listed as storage, never as a leaf node."""
    text = IBM.read_text().replace("compute-00-01 HCA-1", "oss01 HCA-1")
    fab = model.from_discovery(ibnetdiscover.parse(text), CFG)
    assert fab.nodes == ["compute-00-00"]
    assert [r.description for r in fab.storage_hcas] == ["oss01 HCA-1"]
    cfg = TopologySection(storage_hca_patterns=(), service_host_patterns=())
    assert model.from_discovery(ibnetdiscover.parse(text), cfg).nodes == [
        "compute-00-00", "oss01"]


def test_isolated_node_capture_is_an_error() -> None:
    """A capture of one CA and no switch gives no leaf: an error that explains the likely cause."""
    fab = fabric_of(GB200)
    errors = [f for f in validate.check_fabric(fab) if f.error]
    assert errors and "isolated node" in errors[0].message
    assert fab.unknown_hcas[0].reason.endswith("no link to any switch in the capture")


def test_capture_without_host_names_is_an_error() -> None:
    """The PSMN capture (every CA has a factory description) yields no leaf and 89 reports."""
    fab = fabric_of(PSMN)
    assert not fab.leaves
    assert len(fab.unknown_hcas) == 89


# -- tree structure -------------------------------------------------------------------------------

def test_fat_tree_spines_list_every_leaf_and_no_root_is_added() -> None:
    """In a full fat tree every spine reaches every node, so no synthetic root is needed."""
    fab = model.from_discovery(ibnetdiscover.parse(synthetic.fat_tree(4, 2, 3)), CFG)
    assert [sw.name for sw in fab.uppers] == ["spine001", "spine002"]
    assert all(sw.children == ("leaf0001", "leaf0002", "leaf0003", "leaf0004")
               for sw in fab.uppers)


def test_root_is_added_when_no_switch_reaches_all_nodes() -> None:
    """Two leaves linked directly (no spine) get the configured root switch above them."""
    fab = fabric_of(KB, TopologySection(root_switch="top"))
    assert fab.uppers[-1].name == "top"
    assert set(fab.uppers[-1].children) == {lf.name for lf in fab.leaves}


def test_three_level_tree_levels() -> None:
    """A spine with a core above it: the core lists the spine, the spine lists its leaf."""
    fab = fabric_of(OSC_P)
    levels = {sw.name: (sw.level, sw.children) for sw in fab.uppers}
    assert levels["ib-i1l2s01"] == (1, ("ib-i1l1s01",))
    assert levels["sr-root"][0] == 2


def test_synthetic_rail_groups() -> None:
    """Synthetic 4-rail hosts form one rail group per 4 leaves."""
    fab = model.from_discovery(ibnetdiscover.parse(synthetic.fat_tree(8, 2, 4, rails=4)), CFG)
    assert [(lf.name, len(lf.members), len(lf.nodes)) for lf in fab.leaves] == [
        ("rg-leaf0001", 4, 4), ("rg-leaf0005", 4, 4)]


# -- validation -----------------------------------------------------------------------------------

def _msgs(findings: list[validate.Finding]) -> str:
    return " | ".join(str(f) for f in findings if f.error)


def test_validation_rejects_what_slurmctld_rejects() -> None:
    """Both Nodes= and Switches=, a node on two leaves, a long name, an undefined child all fail."""
    text = (
        "SwitchName=s1 Nodes=n[1-2]\n"
        "SwitchName=s2 Nodes=n[2-3] Switches=s1\n"
        f"SwitchName={'x' * 65} Nodes=n4\n"
        "SwitchName=top Switches=s[1-3]\n"
        "SwitchName=s1 Nodes=n9\n"
    )
    findings = validate.check_lines(validate.parse_topology_conf(text), ["n1", "n2", "n3", "n4"])
    msg = _msgs(findings)
    assert "both Nodes= and Switches=" in msg
    assert "node n2: is on 2 leaves (s1, s2)" in msg
    assert "65 characters" in msg
    assert "child switch(es) not defined: s3" in msg
    assert "defined twice" in msg
    assert "unknown to slurm.conf" in msg and "configuration'): n9" in msg


def test_validation_passes_a_good_file() -> None:
    """A well-formed tree whose nodes slurm.conf knows has no error, only orphan warnings."""
    text = "SwitchName=s1 Nodes=n[1-2]\nSwitchName=s2 Nodes=n3\nSwitchName=top Switches=s[1-2]\n"
    findings = validate.check_lines(validate.parse_topology_conf(text), ["n1", "n2", "n3", "n4"])
    assert not any(f.error for f in findings)
    assert any("n4" in f.message for f in findings)


def test_switch_without_children_and_bad_names_fail() -> None:
    """A SwitchName line with no children, or with a hostlist character in its name, fails."""
    lines = [SwitchLine("a,b", ("n1",), has_nodes=True), SwitchLine("empty")]
    msg = _msgs(validate.check_lines(lines))
    assert "may hold only" in msg and "no children" in msg


def test_hosts_unknown_to_slurm_conf_are_left_out_of_generated_files() -> None:
    """Generating with slurm.conf drops fabric hosts it lacks and warns; nothing is an error."""
    fab = fabric_of(KB).restricted_to(["r-ufm111", "r-ufm96"], why="not in slurm.conf")
    assert fab.nodes == ["r-ufm111", "r-ufm96"]
    assert any("r-ufm[100-101,216]" in w for w in fab.warnings)
    assert not any(f.error for f in validate.check_fabric(fab, ["r-ufm111", "r-ufm96"]))


def test_topology_conf_round_trip() -> None:
    """A generated topology.conf read back gives the same leaves and switches."""
    fab = fabric_of(DGX)
    text = generate.topology_conf(fab)
    lines = validate.parse_topology_conf(text)
    assert not any(f.error for f in validate.check_lines(lines))
    back = model.from_switch_lines(lines)
    assert [(lf.name, lf.nodes) for lf in back.leaves] == [(lf.name, lf.nodes) for lf in fab.leaves]
    assert {(s.name, s.children) for s in back.uppers} == {(s.name, s.children) for s in fab.uppers}


# -- config ---------------------------------------------------------------------------------------

def test_config_rejects_bad_patterns_and_prefix() -> None:
    """A broken regular expression or a feature prefix with an operator names its key."""
    with pytest.raises(ConfigError, match="storage_hca_patterns"):
        load_text(Config, "topology:\n  storage_hca_patterns: ['(']\n")
    with pytest.raises(ConfigError, match="leaf_feature_prefix"):
        load_text(Config, "topology:\n  leaf_feature_prefix: 'leaf|'\n")
    cfg = load_text(Config, "topology:\n  mode: feature\n  opt_out_partitions: [debug]\n")
    assert cfg.topology.mode == "feature" and cfg.topology.opt_out_partitions == ("debug",)


# -- features -------------------------------------------------------------------------------------

class RecordingSlurm:
    """Stands in for SlurmAdapter's two feature calls (the real ones run in the sandbox test)."""

    def __init__(self, nodes: list[NodeInfo]):
        self.nodes = nodes
        self.calls: list[tuple[str, tuple[str, ...], tuple[str, ...] | None]] = []

    def list_nodes(self) -> list[NodeInfo]:
        return self.nodes

    def set_features(self, name: str, available: object, active: object = None) -> None:
        self.calls.append((name, tuple(available), tuple(active)))  # type: ignore[arg-type]


def _node(name: str, feats: tuple[str, ...]) -> NodeInfo:
    return NodeInfo(name, "IDLE", frozenset(), features=feats, active_features=feats)


def test_apply_features_replaces_old_leaf_features_in_groups() -> None:
    """Nodes get their leaf feature, old leaf_ features go, others stay; equal sets share a call."""
    fab = model.from_switch_lines(validate.parse_topology_conf(
        "SwitchName=a Nodes=n[1-2]\nSwitchName=b Nodes=n3\n"))
    slurm = RecordingSlurm([_node("n1", ("gpu", "leaf_old")), _node("n2", ("gpu",)),
                            _node("n3", ("leaf_b",)), _node("n4", ("leaf_x",))])
    changed = generate.apply_features(slurm, fab, CFG)
    assert changed == 3
    assert sorted(slurm.calls) == [("n4", (), ()),
                                   ("n[1-2]", ("gpu", "leaf_a"), ("gpu", "leaf_a"))]


def test_features_snippet_merges_slurm_conf_features(tmp_path: Path) -> None:
    """The NodeName snippet keeps the features slurm.conf already gives each node."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("NodeName=DEFAULT CPUs=4\nNodeName=n[1-2] Features=gpu,leaf_old\n"
                    "NodeName=n3\nPartitionName=p Nodes=n[1-3] Default=YES\n")
    from slurm_resilience.topology.slurmconf import parse_slurm_conf

    slurm = parse_slurm_conf(str(conf))
    fab = model.from_switch_lines(validate.parse_topology_conf(
        "SwitchName=a Nodes=n[1-2]\nSwitchName=b Nodes=n3\n"))
    snippet = generate.features_snippet(fab, CFG, slurm)
    assert "NodeName=n[1-2] Features=gpu,leaf_a\n" in snippet
    assert "NodeName=n3 Features=leaf_b\n" in snippet
    data = generate.lua_data(fab, CFG, slurm)
    assert 'default_partition = "p"' in data
    assert '["p"] = {' in data


# -- CLI ------------------------------------------------------------------------------------------

def test_cli_generate_writes_three_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    """`topology generate --from-ibnetdiscover` writes topology.conf, features and Lua data."""
    rc = main(["--config", str(_empty_config(tmp_path)), "topology", "generate",
               "--from-ibnetdiscover", str(DGX), "--out-dir", str(tmp_path / "out")])
    assert rc == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["leaf-features.conf", generate.DATA_FILE, "topology.conf"]
    err = capsys.readouterr().err
    assert "unknown host" in err and "MT4129" in err


def test_cli_generate_refuses_on_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    """With errors (an isolated-node capture) nothing is written and the exit status is 1."""
    rc = main(["--config", str(_empty_config(tmp_path)), "topology", "generate",
               "--from-ibnetdiscover", str(GB200), "--out-dir", str(tmp_path / "out")])
    assert rc == 1
    assert not (tmp_path / "out").exists()
    assert "couldn't write outputs" in capsys.readouterr().err


def test_cli_from_topology_conf_refuses_unknown_nodes(tmp_path: Path) -> None:
    """--from-topology-conf with slurm.conf refuses a node slurm.conf lacks."""
    (tmp_path / "topology.conf").write_text("SwitchName=a Nodes=n[1-3]\n")
    (tmp_path / "slurm.conf").write_text("NodeName=n[1-2] CPUs=1\n")
    args = ["--config", str(_empty_config(tmp_path)), "topology", "generate",
            "--from-topology-conf", str(tmp_path / "topology.conf"),
            "--slurm-conf", str(tmp_path / "slurm.conf"), "--dry-run"]
    assert main(args) == 1
    (tmp_path / "slurm.conf").write_text("NodeName=n[1-3] CPUs=1\n")
    assert main(args) == 0


def test_cli_site_map_errors_name_the_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    """A site map entry that is not a valid name is refused, naming the entry."""
    site = tmp_path / "site.yaml"
    site.write_text("switches:\n  switch-de779e: 'bad name'\n")
    rc = main(["--config", str(_empty_config(tmp_path)), "topology", "generate",
               "--from-ibnetdiscover", str(KB), "--site-map", str(site), "--dry-run"])
    assert rc == 2
    assert "switches.switch-de779e" in capsys.readouterr().err


def test_cli_check(tmp_path: Path) -> None:
    """`topology check` exits 1 on a file slurmctld would reject and 0 on a good one."""
    bad = tmp_path / "bad.conf"
    bad.write_text("SwitchName=s1 Nodes=n1 Switches=s2\nSwitchName=s2 Nodes=n2\n")
    good = tmp_path / "good.conf"
    good.write_text("SwitchName=s1 Nodes=n1\nSwitchName=s2 Switches=s1\n")
    assert main(["topology", "check", str(bad)]) == 1
    assert main(["topology", "check", str(good)]) == 0


def _empty_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("")
    return path


def test_fabric_hostnames_map_to_slurm_node_names(tmp_path: Path) -> None:
    """Hosts named by NodeHostname or by a fully qualified name become their NodeName."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("NodeName=cn1 NodeHostname=r-ufm111 CPUs=1\nNodeName=r-ufm96 CPUs=1\n"
                    "NodeName=r-ufm100 CPUs=1\n")
    text = KB.read_text().replace('"r-ufm100 HCA-2"', '"r-ufm100.cluster.example HCA-2"')
    disc_path = tmp_path / "capture.txt"
    disc_path.write_text(text)
    out = tmp_path / "out"
    rc = main(["--config", str(_empty_config(tmp_path)), "topology", "generate",
               "--from-ibnetdiscover", str(disc_path), "--slurm-conf", str(conf),
               "--out-dir", str(out)])
    assert rc == 0
    topo = (out / "topology.conf").read_text()
    assert "Nodes=cn1\n" in topo and "Nodes=r-ufm[96,100]\n" in topo
