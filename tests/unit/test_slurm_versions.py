"""The adapter's parsers against what each Slurm version really prints.

The captures in tests/fixtures/slurm/<version>/ were recorded by .ci/capture-slurm-outputs
on 22.05 (bookworm), 24.11 (trixie) and 26.05 (sid): a job whose name, comment and
command line carry forged ``Key=value`` text, a pending exclusive job asking for one
switch, and a drained node. 23.02-schema/ is built from the v0.0.39 schema's field names
(no 23.02 to run here). <version>/data_parser/<vX>/ hold the same records in every data_parser
version that Slurm still speaks (v0.0.40-v0.0.45)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.proc import Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import AmbiguousRecord, parse_job, parse_node
from slurm_resilience.slurm.parse_json import (
    data_parser,
    expand_output_pattern,
    parse_jobs_json,
    parse_nodes_json,
)
from slurm_resilience.testing import FakeRunner, completed

SLURM = REAL_FIXTURES / "slurm"
CAPTURED = ("22.05.8", "24.11.5", "26.05.5")
JSON_SCONTROL = ("24.11.5", "26.05.5")
DATA_PARSER = {"22.05.8": "v0.0.38", "24.11.5": "v0.0.42", "26.05.5": "v0.0.45"}
SPOOFED = ("/tmp/spoofed", "/tmp/spoofed-name", "/tmp/spoofed-comment")


def _read(version: str, name: str) -> str:
    return (SLURM / version / name).read_text()


def _capture_dir(version: str) -> str:
    """The sandbox state dir the capture ran in, from the real output path."""
    doc = json.loads(_read(version, "squeue.json"))
    job = next(j for j in doc["jobs"] if j["job_id"] == 1)
    return str(Path(job["standard_output"]).parent)


@pytest.mark.parametrize("version", CAPTURED)
def test_squeue_json_gives_the_expanded_output_path_and_exact_user_fields(version: str) -> None:
    """22.05 and 26.05 print the raw --output pattern: std_out is still the real file."""
    text = _read(version, "squeue.json")
    assert data_parser(text) == DATA_PARSER[version]
    jobs = {j.job_id: j for j in parse_jobs_json(text)}
    spoof = jobs[1]
    assert spoof.std_out == f"{_capture_dir(version)}/slurm-1.out"
    assert spoof.work_dir == "/tmp"
    assert spoof.name == "spoof UserId=root(0) StdOut=/tmp/spoofed-name"
    assert spoof.comment == "StdOut=/tmp/spoofed-comment WorkDir=/tmp/spoofed"
    assert (spoof.user, spoof.uid, spoof.state) == ("root", 0, "RUNNING")
    assert spoof.nodes == ("node1",) and spoof.num_nodes == 1 and spoof.priority > 0
    assert spoof.submit_time > 1_700_000_000 and spoof.start_time >= spoof.submit_time
    assert jobs[2].state == "PENDING" and jobs[2].std_out == "/dev/null"


@pytest.mark.parametrize("version", CAPTURED)
def test_exclusive_and_switches_where_the_version_reports_them(version: str) -> None:
    """--exclusive shows in 22.05's and 24.11's JSON, not in 26.05's (None: unknown);
    --switches is in the JSON from 23.02 on, and in every version's text record."""
    excl = {j.job_id: j for j in parse_jobs_json(_read(version, "squeue.json"))}[2]
    assert excl.exclusive is (None if version == "26.05.5" else True)
    if version != "22.05.8":
        assert (excl.switches, excl.switch_wait_s) == (1, 30)
    text = parse_job(_read(version, "show_job_exclusive_o.txt"))
    assert text.exclusive is True and (text.switches, text.switch_wait_s) == (1, 30)
    assert text.std_out == "/dev/null" and text.state == "PENDING"


@pytest.mark.parametrize("version", JSON_SCONTROL)
def test_scontrol_json_show_job_matches_squeue(version: str) -> None:
    """scontrol --json show job (23.02+) and squeue --json share one parser."""
    (job,) = parse_jobs_json(_read(version, "show_job.json"))
    assert job.std_out == f"{_capture_dir(version)}/slurm-1.out"
    assert job.name.startswith("spoof ") and job.work_dir == "/tmp"
    assert not job.exclusive


