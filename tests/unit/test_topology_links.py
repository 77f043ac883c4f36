"""Degraded fabric links (width or speed below their peers) and non-compute hosts on leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.cli import main
from slurm_resilience.config.topology import TopologySection
from slurm_resilience.topology import ibnetdiscover, model
from slurm_resilience.topology.links import LinkRate, RatedLink, degraded

IBND = REAL_FIXTURES / "ibnetdiscover"
DGX = IBND / "ibnetdiscover_nvidia-dgx-h100-superpod-ndr_topograph-example_TRIMMED.txt"
MANPAGE = IBND / "ibnetdiscover_voltaire-sdr_manpage-example.txt"
OSC_P = IBND / "ibnetdiscover-p_osc-edr-excerpt_infiniband-exporter-test.txt"
IBM = IBND / "ibnetdiscover_single-switch-two-hosts_ibm-doc-example.txt"
CFG = TopologySection()


def downtrain(text: str, link: ibnetdiscover.IbLink, rate: str) -> str:
    """The capture with both port lines of ``link`` showing ``rate`` (a trained-down cable)."""
    out: list[str] = []
    current = ""
    for line in text.splitlines():
        stanza = ibnetdiscover._STANZA.match(line.strip())
        if stanza:
            current = ibnetdiscover.norm_guid(stanza["guid"])
        port = ibnetdiscover._PORT.match(line.strip())
        if port:
            ends = {(current, int(port["port"])),
                    (ibnetdiscover.norm_guid(port["guid"]), int(port["peer_port"]))}
            if ends == {(link.a, link.a_port), (link.b, link.b_port)}:
                line = line.replace("4xNDR", rate)
        out.append(line)
    return "\n".join(out) + "\n"


def isls(disc: ibnetdiscover.Discovery) -> list[ibnetdiscover.IbLink]:
    return sorted((lk for lk in disc.links if disc.nodes[lk.a].kind == "switch"
                   and disc.nodes[lk.b].kind == "switch" and lk.a != lk.b),
                  key=lambda lk: (lk.a, lk.a_port, lk.b, lk.b_port))


def test_rates_are_read_from_both_capture_formats() -> None:
    """``4xNDR`` ends a topology-format port line; ``4x EDR`` sits in a ports-report line."""
    dgx = ibnetdiscover.parse(DGX.read_text())
    assert set(dgx.rates.values()) == {LinkRate(4, "NDR")} and len(dgx.rates) == len(dgx.links)
    osc = ibnetdiscover.parse(OSC_P.read_text())
    assert set(osc.rates.values()) == {LinkRate(4, "EDR")}


def test_a_healthy_fabric_has_no_degraded_link() -> None:
    assert model.from_discovery(ibnetdiscover.parse(DGX.read_text()), CFG).degraded_links == ()


def test_leaf_spine_links_trained_down_are_reported() -> None:
    """In the real NDR fabric, one leaf-spine cable at 4xDDR and one at 2xNDR (half width)
    are reported against their peers' 4xNDR; nothing else is."""
    text = DGX.read_text()
    links = isls(ibnetdiscover.parse(text))
    slow_speed, narrow = links[3], links[40]
    text = downtrain(downtrain(text, slow_speed, "4xDDR"), narrow, "2xNDR")
    fab = model.from_discovery(ibnetdiscover.parse(text), CFG)
    got = {(str(d.link.rate), str(d.expected), d.link.kind) for d in fab.degraded_links}
    assert got == {("4xDDR", "4xNDR", "switch"), ("2xNDR", "4xNDR", "switch")}
    assert fab.warnings[0] == "2 link(s) run below their peers' width or speed"
    assert any(w.startswith("degraded inter-switch link ") and w.endswith(
        ": 4xDDR (peers 4xNDR)") for w in fab.warnings)


def test_the_man_page_1x_links_are_reported() -> None:
    """The ibnetdiscover(8) example has a 1xSDR switch link among 4xSDR ones."""
    fab = model.from_discovery(ibnetdiscover.parse(MANPAGE.read_text()), CFG)
    assert {(d.link.kind, str(d.link.rate)) for d in fab.degraded_links} == {
        ("switch", "1xSDR"), ("host", "1xSDR")}


def test_cli_generate_reports_degraded_links(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`topology generate` prints each degraded link as a warning (and still writes)."""
    text = DGX.read_text()
    capture = tmp_path / "fabric.txt"
    capture.write_text(downtrain(text, isls(ibnetdiscover.parse(text))[0], "4xDDR"))
    (tmp_path / "c.yaml").write_text("{}\n")
    rc = main(["--config", str(tmp_path / "c.yaml"), "topology", "generate",
               "--from-ibnetdiscover", str(capture), "--dry-run"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning" in err and "degraded inter-switch link" in err and "4xDDR" in err


def test_a_lone_link_or_kind_has_no_peers() -> None:
    """One link of a kind is never called degraded: there is nothing to compare it with."""
    lone = RatedLink("sw", 1, "h", 1, "host", LinkRate(1, "SDR"))
    assert degraded([lone]) == []


@pytest.mark.parametrize("host", ["login01", "slurmctld", "head-node", "ctl1", "nfs02",
                                  "dtn3"])
def test_login_controller_and_storage_hosts_are_not_compute(host: str) -> None:
    """A host whose name says login/controller/storage is kept out of the leaves and listed
    with why; a site can clear service_host_patterns."""
    text = IBM.read_text().replace("compute-00-01 HCA-1", f"{host} HCA-1")
    fab = model.from_discovery(ibnetdiscover.parse(text), CFG)
    assert fab.nodes == ["compute-00-00"]
    assert [r.reason for r in fab.storage_hcas] == [
        f"service host {host} (matches service_host_patterns)"]
    open_cfg = TopologySection(service_host_patterns=(), storage_hca_patterns=())
    assert host in model.from_discovery(ibnetdiscover.parse(text), open_cfg).nodes


def test_compute_names_are_not_taken_for_service_hosts() -> None:
    """Names that merely contain the words stay compute: gpu-login-less, a08-p1-dgx-04-c01."""
    for host in ("a08-p1-dgx-04-c01", "node-login", "gpu017", "mdsim05x"):
        text = IBM.read_text().replace("compute-00-01 HCA-1", f"{host} HCA-1")
        assert host in model.from_discovery(ibnetdiscover.parse(text), CFG).nodes
