"""A configuration file that stops loading never switches the gate off: the last good
copy (or the built-in defaults) runs instead, and the metric and ``status`` say so."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from slurm_resilience.config import Config, lastgood
from slurm_resilience.hang import status as st
from slurm_resilience.metrics.configstate import NAME, ConfigWatch

GOOD = "hooks:\n  prolog_timeout_s: 7\n"
TYPO = GOOD + "  prolog_timout_s: 3\n"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private directory for last good copies instead of the host's."""
    monkeypatch.setattr(lastgood, "STORE_DIR", str(tmp_path / "last-good"))
    return tmp_path / "last-good"


def test_a_file_that_loads_is_kept_root_only_and_used_after_a_typo(
        tmp_path: Path, store: Path) -> None:
    """The copy is saved 0600 in a 0700 directory; after a typo the loaded settings are the
    copy's, and the error names the file, the line and the key with a suggestion."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(GOOD)
    first = lastgood.load(str(cfg))
    assert first.valid and first.problem() == "" and first.cfg.hooks.prolog_timeout_s == 7
    copy = Path(lastgood.copy_path(str(cfg)))
    assert copy.read_text() == GOOD
    assert copy.stat().st_mode & 0o777 == 0o600 and store.stat().st_mode & 0o777 == 0o700
    cfg.write_text(TYPO)
    broken = lastgood.load(str(cfg))
    assert not broken.valid and broken.cfg.hooks.prolog_timeout_s == 7
    assert broken.gating_with == str(copy)
    assert broken.fields() == {"file": str(cfg), "line": 3, "key": "hooks.prolog_timout_s",
                               "why": broken.error.message if broken.error else "",
                               "gating_with": str(copy)}
    assert "did you mean 'prolog_timeout_s'?" in broken.problem()
    assert copy.read_text() == GOOD  # a broken file never replaces the copy


def test_no_copy_means_the_built_in_defaults(tmp_path: Path, store: Path) -> None:
    """A file that never loaded here: the built-in defaults, said as such."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TYPO)
    loaded = lastgood.load(str(cfg))
    assert not loaded.valid and loaded.cfg == Config()
    assert loaded.problem().endswith("; gating with built-in defaults")


def test_a_missing_named_file_falls_back_too(tmp_path: Path, store: Path) -> None:
    """A named file deleted after it loaded is an error, with the copy still gating."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(GOOD)
    lastgood.load(str(cfg))
    cfg.unlink()
    loaded = lastgood.load(str(cfg))
    assert not loaded.valid and "file not found" in loaded.problem()
    assert loaded.cfg.hooks.prolog_timeout_s == 7


@pytest.mark.parametrize("plant", ["symlink", "group-writable"])
def test_a_planted_copy_is_ignored(tmp_path: Path, store: Path, plant: str) -> None:
    """A copy that is a link, or that others may write, is never trusted."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(GOOD)
    lastgood.load(str(cfg))
    copy = Path(lastgood.copy_path(str(cfg)))
    if plant == "symlink":
        other = tmp_path / "other.yaml"
        other.write_text(GOOD)
        copy.unlink()
        copy.symlink_to(other)
    else:
        os.chmod(copy, 0o660)
    cfg.write_text(TYPO)
    assert lastgood.load(str(cfg)).gating_with == lastgood.BUILT_IN


def test_config_valid_metric_follows_the_file(tmp_path: Path, store: Path) -> None:
    """slurm_resilience_config_valid is 1, then 0 after a typo, then 1 once fixed."""
    cfg = tmp_path / "c.yaml"
    watch = ConfigWatch(str(cfg))

    class Source(Collector):
        def collect(self) -> Iterator[Metric]:
            return watch.metrics()

    registry = CollectorRegistry()
    registry.register(Source())
    values = []
    for text in (GOOD, TYPO + "\n", GOOD + "\n"):
        cfg.write_text(text)
        out = generate_latest(registry).decode()
        values.append(next(line for line in out.splitlines() if line.startswith(NAME)))
    assert values == [f"{NAME} 1.0", f"{NAME} 0.0", f"{NAME} 1.0"]


def test_status_says_the_config_is_invalid_and_what_gates() -> None:
    """`status` leads with the broken file's error and the copy that gates instead."""
    doc: st.StatusDoc = {"mode": "observe", "config": {
        "file": "/etc/c.yaml", "valid": False,
        "error": "config: /etc/c.yaml:3: hooks.x: unknown key",
        "gating_with": "/var/lib/slurm-resilience/last-good-config/ab.yaml"}}
    first = st.render(doc).splitlines()[0]
    assert first.startswith("config: INVALID: config: /etc/c.yaml:3: hooks.x: unknown key; "
                            "gating with /var/lib/slurm-resilience/last-good-config/ab.yaml")
    doc["config"] = {"file": "/etc/c.yaml", "valid": True, "error": "", "gating_with": ""}
    assert st.render(doc).splitlines()[0] == "config: /etc/c.yaml: valid"
