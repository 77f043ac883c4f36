"""The epilog's notion of "during the job" never misses an Xid raised after the job started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_resilience import config
from slurm_resilience.fakes import kmsg
from slurm_resilience.health import gate, steps
from slurm_resilience.health.gate import StateStore, state_dir
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.sandbox import hardware
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeRunner

NODE = "node1"


@pytest.fixture
def cfg_path(tmp_path: Path) -> Path:
    hardware.prepare_node_hardware(tmp_path, [NODE])
    root = f"{tmp_path}/nodes/{{node}}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "node": {"state_dir": f"{root}/state"},
        "logging": {"file": f"{tmp_path}/log.jsonl", "syslog": False},
        "health": {
            "backend": "fake", "scenario_dir": f"{tmp_path}/scenarios",
            "gpu": {"expected_count": 8},
            "xid": {"source": "file", "path": f"{root}/kmsg", "boot_id_file": f"{root}/boot_id"},
            "infiniband": {"sysfs_root": f"{root}/sys/class/infiniband"},
            "nvme": {"path": f"{root}/nvme", "size_limit": 100 << 30, "min_free": 1 << 30,
                     "smart": False}}}))
    return path


def ctx(cfg_path: Path, kind: str) -> HookContext:
    return HookContext(kind=kind, cfg=config.load(str(cfg_path)), node=NODE,  # type: ignore[arg-type]
                       env={}, job_id=42, _adapter=SlurmAdapter(runner=FakeRunner()))


@pytest.fixture
def reports(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every gate report the steps produce."""
    out: list[Any] = []
    real = gate.run

    def run(*args: Any, **kwargs: Any) -> Any:
        out.append(real(*args, **kwargs))
        return out[-1]

    monkeypatch.setattr(gate, "run", run)
    return out


def xid_43(cfg_path: Path, when: float | None = None) -> None:
    hw = hardware.locate(cfg_path.parent, NODE)
    bus = json.loads(hw.scenario.read_text())["gpus"][2]["pci_bus_id"]
    kmsg.append_xid(str(hw.kmsg), bus, 43, when=when)


def during_the_job(report: Any) -> list[str]:
    return [f.message for f in report.findings if "during the job" in f.message]


def test_an_xid_stamped_just_before_the_recorded_start_counts(cfg_path: Path,
                                                             reports: list[Any]) -> None:
    """The prolog's record is its own start; an Xid whose kernel stamp reads a moment
    earlier (boot-relative stamps, clocks adjusted meanwhile) is still the job's."""
    assert steps.prolog(ctx(cfg_path, "prolog")) == []
    c = ctx(cfg_path, "epilog")
    recorded = float(StateStore(state_dir(c.cfg, NODE)).load("jobs")["42"])
    xid_43(cfg_path, when=recorded - 0.5)
    assert steps.epilog(c) == []  # not fatal: reported, no drain
    assert during_the_job(reports[-1]), [f.message for f in reports[-1].findings]


def test_without_a_record_of_the_start_every_xid_counts(cfg_path: Path,
                                                       reports: list[Any]) -> None:
    """Was: no record (prolog's bookkeeping failed, state lost) made the epilog call
    the job's Xid "(not fatal)" from before the job."""
    xid_43(cfg_path)
    assert steps.epilog(ctx(cfg_path, "epilog")) == []
    assert during_the_job(reports[-1]), [f.message for f in reports[-1].findings]


def test_an_xid_well_before_the_job_is_not_the_jobs(cfg_path: Path,
                                                    reports: list[Any]) -> None:
    assert steps.prolog(ctx(cfg_path, "prolog")) == []
    c = ctx(cfg_path, "epilog")
    recorded = float(StateStore(state_dir(c.cfg, NODE)).load("jobs")["42"])
    xid_43(cfg_path, when=recorded - 60)
    assert steps.epilog(c) == []
    assert during_the_job(reports[-1]) == []
