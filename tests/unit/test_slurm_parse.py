"""Parsers of scontrol one-line records and squeue --json."""

from __future__ import annotations

import json

from conftest import REAL_FIXTURES

from slurm_resilience.slurm.adapter import clean_reason
from slurm_resilience.slurm.parse import (
    expand_hostlist,
    parse_job,
    parse_node,
    split_oneliner,
)
from slurm_resilience.slurm.parse_json import parse_nodes_json, parse_squeue_json

REAL = REAL_FIXTURES / "slurm"


def test_real_multiline_node_record_parses() -> None:
    """A real `scontrol show node` capture (24.05) parses once joined into one line."""
    name = "scontrol-show-node_idle-drain_gres-gpu-count-reported-lower_awslabs-issue195.txt"
    text = (REAL / name).read_text()
    node = parse_node(" ".join(text.split("\n")))
    assert node.name == "yigou-dev-102-68"
    assert node.state == "IDLE" and node.drained
    assert node.reason == "gres/gpu count reported lower than configured (0 < 1)"
    assert node.reason_user == "slurm"
    assert node.reason_time == "2024-12-19T11:03:34"
    assert node.gres == "gpu:nvidia-rtx-3090:1"
    assert node.features == ()
    assert node.raw["OS"].startswith("Linux 5.10.0-153")


def test_reason_with_colons_and_parentheses() -> None:
    """Our own reasons, with colons, parentheses and spaces, survive parsing."""
    line = ("NodeName=node3 Arch=x86_64 CPUAlloc=0 CPUTot=2 State=IDLE+DRAIN "
            "Partitions=debug Reason=SR: gpu3 XID 79 (GPU fell off the bus) 12:01:07 "
            "[root@2026-11-22T05:00:00]")
    node = parse_node(line)
    assert node.reason == "SR: gpu3 XID 79 (GPU fell off the bus) 12:01:07"
    assert node.reason_user == "root"


def test_job_record_with_spaces_in_values() -> None:
    """Job names and commands with spaces do not split into false fields."""
    line = ("JobId=17 JobName=my train run UserId=alice(1001) GroupId=alice(1001) Priority=1 "
            "JobState=RUNNING Reason=None Requeue=1 Restarts=2 BatchFlag=1 "
            "NodeList=node[1-2,4] BatchHost=node1 NumNodes=3 Partition=debug "
            "ExcNodeList=node3 Command=/home/alice/run.sh --lr 0.1 WorkDir=/home/alice "
            "Comment=resume please AdminComment=(null) StdOut=/home/alice/out.txt")
    job = parse_job(line)
    assert job.job_id == 17 and job.name == "my train run"
    assert job.user == "alice" and job.uid == 1001
    assert job.nodes == ("node1", "node2", "node4")
    assert job.restarts == 2 and job.requeue
    assert job.exc_nodes == ("node3",)
    assert job.comment == "resume please" and job.admin_comment == ""
    assert job.raw["Command"] == "/home/alice/run.sh --lr 0.1"


def test_split_oneliner_keeps_first_occurrence() -> None:
    """Duplicate keys keep the first value (Reason appears once per record)."""
    assert split_oneliner("A=1 B=two words C=3") == {"A": "1", "B": "two words", "C": "3"}


def test_squeue_json_v0038() -> None:
    """squeue --json of 22.05 (v0.0.38) gives jobs with nodes expanded."""
    doc = {"meta": {}, "errors": [], "jobs": [{
        "job_id": 5, "name": "t", "user_name": "root", "user_id": 0, "job_state": "RUNNING",
        "state_reason": "None", "nodes": "node[1-2]", "batch_host": "node1", "restart_cnt": 1,
        "requeue": True, "comment": "", "partition": "debug", "node_count": 2,
    }]}
    jobs = parse_squeue_json(json.dumps(doc))
    assert jobs[0].nodes == ("node1", "node2") and jobs[0].restarts == 1
    assert jobs[0].num_nodes == 2 and jobs[0].state == "RUNNING"


def test_hostlist_expansion_uses_library() -> None:
    """Hostlists expand through python-hostlist, and (null) is empty."""
    assert expand_hostlist("gpu[01-03],cpu7") == ["gpu01", "gpu02", "gpu03", "cpu7"]
    assert expand_hostlist("(null)") == []


def test_clean_reason_is_one_bounded_line() -> None:
    """Reasons lose control characters and newlines and are bounded in length."""
    assert clean_reason("a\nb\tc\x00d") == "a b c d"
    assert len(clean_reason("x" * 1000)) == 200


def test_node_comment_is_read_in_text_and_json() -> None:
    """The node Comment (hang handling's take-out record lives there) is read after the
    reason in scontrol's one-line form, and from the JSON form."""
    line = ("NodeName=node2 State=IDLE+DRAIN CPUTot=2 Reason=SR: suspect hang job 4 user a at "
            "2026-11-23T10:00:00Z: x; verifying [root@2026-11-23T10:00:01] "
            "Comment=[sr-out a/4/1795428000] rack 4")
    node = parse_node(line)
    assert node.comment == "[sr-out a/4/1795428000] rack 4" and node.reason.endswith("verifying")
    doc = json.dumps({"nodes": [{"name": "node2", "state": ["IDLE"], "comment": "c"}]})
    assert parse_nodes_json(doc)[0].comment == "c"