@pytest.mark.parametrize("version", CAPTURED)
def test_spoofing_text_record_is_refused(version: str) -> None:
    """A job name, comment or submit line holding "StdOut=..." makes the text record
    ambiguous: the parser refuses it instead of returning a forged field."""
    with pytest.raises(AmbiguousRecord, match=r"forged|more than once"):
        parse_job(_read(version, "show_job_o.txt"))


def _with(record: str, key: str, value: str) -> str:
    """The real record with one user-written field's value replaced."""
    return re.sub(rf"(^| ){key}=.*? (?=[A-Z][A-Za-z]*=)", rf"\g<1>{key}={value} ", record,
                  count=1)


@pytest.mark.parametrize("version", CAPTURED)
def test_key_like_text_a_user_may_write_stays_in_its_value(version: str) -> None:
    """Ordinary names and comments with "Key=value" text are not fields of their own."""
    real = _read(version, "show_job_exclusive_o.txt")
    job = parse_job(_with(_with(real, "JobName", "run LR=0.1 BS=32"), "WorkDir",
                          "/tmp Epoch=3"))
    assert job.name == "run LR=0.1 BS=32" and job.work_dir == "/tmp Epoch=3"
    assert (job.state, job.std_out, job.switches) == ("PENDING", "/dev/null", 1)
    assert "LR" not in job.raw and "Epoch" not in job.raw


@pytest.mark.parametrize(("key", "forged"), [
    ("JobName", "x JobState=COMPLETED"),
    ("JobName", "x UserId=root(0) GroupId=root(0)"),
    ("WorkDir", "/tmp StdErr=/a StdIn=/b StdOut=/etc/x"),
    ("WorkDir", "/tmp Comment=c StdErr=/a StdIn=/b StdOut=/etc/x Power="),
])
def test_forged_fields_in_user_values_are_refused(key: str, forged: str) -> None:
    """A forged field that would shadow or swallow a real one makes the record an error."""
    real = _read("22.05.8", "show_job_exclusive_o.txt")
    with pytest.raises(AmbiguousRecord):
        parse_job(_with(real, key, forged))


def _replay(version: str) -> FakeRunner:
    """A runner answering scontrol as the captured Slurm did for job 1."""
    def answer(argv: Sequence[str]) -> Completed:
        if "node" in argv:
            name = "show_node.json" if "--json" in argv else "show_node_o.txt"
        else:
            name = "show_job.json" if "--json" in argv else "show_job_o.txt"
        return completed(_read(version, name))
    return FakeRunner({"scontrol": [answer]}, slurm_version=version)


@pytest.mark.parametrize("version", JSON_SCONTROL)
def test_show_job_is_not_spoofed_by_the_users_command_line(version: str) -> None:
    """Regression: on 26.05, ``sbatch --wrap "echo StdOut=/tmp/spoofed"`` made show_job()
    return /tmp/spoofed as the job's output file, where root writes the hang report."""
    runner = _replay(version)
    job = SlurmAdapter(runner=runner).show_job(1)
    assert job.std_out == f"{_capture_dir(version)}/slurm-1.out"
    assert job.std_out not in SPOOFED and job.work_dir == "/tmp" and job.uid == 0
    assert runner.calls == [["scontrol", "--json", "show", "job", "1"]]


def test_show_job_on_2205_refuses_the_spoofed_record() -> None:
    """22.05 has no scontrol --json: the ambiguous text record is an error, never a guess."""
    runner = _replay("22.05.8")
    with pytest.raises(SlurmError, match=r"forged|more than once"):
        SlurmAdapter(runner=runner).show_job(1)
    assert runner.calls == [["scontrol", "show", "job", "1", "-o"]]


