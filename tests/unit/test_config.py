"""Strict configuration loading."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_resilience import config
from slurm_resilience.config import ByteSize, Config, ConfigError, load_text, to_dict
from slurm_resilience.config.loader import parse_size, walk_keys

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "conf" / "config.example.yaml"


def test_empty_file_gives_defaults() -> None:
    """An empty file is valid and yields every default."""
    assert load_text(Config, "") == Config()


def test_typo_key_names_key_line_and_valid_keys() -> None:
    """A misspelt key fails with the file, line, dotted path and the valid keys."""
    text = "slurm:\n  backend: cli\n  timout_s: 3\n"
    with pytest.raises(ConfigError) as err:
        load_text(Config, text, "site.yaml")
    msg = str(err.value)
    assert msg.startswith("config: site.yaml:3: slurm.timout_s: unknown key")
    assert "did you mean 'timeout_s'" in msg
    assert "valid keys: backend, bin_dir, conf, reason_owners, reason_prefix, timeout_s" in msg


def test_unknown_top_level_section() -> None:
    """An unknown section is rejected with the list of sections."""
    with pytest.raises(ConfigError, match=r"x.yaml:1: slurmm: unknown key .*valid keys: .*slurm"):
        load_text(Config, "slurmm: {}\n", "x.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("slurm:\n  timeout_s: fast\n", r"slurm.timeout_s: expected a number, got 'fast'"),
        ("slurm:\n  timeout_s: 0.1\n", r"slurm.timeout_s: 0.1 is out of range \[0.5, 300\]"),
        ("logging:\n  syslog: 1\n", r"logging.syslog: expected true or false, got 1"),
        ("logging:\n  level: loud\n", r"logging.level: 'loud' is not valid; expected one of"),
        ("slurm: [1, 2]\n", r"slurm: expected a mapping"),
        ("slurm:\n  reason_prefix: ' '\n", r"reason_prefix must not be empty"),
        ("slurm:\n  backend: cli\n  backend: cli\n", r"slurm.backend: key given twice"),
        # The pyslurm backend was removed: an old config naming it must fail, not fall back.
        ("slurm:\n  backend: pyslurm\n", r"slurm.backend: 'pyslurm' is not valid; expected one of"),
        ("slurm: {\n", r"not valid YAML"),
    ],
)
def test_bad_values_are_rejected_with_reason(text: str, expected: str) -> None:
    """Wrong types, ranges, choices, duplicates and broken YAML each get a clear message."""
    with pytest.raises(ConfigError, match=expected):
        load_text(Config, text, "x.yaml")


def test_loaded_config_is_frozen() -> None:
    """Loaded sections cannot be changed by accident."""
    cfg = load_text(Config, "slurm:\n  timeout_s: 3\n")
    assert cfg.slurm.timeout_s == 3.0
    with pytest.raises(AttributeError):
        cfg.slurm.timeout_s = 4  # type: ignore[misc]


def test_sizes_accept_units() -> None:
    """Sizes take plain bytes or binary/decimal units, and reject nonsense with the units."""
    assert parse_size("16GiB") == 16 * 1024**3
    assert parse_size("1.5 GB") == 1_500_000_000
    assert ByteSize(parse_size("4096")) == 4096
    with pytest.raises(ValueError, match="KiB"):
        parse_size("12 parsecs")


def test_named_file_must_exist(tmp_path: Path) -> None:
    """A file named with --config or the environment must exist; the default may be absent."""
    with pytest.raises(ConfigError, match="file not found"):
        config.load(str(tmp_path / "missing.yaml"))


def test_environment_variable_selects_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM_RESILIENCE_CONFIG names the file when --config is not given."""
    f = tmp_path / "c.yaml"
    f.write_text("slurm:\n  timeout_s: 7\n")
    monkeypatch.setenv(config.ENV_VAR, str(f))
    assert config.load().slurm.timeout_s == 7.0


def test_example_is_valid_and_documents_every_key() -> None:
    """conf/config.example.yaml loads, and names every key of the schema."""
    text = EXAMPLE.read_text()
    cfg = load_text(Config, text, str(EXAMPLE))
    assert to_dict(cfg) == to_dict(Config()), "the example must show the defaults"
    for path, _ in walk_keys(Config):
        leaf = path.rsplit(".", 1)[-1]
        assert re.search(rf"^\s*#?\s*{re.escape(leaf)}:", text, re.M), (
            f"{path} is not documented in conf/config.example.yaml"
        )


def test_every_key_has_help() -> None:
    """Every setting carries a help text (it feeds the docs)."""
    for path, f in walk_keys(Config):
        assert f.metadata.get("help"), f"{path} has no help text"


