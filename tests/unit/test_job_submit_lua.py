"""hooks/job_submit.lua run in Lua 5.1 (lupa.lua51, the version Debian's slurmctld links)
with a stand-in ``slurm`` table and a generated data file beside the script."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slurm_resilience.config.topology import TopologySection
from slurm_resilience.topology import generate, model, validate
from slurm_resilience.topology.slurmconf import SlurmNodes

lupa = pytest.importorskip("lupa.lua51")

SCRIPT = Path(__file__).resolve().parents[2] / "hooks" / "job_submit.lua"
NO_VAL = 4294967294
# Leaves of 4, 3 and 2 nodes.
TOPOLOGY = ("SwitchName=big Nodes=n[1-4]\nSwitchName=mid Nodes=n[5-7]\n"
            "SwitchName=small Nodes=n[8-9]\nSwitchName=top Switches=big,mid,small\n")

STUB = """
slurm = { SUCCESS = 0, ERROR = -1, logs = {} }
function slurm.log_info(fmt, ...)
  table.insert(slurm.logs, "info: " .. string.format(fmt, ...))
end
function slurm.log_error(fmt, ...)
  table.insert(slurm.logs, "error: " .. string.format(fmt, ...))
end
"""


class Plugin:
    """One loaded job_submit.lua, as slurmctld would hold it."""

    def __init__(self, directory: Path):
        self.lua = lupa.LuaRuntime(unpack_returned_tuples=True)
        assert self.lua.eval("_VERSION") == "Lua 5.1"
        self.lua.execute(STUB)
        self.load_rc = self.lua.eval(f"dofile({str(directory / 'job_submit.lua')!r})")

    @property
    def logs(self) -> list[str]:
        return list(self.lua.globals().slurm.logs.values())

    def submit(self, **fields: Any) -> dict[str, Any]:
        """Submit a job described by ``fields`` (None/absent = not set); returns the job after."""
        job = self.lua.table()
        for key, value in fields.items():
            if isinstance(value, dict):
                value = self.lua.table_from(value)
            job[key] = value
        rc = self.lua.globals().slurm_job_submit(job, self.lua.table(), 1000)
        assert rc == 0, "job_submit must always return slurm.SUCCESS"
        return {k: job[k] for k in ("features", "req_switch", "wait4switch")}


def install(tmp_path: Path, cfg: TopologySection, slurm: SlurmNodes | None = None,
            data: str | None = None) -> Plugin:
    shutil.copy(SCRIPT, tmp_path / "job_submit.lua")
    fabric = model.from_switch_lines(validate.parse_topology_conf(TOPOLOGY))
    text = generate.lua_data(fabric, cfg, slurm) if data is None else data
    (tmp_path / generate.DATA_FILE).write_text(text)
    return Plugin(tmp_path)


@pytest.fixture
def tree(tmp_path: Path) -> Plugin:
    return install(tmp_path, TopologySection(mode="tree", wait4switch_s=120,
                                             opt_out_partitions=("debug",)))


@pytest.fixture
def feature(tmp_path: Path) -> Plugin:
    return install(tmp_path, TopologySection(mode="feature"))


def test_loads_data_once_and_logs_it(tree: Plugin) -> None:
    """Loading the plugin reads the data file beside it and logs the leaf count."""
    assert tree.load_rc == 0
    assert tree.logs == ["info: slurm-resilience leaf-pin: loaded 3 leaves (largest 4 nodes), "
                         "mode tree"]


def test_tree_mode_pins_fitting_job_to_one_leaf(tree: Plugin) -> None:
    """A 3-node job gets req_switch=1 and wait4switch from the data, logged in one line."""
    job = tree.submit(min_nodes=3, req_switch=NO_VAL, wait4switch=NO_VAL, name="train")
    assert job["req_switch"] == 1 and job["wait4switch"] == 120
    assert tree.logs[-1] == ('info: slurm-resilience leaf-pin: job "train" uid=1000 nodes=3 '
                             'partition="nil": switches=1@120s')


def test_what_a_user_typed_is_escaped_in_the_log_line(tree: Plugin) -> None:
    """A newline or a quote in a job name or partition can't split slurmctld's log line or
    forge a field; long values are cut."""
    name = 'x" uid=0\nslurmctld: error: fake\r\x1b[2J'
    tree.submit(min_nodes=3, name=name, partition="debug,gpu\nforged line")
    line = tree.logs[-1]
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line == ('info: slurm-resilience leaf-pin: job "x\\x22 uid=0\\x0aslurmctld: error: '
                    'fake\\x0d\\x1b[2J" uid=1000 nodes=3 partition="debug,gpu\\x0aforged line": '
                    'left alone: partition debug opted out')
    tree.submit(min_nodes=3, name="n" * 5000)
    assert tree.logs[-1].startswith('info: slurm-resilience leaf-pin: job "' + "n" * 200
                                    + '...[4800 more]" uid=1000')


def test_tree_mode_large_job_gets_minimal_leaves(tree: Plugin) -> None:
    """A 6-node job (largest leaf 4) asks for 2 leaves; one larger than the fabric is left alone."""
    assert tree.submit(min_nodes=6)["req_switch"] == 2
    assert tree.submit(min_nodes=8)["req_switch"] == 3
    assert tree.submit(min_nodes=10)["req_switch"] is None
    assert tree.logs[-1].endswith("left alone: larger than the fabric")


def test_large_jobs_leave(tmp_path: Path) -> None:
    """With large_jobs=leave a job larger than every leaf is not touched."""
    plugin = install(tmp_path, TopologySection(large_jobs="leave"))
    assert plugin.submit(min_nodes=5)["req_switch"] is None
    assert "larger than any leaf (4 nodes)" in plugin.logs[-1]


def test_single_node_and_unset_node_count_are_silent(tree: Plugin) -> None:
    """One node, or no node count (NO_VAL), is left alone without a log line."""
    before = len(tree.logs)
    assert tree.submit(min_nodes=1)["req_switch"] is None
    assert tree.submit(min_nodes=NO_VAL)["req_switch"] is None
    assert tree.submit()["req_switch"] is None
    assert len(tree.logs) == before


def test_user_switches_are_respected(tree: Plugin) -> None:
    """A job that passed --switches itself keeps its own value."""
    job = tree.submit(min_nodes=2, req_switch=2, wait4switch=60)
    assert (job["req_switch"], job["wait4switch"]) == (2, 60)
    assert tree.logs[-1].endswith("left alone: job asked for --switches itself")


def test_job_naming_its_nodes_is_left_alone(tree: Plugin) -> None:
    """A job with -w (req_nodes) is not pinned."""
    assert tree.submit(min_nodes=2, req_nodes="n[1,5]")["req_switch"] is None


@pytest.mark.parametrize(("fields", "why"), [
    ({"partition": "debug"}, "partition debug opted out"),
    ({"partition": "batch,debug"}, "partition debug opted out"),
    ({"script": "#!/bin/sh", "environment": {"SLURM_RESILIENCE_LEAF_PIN": "off"}},
     "environment SLURM_RESILIENCE_LEAF_PIN=off"),
    ({"spank_job_env": {0: "SLURM_RESILIENCE_LEAF_PIN=off"}}, "SPANK SLURM_RESILIENCE_LEAF_PIN"),
    ({"spank_job_env": {0: "A=1", 1: "SPANK_SLURM_RESILIENCE_LEAF_PIN=OFF"}}, "SPANK SPANK_"),
    ({"comment": "run 7 leaf-pin=off"}, "comment leaf-pin=off"),
])
def test_opt_outs(tree: Plugin, fields: dict[str, Any], why: str) -> None:
    """Each opt-out (partition, batch env, SPANK env, comment) leaves the job alone and says why."""
    assert tree.submit(min_nodes=2, **fields)["req_switch"] is None
    assert why in tree.logs[-1]


def test_opt_out_values_that_do_not_opt_out(tree: Plugin) -> None:
    """leaf-pin=on, another variable, or env without a batch script still pins."""
    assert tree.submit(min_nodes=2, spank_job_env={0: "SLURM_RESILIENCE_LEAF_PIN=on"}
                       )["req_switch"] == 1
    assert tree.submit(min_nodes=2, environment={"SLURM_RESILIENCE_LEAF_PIN": "off"}
                       )["req_switch"] == 1  # no script: interactive job, env not consulted
    assert tree.submit(min_nodes=2, partition="batch")["req_switch"] == 1


@pytest.mark.parametrize(("own", "nodes", "expected"), [
    (None, 2, "[leaf_big|leaf_mid|leaf_small]"),
    ("", 3, "[leaf_big|leaf_mid]"),
    ("gpu", 4, "gpu&[leaf_big]"),
    ("gpu&ib", 3, "gpu&ib&[leaf_big|leaf_mid]"),
    ("a100|h100", 2, "(a100|h100)&[leaf_big|leaf_mid|leaf_small]"),
])
def test_feature_mode_constraint(feature: Plugin, own: str | None, nodes: int, expected: str
                                 ) -> None:
    """Feature mode ANDs the leaves big enough for the job, largest first, with the user's own."""
    assert feature.submit(min_nodes=nodes, features=own)["features"] == expected