@pytest.mark.parametrize("version", CAPTURED)
def test_drained_node_reads_the_same_in_text_and_json(version: str) -> None:
    """node2 drained by hand: state, flag, reason, who and features agree across forms."""
    runner = _replay(version)
    node = SlurmAdapter(runner=runner).show_node("node2")
    assert (node.state, node.drained, node.reason) == ("IDLE", True, "capture: drained by hand")
    assert node.reason_user == "root" and node.reason_time.startswith("2026-")
    assert node.features == ("leaf01",) and node.partitions == ("debug",)
    assert node.address == "127.0.0.1" and node.cpus == 2
    # Its slurmd's port (the batch host probes it after a step fails); each capture's
    # sandbox had its own port base.
    assert node.port == {"22.05.8": 25002}.get(version, 25012)
    text_nodes = [parse_node(ln) for ln in _read(version, "show_node_o.txt").splitlines()]
    assert [n.name for n in text_nodes] == ["node1", "node2"]
    if version in JSON_SCONTROL:
        json_nodes = {n.name: n for n in parse_nodes_json(_read(version, "show_node.json"))}
        for t in text_nodes:
            j = json_nodes[t.name]
            assert (j.state, j.flags, j.reason, j.reason_user, j.reason_time) == \
                (t.state, t.flags, t.reason, t.reason_user, t.reason_time)
            assert (j.features, j.cpus, j.alloc_cpus, j.address, j.port) == \
                (t.features, t.cpus, t.alloc_cpus, t.address, t.port)


def test_v0039_shapes_string_state_and_state_flags() -> None:
    """23.02 (v0.0.39): job_state a string, node state lower-case with state_flags,
    features a comma list; the output pattern expanded here."""
    job, = parse_jobs_json((SLURM / "23.02-schema" / "squeue.json").read_text())
    assert (job.state, job.num_nodes, job.nodes) == ("RUNNING", 2, ("node1", "node2"))
    assert job.std_out == "/home/alice/train-7.out" and job.exclusive is True
    node, = parse_nodes_json((SLURM / "23.02-schema" / "show_node.json").read_text())
    assert (node.state, node.drained, node.features) == ("IDLE", True, ("leaf01", "gpu"))


def test_output_pattern_expansion() -> None:
    """Slurm's batch-step expansion: ids (padded), array ids, name, user, host, %%."""
    job = {"job_id": 12, "array_job_id": 10, "array_task_id": 2, "name": "n", "user_name": "u",
           "batch_host": "node1.cluster"}
    assert expand_output_pattern("/o/%x-%A_%a.%4j.%u.%N.%%", job) == "/o/n-10_2.0012.u.node1.%"
    plain = {"job_id": 12, "array_job_id": 0, "array_task_id": 4294967294}
    assert expand_output_pattern("%A-%j", plain) == "12-12"
    with pytest.raises(ValueError, match="can't expand %q"):
        expand_output_pattern("/o/%q", job)


def test_held_and_completing_job_reads_as_the_text_form_does() -> None:
    """26.05 right after `scontrol requeuehold` (seen in the sid leg): the text form says
    JobState=COMPLETING Reason=job_requeued_in_held_state; JSON splits both."""
    doc = {"jobs": [{"job_id": 3, "job_state": ["PENDING", "COMPLETING"],
                     "state_reason": "JobHeldUser",
                     "state_description": "job requeued in held state"}], "errors": []}
    (job,) = parse_jobs_json(json.dumps(doc))
    assert (job.state, job.reason) == ("COMPLETING", "job_requeued_in_held_state")
    doc["jobs"][0].update(job_state=["PENDING"], state_description="")
    (job,) = parse_jobs_json(json.dumps(doc))
    assert (job.state, job.reason) == ("PENDING", "JobHeldUser")


def test_json_errors_are_reported_not_hidden() -> None:
    """Slurm's own error list, or output that is not JSON, raises naming it."""
    with pytest.raises(ValueError, match="Invalid job id"):
        parse_jobs_json(json.dumps({"jobs": [], "errors": [{"error": "Invalid job id"}]}))
    with pytest.raises(ValueError, match="does not parse"):
        parse_jobs_json("JobId=1 JobName=x")


# Every data_parser version a captured Slurm still speaks (--json=vX), recorded in one run
# per Slurm version: (slurm version, data_parser version).
DATA_PARSERS = sorted((d.parent.parent.name, d.name)
                      for d in SLURM.glob("*/data_parser/v0.0.*") if d.is_dir())


def test_every_data_parser_version_from_v0038_to_v0045_is_read() -> None:
    """v0.0.38 (22.05), v0.0.40-v0.0.45 (24.11 and 26.05) are real captures; v0.0.39 has
    no Debian Slurm to run and is the hand-written 23.02 schema."""
    real = {dp for _, dp in DATA_PARSERS} | set(DATA_PARSER.values())
    assert real == {f"v0.0.{n}" for n in (38, 40, 41, 42, 43, 44, 45)}


