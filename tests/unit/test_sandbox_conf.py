"""Pure parts of the sandbox: layout, slurm.conf and topology.conf generation, hooks' config."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_resilience import config
from slurm_resilience.sandbox import control, daemons, resilience_conf, slurmconf
from slurm_resilience.sandbox.layout import Layout


def conf_keys(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and not line.startswith(("NodeName=", "Partition")):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_layout_splits_nodes_evenly_across_leaves() -> None:
    """Five nodes over two leaves: consecutive nodes share a leaf, 3 + 2."""
    layout = Layout(state_dir=Path("/tmp/x"), nodes=5, leaves=2, port_base=20000)
    assert layout.leaf_of() == {"node1": "leaf01", "node2": "leaf01", "node3": "leaf01",
                                "node4": "leaf02", "node5": "leaf02"}
    assert layout.s3_port == 20099 and layout.slurmd_port(5) == 20005


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"nodes": 0}, "nodes=0"), ({"nodes": 2, "leaves": 3}, "leaves=3"),
    ({"port_base": 80}, "port_base=80"),
])
def test_layout_rejects_bad_shapes(kwargs: dict[str, int], message: str) -> None:
    """Impossible layouts fail with the offending value named."""
    with pytest.raises(ValueError, match=message):
        Layout(state_dir=Path("/tmp/x"), **kwargs)


def test_slurm_conf_wires_hooks_munge_and_ports() -> None:
    """slurm.conf points at the checkout's hooks, our munge socket and the layout's ports."""
    layout = Layout(state_dir=Path("/tmp/sb"), nodes=4, leaves=2, port_base=21000,
                    repo=Path("/src/repo"))
    text = slurmconf.slurm_conf(layout, job_submit_lua=False)
    keys = conf_keys(text)
    assert keys["Prolog"] == "/src/repo/hooks/prolog"
    assert keys["Epilog"] == "/src/repo/hooks/epilog"
    assert keys["HealthCheckProgram"] == "/tmp/sb/etc/healthcheck"
    wrapper = slurmconf.healthcheck_wrapper(layout)
    assert "SLURM_CONF=/tmp/sb/etc/slurm.conf\n" in wrapper
    assert wrapper.endswith('exec /src/repo/hooks/healthcheck "$@"\n')
    assert keys["AuthInfo"] == "socket=/tmp/sb/munge/munge.socket.2,cred_expire=10"
    assert keys["SchedulerParameters"].split(",")[0] == "nohold_on_prolog_fail"
    assert keys["PrologFlags"] == "Alloc"
    assert keys["SlurmctldPort"] == "21000"
    assert keys["SlurmdSpoolDir"] == "/tmp/sb/spool/%n"
    assert keys["TopologyPlugin"] == "topology/tree"
    assert "JobSubmitPlugins" not in keys
    assert ("NodeName=node4 NodeHostname=localhost NodeAddr=127.0.0.1 Port=21004 CPUs=2 "
            "RealMemory=2048 Features=leaf02 State=UNKNOWN") in text
    assert "JobSubmitPlugins=lua" in slurmconf.slurm_conf(layout, job_submit_lua=True)


def test_slurm_conf_overrides_replace_add_and_drop_keys() -> None:
    """Overrides replace a key in place, append a new one, and an empty value drops a key."""
    layout = Layout(state_dir=Path("/tmp/sb"), nodes=1, leaves=1, slurm_overrides=(
        ("Prolog", "/tmp/fail.sh"), ("DebugFlags", "Route"), ("Epilog", "")))
    keys = conf_keys(slurmconf.slurm_conf(layout, job_submit_lua=False))
    assert keys["Prolog"] == "/tmp/fail.sh"
    assert keys["DebugFlags"] == "Route"
    assert "Epilog" not in keys


def test_topology_conf_has_leaves_under_one_spine() -> None:
    """Each leaf lists its nodes and the spine lists every leaf."""
    layout = Layout(state_dir=Path("/tmp/sb"), nodes=4, leaves=2)
    assert slurmconf.topology_conf(layout).splitlines()[1:] == [
        "SwitchName=leaf01 Nodes=node1,node2",
        "SwitchName=leaf02 Nodes=node3,node4",
        "SwitchName=spine01 Switches=leaf01,leaf02",
    ]


def test_resilience_conf_loads_with_the_strict_loader(tmp_path: Path) -> None:
    """The generated hooks' config passes the strict loader with per-node paths templated."""
    layout = Layout(state_dir=tmp_path, nodes=2, leaves=1)
    tmp_path.joinpath("etc").mkdir()
    control.write_resilience_conf(layout, resilience_conf.sections(layout))
    cfg = config.load(str(layout.resilience_conf))
    assert cfg.node.state_dir == f"{tmp_path}/nodes/{{node}}/state"
    assert cfg.logging.syslog is False
    assert cfg.slurm.conf == str(layout.slurm_conf)