@pytest.mark.parametrize("own", ["[rack1|rack2]", "gpu&[a|b]", "big*2"])
def test_feature_mode_never_stacks_brackets(feature: Plugin, own: str) -> None:
    """A constraint with brackets or counts is left as it is, and the log says so."""
    assert feature.submit(min_nodes=2, features=own)["features"] == own
    assert "already has brackets or counts" in feature.logs[-1]


def test_feature_mode_large_job_left_alone(feature: Plugin) -> None:
    """Feature mode cannot express several leaves: a job larger than any leaf is untouched."""
    assert feature.submit(min_nodes=5, features="gpu")["features"] == "gpu"


def test_feature_mode_caps_the_alternatives(tmp_path: Path) -> None:
    """max_feature_leaves bounds the matching-OR list to the largest leaves."""
    plugin = install(tmp_path, TopologySection(mode="feature", max_feature_leaves=2))
    assert plugin.submit(min_nodes=2)["features"] == "[leaf_big|leaf_mid]"


def test_partition_leaf_sizes(tmp_path: Path) -> None:
    """With slurm.conf partitions, leaves are sized within the job's (or default) partition."""
    slurm = SlurmNodes(partitions={"p": ["n1", "n2", "n5", "n6", "n7", "n8"], "q": ["n9"]},
                       default_partition="p")
    plugin = install(tmp_path, TopologySection(mode="feature"), slurm)
    assert plugin.submit(min_nodes=3)["features"] == "[leaf_mid]"
    assert plugin.submit(min_nodes=2, partition="p")["features"] == "[leaf_mid|leaf_big]"
    assert plugin.submit(min_nodes=2, partition="q")["features"] is None


