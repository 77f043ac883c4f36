"""The SPANK plugin in real sbatch/slurmd: validated options reach tasks and hooks."""

from __future__ import annotations

import json
import time

import pytest

from slurm_resilience.proc import CommandError
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = pytest.mark.sandbox


def _hook_events(sandbox: Sandbox, job_id: int) -> list[dict[str, object]]:
    path = sandbox.layout.state_dir / "log" / "slurm-resilience.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [e for e in events if e.get("job_id") == job_id and e.get("event") == "hook ok"]


def test_options_reach_the_tasks_and_the_prolog(sandbox: Sandbox) -> None:
    """--ckpt-uri/--hang-timeout/--leaf-pin appear as SLURM_RESILIENCE_* in the job and
    as SPANK_SLURM_RESILIENCE_* in the prolog's environment."""
    job = sandbox.sbatch(
        ["sh", "-c", "env | grep ^SLURM_RESILIENCE_ | sort"],
        args=["-N1", "--ckpt-uri=s3://ckpt/root/spank-run", "--hang-timeout=90",
              "--leaf-pin=off", "--hang-watch=observe"],
    )
    sandbox.wait_job(job, timeout=60)
    out = sandbox.output(job)
    assert "SLURM_RESILIENCE_CKPT_URI=s3://ckpt/root/spank-run" in out
    assert "SLURM_RESILIENCE_HANG_TIMEOUT=90" in out
    assert "SLURM_RESILIENCE_LEAF_PIN=off" in out
    assert "SLURM_RESILIENCE_HANG=observe" in out
    deadline = time.monotonic() + 60
    while not (events := _hook_events(sandbox, job)) and time.monotonic() < deadline:
        time.sleep(0.2)
    prolog = [e for e in events if e["hook"] == "prolog"]
    assert prolog, "the prolog logged no 'hook ok' event for the job"
    assert prolog[0]["job_options"] == {
        "CKPT_URI": "s3://ckpt/root/spank-run", "HANG_TIMEOUT": "90", "LEAF_PIN": "off",
        "HANG": "observe",
    }


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--hang-timeout=abc", "expected whole seconds in [10, 86400]"),
        ("--hang-timeout=5", "expected whole seconds in [10, 86400]"),
        ("--ckpt-uri=/etc/passwd", "expected s3://bucket/prefix"),
        ("--ckpt-uri=s3://ckpt/../other", "expected s3://bucket/prefix"),
        ("--leaf-pin=maybe", "expected on or off"),
        ("--hang-watch=later", "expected on, observe or off"),
    ],
)
def test_bad_option_fails_sbatch_naming_it(sandbox: Sandbox, option: str, message: str) -> None:
    """A bad value is refused by sbatch itself, with a message naming the option."""
    with pytest.raises(CommandError) as err:
        sandbox.sbatch(["true"], args=["-N1", option])
    assert message in str(err.value)
    assert option.split("=")[0] in str(err.value)
