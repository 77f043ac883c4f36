"""Golden files: generated topology.conf, leaf features and Lua data stay byte-identical.

A deliberate change of the outputs is accepted by regenerating the files:
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_topology_golden.py
and reviewing the diff under tests/golden/topology/.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config import load_text
from slurm_resilience.config.schema import Config
from slurm_resilience.config.topology import TopologySection
from slurm_resilience.topology import generate, ibnetdiscover, model, validate
from slurm_resilience.topology.slurmconf import parse_slurm_conf

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "topology"
INPUTS = GOLDEN / "inputs"
IBND = REAL_FIXTURES / "ibnetdiscover"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
HOW = ("generated output differs from the golden file {path}; if the change is intended, "
       "regenerate with: UPDATE_GOLDEN=1 .venv/bin/python -m pytest "
       "tests/unit/test_topology_golden.py (and review the diff)")

CAPTURES = {
    "dgx-h100-superpod": "ibnetdiscover_nvidia-dgx-h100-superpod-ndr_topograph-example_TRIMMED.txt",
    "switchib-sx6012-mixed": "ibnetdiscover_switchib-edr-plus-sx6012-fdr_mixed-speeds_"
                             "nvidia-kb-example.txt",
    "osc-edr-ports": "ibnetdiscover-p_osc-edr-excerpt_infiniband-exporter-test.txt",
}


def _compare(case: str, outputs: generate.Outputs) -> None:
    folder = GOLDEN / case
    for name, text in outputs.files.items():
        path = folder / name
        if UPDATE:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            continue
        assert path.exists(), HOW.format(path=path)
        assert path.read_text() == text, HOW.format(path=path)


@pytest.mark.parametrize("case", sorted(CAPTURES))
def test_golden_from_ibnetdiscover(case: str) -> None:
    """Outputs generated from a real capture match the golden files."""
    capture = IBND / CAPTURES[case]
    if not capture.exists():
        pytest.skip(f"capture missing: {capture}")
    cfg = TopologySection()
    fabric = model.from_discovery(ibnetdiscover.parse(capture.read_text()), cfg,
                                  source=capture.name)
    assert not any(f.error for f in validate.check_fabric(fabric))
    _compare(case, generate.render(fabric, cfg))


def test_golden_from_topology_conf_with_slurm_conf() -> None:
    """Feature-mode outputs from a topology.conf plus slurm.conf (partitions) match the goldens."""
    cfg = load_text(Config, (INPUTS / "sandbox-3x3.config.yaml").read_text()).topology
    slurm = parse_slurm_conf(str(INPUTS / "sandbox-3x3.slurm.conf"))
    lines = validate.parse_topology_conf((INPUTS / "sandbox-3x3.topology.conf").read_text())
    assert not any(f.error for f in validate.check_lines(lines, slurm.nodes))
    fabric = model.from_switch_lines(lines, source="sandbox-3x3.topology.conf")
    _compare("sandbox-3x3-feature", generate.render(fabric, cfg, slurm))