def test_mode_off(tmp_path: Path) -> None:
    """mode off leaves every job alone."""
    plugin = install(tmp_path, TopologySection(mode="off"))
    assert plugin.submit(min_nodes=2)["req_switch"] is None


@pytest.mark.parametrize("data", ["return 42\n", "this is not lua", "return { format = 2 }\n",
                                  "os.execute('touch /tmp/pwned') return {}\n"])
def test_bad_or_hostile_data_file_accepts_jobs_unchanged(tmp_path: Path, data: str) -> None:
    """A broken data file logs one error at load; jobs are accepted unchanged, nothing runs."""
    plugin = install(tmp_path, TopologySection(), data=data)
    assert plugin.load_rc == 0
    assert plugin.logs[0].startswith("error: slurm-resilience leaf-pin: couldn't load")
    assert plugin.submit(min_nodes=2)["req_switch"] is None
    assert "no topology data" in plugin.logs[-1]


def test_missing_data_file(tmp_path: Path) -> None:
    """Without a data file the plugin still loads and accepts every job."""
    shutil.copy(SCRIPT, tmp_path / "job_submit.lua")
    plugin = Plugin(tmp_path)
    assert plugin.submit(min_nodes=2)["req_switch"] is None


def test_internal_error_never_blocks_submission(tree: Plugin) -> None:
    """A job field of an unexpected type makes the logic fail: logged, job accepted."""
    job = tree.submit(min_nodes="two")
    assert job["req_switch"] is None
    assert tree.logs[-1].startswith("error: slurm-resilience leaf-pin: internal error")


def test_script_runs_under_the_debian_lua51_interpreter(tmp_path: Path) -> None:
    """The real lua5.1 binary loads the script and pins a job (same language as slurmctld)."""
    lua51 = shutil.which("lua5.1")
    if lua51 is None:
        pytest.skip("lua5.1 not installed")
    install(tmp_path, TopologySection())
    driver = tmp_path / "driver.lua"
    driver.write_text(STUB + f"dofile({str(tmp_path / 'job_submit.lua')!r})\n"
                      "local job = { min_nodes = 3 }\n"
                      "assert(slurm_job_submit(job, {}, 0) == 0)\n"
                      "print(job.req_switch, job.wait4switch)\n")
    out = subprocess.run([lua51, str(driver)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "300"]