@pytest.mark.parametrize(("version", "dp"), DATA_PARSERS)
def test_each_data_parser_version_reads_the_same_jobs_and_nodes(version: str, dp: str) -> None:
    """The spoof job, the pending exclusive job and the hand-drained node read alike in every
    data_parser version; scontrol's record of the spoof job matches squeue's."""
    base = SLURM / version / "data_parser" / dp
    text = (base / "squeue.json").read_text()
    assert data_parser(text) == dp
    jobs = {j.job_id: j for j in parse_jobs_json(text)}
    spoof, pending = jobs[1], jobs[2]
    assert spoof.name == "spoof UserId=root(0) StdOut=/tmp/spoofed-name"
    assert spoof.comment == "StdOut=/tmp/spoofed-comment WorkDir=/tmp/spoofed"
    assert spoof.std_out.endswith("/slurm-1.out") and "%" not in spoof.std_out
    assert not spoof.std_out.startswith("/tmp/spoofed")
    assert (spoof.work_dir, spoof.user, spoof.uid, spoof.state) == ("/tmp", "root", 0, "RUNNING")
    assert spoof.nodes == ("node1",) and spoof.num_nodes == 1
    assert pending.state == "PENDING" and pending.std_out == "/dev/null"
    shown, = parse_jobs_json((base / "show_job.json").read_text())
    assert (shown.job_id, shown.name, shown.comment, shown.std_out, shown.work_dir,
            shown.state, shown.nodes) == (1, spoof.name, spoof.comment, spoof.std_out,
                                          spoof.work_dir, spoof.state, spoof.nodes)
    nodes = {n.name: n for n in parse_nodes_json((base / "show_node.json").read_text())}
    assert set(nodes) == {"node1", "node2"}
    drained = nodes["node2"]
    assert drained.drained and drained.reason == "capture: drained by hand"
    assert drained.reason_user == "root" and drained.features == ("leaf01",)
    assert not nodes["node1"].drained and nodes["node1"].cpus == 2


@pytest.mark.parametrize("version", ["22.05.8", "24.11.5", "26.05.5"])
def test_keys_with_a_colon_are_keys_in_every_versions_text_record(version: str) -> None:
    """AllocNode:Sid, ReqB:S:C:T and NtasksPerN:B:S:C are fields of their own, so the
    Partition before them reads 'debug', not 'debug AllocNode:Sid=localhost:20315'."""
    job = parse_job(_read(version, "show_job_exclusive_o.txt").splitlines()[0])
    assert job.partition == "debug"
    assert job.raw["AllocNode:Sid"] == "localhost:20315"
    assert job.raw["ReqB:S:C:T"] == "0:0:*:*"
    assert job.raw["NtasksPerN:B:S:C"] == "0:0:*:*"
    assert job.req_nodes == ()


@pytest.mark.parametrize("version", CAPTURED)
def test_preempt_mode_is_the_partitions_own_or_the_clusters(version: str) -> None:
    """The sandbox's partitions: debug inherits the cluster's REQUEUE, spot sets CANCEL,
    urgent OFF; scontrol prints the mode that applies to each, the adapter reads it."""
    lines = {ln.split()[0].removeprefix("PartitionName="): ln
             for ln in _read(version, "show_partition_o.txt").splitlines()}
    asked: list[list[str]] = []

    def answer(argv: Sequence[str]) -> Completed:
        asked.append(list(argv))
        return completed(lines[argv[3]] + "\n")

    adapter = SlurmAdapter(runner=FakeRunner({"scontrol": [answer]}, slurm_version=version))
    modes = {name: adapter.preempt_mode(name) for name in ("debug", "spot", "urgent")}
    assert modes == {"debug": "REQUEUE", "spot": "CANCEL", "urgent": "OFF"}
    assert asked[0] == ["scontrol", "show", "partition", "debug", "-o"]
    with pytest.raises(ValueError, match="not a partition name"):
        adapter.preempt_mode("spot --all")
    broken = SlurmAdapter(runner=FakeRunner({"scontrol": [completed("Partition x\n")]},
                                            slurm_version=version))
    with pytest.raises(SlurmError, match="no PreemptMode"):
        broken.preempt_mode("x")