def test_write_resilience_conf_rejects_unknown_keys(tmp_path: Path) -> None:
    """A bad section is refused and the previous file is kept."""
    layout = Layout(state_dir=tmp_path, nodes=1, leaves=1)
    tmp_path.joinpath("etc").mkdir()
    control.write_resilience_conf(layout, resilience_conf.sections(layout))
    before = layout.resilience_conf.read_text()
    with pytest.raises(config.ConfigError, match="no_such_key"):
        control.write_resilience_conf(layout, {"node": {"no_such_key": 1}})
    assert layout.resilience_conf.read_text() == before


def test_layout_round_trips_through_the_state_dir(tmp_path: Path) -> None:
    """down/status/env find the layout that up saved."""
    layout = Layout(state_dir=tmp_path, nodes=3, leaves=2, port_base=23000,
                    slurm_overrides=(("Prolog", "/x"),))
    control.save_layout(layout)
    assert control.load_layout(tmp_path) == layout


def test_load_layout_without_sandbox_says_what_to_do(tmp_path: Path) -> None:
    """A state dir without a sandbox gives a message naming the missing file and `up`."""
    with pytest.raises(control.SandboxError, match="sandbox up"):
        control.load_layout(tmp_path)


def test_pid_file_of_a_foreign_process_is_not_ours(tmp_path: Path) -> None:
    """A pid file naming a process that is not our daemon (here: pytest itself) is ignored."""
    import os

    pid_file = tmp_path / "slurmd-node1.pid"
    pid_file.write_text(f"{os.getpid()}\n")
    d = daemons.Daemon("slurmd-node1", "slurmd", pid_file, str(tmp_path))
    assert d.pid() is None
    assert daemons.stop(d) is False
    assert not pid_file.exists()


def test_update_resilience_config_merges_into_the_defaults(tmp_path: Path) -> None:
    """A section update keeps the other defaults, None removes a key, and calls don't pile up."""
    from slurm_resilience.sandbox.handle import Sandbox

    layout = Layout(state_dir=tmp_path, nodes=1, leaves=1)
    control.write_files(layout)
    box = Sandbox(layout)
    box.update_resilience_config({"logging": {"level": "debug", "syslog": None}})
    cfg = config.load(str(layout.resilience_conf))
    assert cfg.logging.level == "debug"
    assert cfg.logging.file == f"{tmp_path}/log/slurm-resilience.jsonl"
    assert cfg.logging.syslog is True  # removed: back to the schema default
    box.update_resilience_config({"node": {"run_dir": "/tmp/r/{node}"}})
    cfg = config.load(str(layout.resilience_conf))
    assert cfg.logging.level == "info" and cfg.node.run_dir == "/tmp/r/{node}"


def test_write_files_creates_the_tree_with_private_secrets(tmp_path: Path) -> None:
    """up's files: per-node NVMe dirs, a 0400 munge key, 0600 S3 keys and env lines naming them."""
    layout = Layout(state_dir=tmp_path / "sb", nodes=2, leaves=1, port_base=24000)
    control.write_files(layout)
    assert (layout.node_dir("node2") / "nvme").is_dir()
    assert (layout.state_dir / "s3" / "ckpt").is_dir()
    assert layout.munge_key.stat().st_mode & 0o777 == 0o400
    assert layout.s3_keys_file.stat().st_mode & 0o777 == 0o600
    assert layout.state_dir.stat().st_mode & 0o777 == 0o755
    s3 = control.s3_info(layout)
    lines = control.env_lines(layout)
    assert f"export AWS_SECRET_ACCESS_KEY={s3.secret_key}" in lines
    assert "export AWS_ENDPOINT_URL=http://127.0.0.1:24099" in lines


def test_unreachable_ancestor_names_the_closed_directory() -> None:
    """A 0700 directory on the way to the state dir is named; an open path gives None."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="sr-unit-", dir="/tmp"))  # pytest's tmp root is 0700
    try:
        top.chmod(0o755)
        closed = top / "closed"
        (closed / "repo").mkdir(parents=True)
        closed.chmod(0o700)
        assert control.unreachable_ancestor(closed / "repo") == closed
        closed.chmod(0o711)
        assert control.unreachable_ancestor(closed / "repo") is None
    finally:
        shutil.rmtree(top)
