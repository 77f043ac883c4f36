"""The public testing helpers behave like the real seam."""

from __future__ import annotations

import pytest

from slurm_resilience.proc import CommandTimeout
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError, SlurmTimeout
from slurm_resilience.testing import FakeRunner, completed


def test_fake_runner_drives_the_adapter() -> None:
    """A scripted FakeRunner answers the adapter and records its argv."""
    runner = FakeRunner({"scontrol": [completed(
        "NodeName=n1 CPUAlloc=0 CPUTot=2 State=IDLE Partitions=debug Reason=(null)")]})
    node = SlurmAdapter(runner=runner).show_node("n1")
    assert node.state == "IDLE" and not node.drained
    assert runner.calls == [["scontrol", "show", "node", "n1", "-o"]]


def test_fake_runner_raises_scripted_failures() -> None:
    """Non-zero exits and timeouts reach the adapter as Slurm errors."""
    runner = FakeRunner({"scontrol": [completed(returncode=1, stderr="Invalid job id specified"),
                                      CommandTimeout(["scontrol"], "timed out after 1s")]})
    ctl = SlurmAdapter(runner=runner)
    with pytest.raises(SlurmError, match="Invalid job id"):
        ctl.requeue(5)
    with pytest.raises(SlurmTimeout):
        ctl.requeue(5)
