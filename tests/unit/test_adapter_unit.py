"""Adapter behaviour that needs a misbehaving Slurm: timeouts and argv shape."""

from __future__ import annotations

import pytest

from slurm_resilience.proc import CommandTimeout
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import ForeignDrain, SlurmTimeout
from slurm_resilience.testing import FakeRunner, completed

NODE = ("NodeName=node1 CPUAlloc=0 CPUTot=2 State={state} Partitions=debug Reason={reason}")


def test_timeout_becomes_slurm_timeout() -> None:
    """A hung scontrol is killed at the timeout and reported as SlurmTimeout."""
    runner = FakeRunner({"scontrol": [CommandTimeout(["scontrol"], "timed out after 2s")]})
    ctl = SlurmAdapter(runner=runner, timeout=2)
    with pytest.raises(SlurmTimeout, match="timed out after 2s"):
        ctl.show_node("node1")
    assert runner.calls[0] == ["scontrol", "show", "node", "node1", "-o"]


def test_drain_rereads_and_never_overwrites_foreign_reason() -> None:
    """drain() leaves a node someone else drained alone instead of replacing their reason."""
    foreign = NODE.format(state="IDLE+DRAIN", reason="maintenance [bob@t]")
    runner = FakeRunner({"scontrol": [completed(foreign)]})
    with pytest.raises(ForeignDrain, match="already drained by bob"):
        SlurmAdapter(runner=runner).drain("node1", "gpu3 XID 79")
    assert len(runner.calls) == 1


def test_drain_passes_reason_as_one_argv_element() -> None:
    """Reasons with spaces and shell metacharacters travel as one argv element, prefixed."""
    runner = FakeRunner({"scontrol": [completed(NODE.format(state="IDLE", reason="(null)")),
                                      completed("")]})
    SlurmAdapter(runner=runner).drain("node1", "x; rm -rf / $(id)")
    assert runner.calls[1][-1] == "Reason=SR: x; rm -rf / $(id)"


def test_bad_node_names_never_reach_slurm() -> None:
    """A node name with spaces or option-like text is refused before any call."""
    runner = FakeRunner()
    with pytest.raises(ValueError, match="not a valid node name"):
        SlurmAdapter(runner=runner).show_node("-o all")
    with pytest.raises(ValueError, match="not a job id"):
        SlurmAdapter(runner=runner).requeue("12; true")
    assert runner.calls == []