def test_config_check_cli_reports_typo(tmp_path: Path) -> None:
    """`slurm-resilience config check` exits 2 and names the bad key."""
    f = tmp_path / "bad.yaml"
    f.write_text("hooks:\n  prolog_timeout: 5\n")
    out = subprocess.run(
        [sys.executable, "-m", "slurm_resilience", "config", "check", str(f)],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 2
    assert f"{f}:2: hooks.prolog_timeout: unknown key" in out.stderr
    assert "prolog_timeout_s" in out.stderr


def test_config_check_prints_effective_config(tmp_path: Path) -> None:
    """A valid file prints the effective configuration with defaults filled in."""
    f = tmp_path / "ok.yaml"
    f.write_text("slurm:\n  timeout_s: 4\n")
    out = subprocess.run(
        [sys.executable, "-m", "slurm_resilience", "config", "check", str(f)],
        capture_output=True, text=True, check=True,
    )
    assert "timeout_s: 4.0" in out.stdout
    assert "reason_prefix: 'SR:'" in out.stdout


def test_config_check_hides_secrets(tmp_path: Path) -> None:
    """Secret-looking values are printed as *** by config check."""
    from slurm_resilience.log import redact

    shown = redact({"s3": {"secret_access_key": "hunter2", "endpoint": "http://x"}})
    assert shown == {"s3": {"secret_access_key": "***", "endpoint": "http://x"}}


def test_hook_budgets_are_cross_checked_and_name_the_keys() -> None:
    """An epilog wait longer than the epilog's limit is refused at load, naming both keys."""
    with pytest.raises(ConfigError) as err:
        load_text(Config, "checkpoint:\n  enabled: true\n  epilog_wait_s: 3600\n")
    msg = str(err.value)
    assert "hooks.epilog_timeout_s=60 is shorter than" in msg
    assert "checkpoint.epilog_wait_s=3600" in msg and "health.collector_timeout_s=5" in msg
    assert "node.job_tmpfs (umount)=1" in msg  # unmounting the job's run-dir tmpfs
    assert "raise hooks.epilog_timeout_s to at least 3621.5" in msg


def test_prolog_budget_counts_the_nccl_handoff_and_the_agent() -> None:
    """The NCCL hand-off, the agent call and the collectors must fit in the prolog's limit."""
    text = ("checkpoint:\n  enabled: true\nnccl:\n  enabled: true\n  handoff_timeout_s: 15\n")
    with pytest.raises(ConfigError, match=r"hooks.prolog_timeout_s=20 is shorter than the "
                                          r"waits it must hold: health.collector_timeout_s=5 "
                                          r"\+ node.job_tmpfs \(mount, umount\)=2 \+ "
                                          r"agent.request_timeout_s=5 \+ "
                                          r"nccl.handoff_timeout_s=15"):
        load_text(Config, text)
    assert load_text(Config, text + "hooks:\n  prolog_timeout_s: 30\n").hooks.prolog_timeout_s \
        == 30


def test_defaults_fit_every_hook_budget() -> None:
    """The shipped defaults, with every capability on, fit their hooks' limits."""
    from slurm_resilience.config.budgets import conflicts

    cfg = load_text(Config, "checkpoint:\n  enabled: true\nnccl:\n  enabled: true\n")
    assert conflicts(cfg) == []


def test_every_process_finds_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """Hooks (their env), the CLI and the agent (their own env) use one lookup:
    the variable, then the file beside the slurm.conf in use, then /etc."""
    (tmp_path / "slurm.conf").write_text("")
    beside = tmp_path / "slurm-resilience.yaml"
    beside.write_text("")
    env = {"SLURM_CONF": str(tmp_path / "slurm.conf")}
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    assert config.locate(None, env) == (str(beside), True)
    assert config.job_config_path(env) == str(beside)
    assert config.resolve_path() == (str(beside), True)  # the CLI, the agent
    named = {config.ENV_VAR: "/x.yaml", **env}
    assert config.locate(None, named) == ("/x.yaml", True)
    beside.unlink()
    assert config.locate(None, env) == (config.DEFAULT_PATH, False)


def test_reload_reads_the_file_the_agent_was_started_with(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """After the agent names its --config, every later lookup (live reload) returns it."""
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    mine = tmp_path / "agent.yaml"
    mine.write_text("slurm:\n  timeout_s: 9\n")
    config.use_path(str(mine))
    try:
        assert config.resolve_path() == (str(mine), True)
        assert config.load().slurm.timeout_s == 9.0
    finally:
        config.use_path(None)
    assert config.resolve_path()[0] != str(mine)


def test_hooks_and_agent_agree_on_the_node_name() -> None:
    """node.name in the config wins over SLURMD_NODENAME in hooks too, as in the agent
    (which has no SLURMD_NODENAME), so {node} paths are the same in both."""
    from slurm_resilience.config.paths import node_name
    from slurm_resilience.hooks.context import HookContext

    cfg = load_text(Config, "node:\n  name: n7\n")
    hook = HookContext.from_env("prolog", cfg, {"SLURMD_NODENAME": "node2"})
    assert hook.node == node_name(cfg.node.name, {}) == "n7"
    assert HookContext.from_env("prolog", Config(), {"SLURMD_NODENAME": "node2"}).node == "node2"


def test_job_files_are_not_on_the_system_tmpfs_by_default() -> None:
    """No default puts a job-writable directory under /run (munge, systemd, pid files)."""
    cfg = Config()
    assert not cfg.node.run_dir.startswith("/run/")
    assert not cfg.checkpoint.staging_root.startswith("/run/")
