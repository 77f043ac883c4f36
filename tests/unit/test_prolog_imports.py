"""The prolog is on every job's critical path: its healthy run imports nothing heavy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from slurm_resilience.sandbox import hardware, resilience_conf
from slurm_resilience.sandbox.layout import Layout

REPO = Path(__file__).resolve().parents[2]
NODE = "node1"

# Modules a healthy prolog must never load. yaml is not listed: the config file is YAML
# and the prolog reads it on every run.
HEAVY = (
    "torch", "numpy", "google_crc32c", "boto3", "botocore",
    "slurm_resilience.checkpoint.commit",  # the commit protocol and its CRC32C extension
    "slurm_resilience.checkpoint.crc",
    "slurm_resilience.checkpoint.manager",
    "slurm_resilience.uploader.s3",
    "slurm_resilience.nccl.gate",
    "slurm_resilience.nccl.launcher",
)

# Runs the hook as hooks/prolog does (-I, -m slurm_resilience.hooks prolog), then
# reports its exit status and what it had imported.
_RUN = """
import json, runpy, sys
sys.argv = ["slurm_resilience.hooks", "prolog"]
try:
    runpy.run_module("slurm_resilience.hooks", run_name="__main__")
    rc = 0
except SystemExit as exc:
    rc = exc.code
print(json.dumps({"rc": rc, "modules": sorted(sys.modules)}))
"""


def test_healthy_prolog_loads_no_heavy_module(tmp_path: Path) -> None:
    """Every capability's prolog step runs against healthy stand-in hardware (the
    benchmark's setup); none of them pulls torch, numpy, boto3, CRC32C or the commit
    protocol into the process."""
    layout = Layout(state_dir=tmp_path, nodes=1, leaves=1)
    hardware.prepare_node_hardware(layout.state_dir, [NODE])
    sections = resilience_conf.sections(layout)
    sections["logging"]["file"] = f"{tmp_path}/log/events.jsonl"
    assert sections["checkpoint"]["enabled"]  # the staging step really runs
    cfg_path = tmp_path / "slurm-resilience.yaml"
    cfg_path.write_text(yaml.safe_dump(sections))
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "SLURM_RESILIENCE_CONFIG": str(cfg_path),
        "SLURMD_NODENAME": NODE,
        "SLURM_JOB_ID": "1001",
        "SLURM_JOB_UID": str(os.getuid()),
        "SLURM_JOB_GID": str(os.getgid()),
        "SLURM_JOB_USER": "prolog-imports",
        "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
        "SLURM_JOB_NODELIST": NODE,
    }
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _RUN], env=env, cwd=REPO,
                              capture_output=True, text=True, check=False, timeout=120)
    finally:
        _unmount_under(tmp_path)  # the job's run-dir tmpfs: no epilog runs here
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, done.stderr
    loaded = set(result["modules"])
    assert "slurm_resilience.uploader.steps" in loaded  # the steps did run
    assert sorted(m for m in HEAVY if m in loaded) == []


def _unmount_under(path: Path) -> None:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh if line.split()[4].startswith(f"{path}/")]
    for point in reversed(points):
        subprocess.run(["umount", "--lazy", point], check=False, timeout=10)
