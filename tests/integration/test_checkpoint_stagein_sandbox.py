"""Stage-in and ``ckpt.fetch`` in the Slurm sandbox: a 2-node job (SPANK ``--ckpt-uri``, so
the prolog starts the stage-in) whose tasks, running as an unprivileged test user, ask
their node's agent for the ranges their ranks read."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from slurm_resilience.checkpoint.blocks import BLOCK_SIZE
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    ChecksummingWriter,
    begin_part,
    commit_part,
    write_commit_marker,
)
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.uploader.s3 import S3, S3Settings

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
FILE = 4 * BLOCK_SIZE + 100 * 1024  # whole blocks and one short last block per rank file

TASK = """
import os, sys, time
from slurm_resilience import config
from slurm_resilience.agent.client import call
from slurm_resilience.checkpoint.agent_ranges import AgentRanges
from slurm_resilience.checkpoint.ranges import ByteRange
from slurm_resilience.config.paths import node_name, node_path

cfg = config.load(config.job_config_path(os.environ))
node = node_name(os.environ["SLURMD_NODENAME"])
sock = node_path(cfg.agent.socket, node)
job, task = int(os.environ["SLURM_JOB_ID"]), int(os.environ["SLURM_PROCID"])
deadline = time.monotonic() + 60
while True:
    st = call(sock, "ckpt.status", job_id=job)
    if st["stagein"] in ("done", "failed") or time.monotonic() > deadline:
        break
    time.sleep(0.2)
if st["stagein"] != "done":
    sys.exit(f"stage-in: {st}")
size = int(sys.argv[1])
ranks = (2 * task, 2 * task + 1)  # two ranks per node; the second reads only its tail
ranges = [ByteRange(f"rank-{ranks[0]:05d}/data.distcp", 0, size),
          ByteRange(f"rank-{ranks[1]:05d}/data.distcp", size - 10, 10)]
AgentRanges(sock, job).ensure(st["step"], ranges)
st = call(sock, "ckpt.status", job_id=job)
print(f"task={task} step={st['step']} mode={st['mode']} "
      f"fetched={st['fetch']['fetched_bytes']}", flush=True)
"""


def _build_into_s3(sandbox: Sandbox, uri: str, step: int, world: int, tmp: Path) -> None:
    """A committed DCP-style step, placed where the sandbox's rclone S3 serves it from."""
    tmp.mkdir()
    rng = random.Random(step)
    for rank in range(world):
        part = begin_part(tmp, step, rank)
        entries = []
        for name in ["data.distcp", ".metadata"] if rank == 0 else ["data.distcp"]:
            w = ChecksummingWriter(part / name)
            w.write(rng.randbytes(FILE if name == "data.distcp" else 2048))
            entries.append(w.close())
        commit_part(part, step, rank, known=entries)
    write_commit_marker(tmp, step, world)
    # Through the S3 API: rclone caches directory listings, so files dropped into its
    # directory may not be listed for minutes.
    s3 = S3(S3Settings(endpoint=sandbox.layout.s3_endpoint,
                       credentials_file=str(sandbox.layout.s3_keys_file)))
    sdir = tmp / f"step-{step:08d}"
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    for path in sorted(sdir.rglob("*"), key=lambda p: p.name == COMMIT):  # COMMIT.json last
        if path.is_file():
            s3.client.put_object(Bucket=bucket, Key=f"{prefix}/{sdir.name}/"
                                 f"{path.relative_to(sdir).as_posix()}", Body=path.read_bytes())


def test_two_node_job_fetches_only_its_ranks_ranges(sandbox: Sandbox,
                                                   test_users: tuple[str, ...],
                                                   tmp_path: Path) -> None:
    """Each node of a real job stages in the newest step's metadata only, and its task's
    ckpt.fetch brings exactly the blocks its ranks asked for (not every rank's data)."""
    user = test_users[0]
    uri = f"s3://ckpt/{user}/stagein-{time.time_ns()}"
    _build_into_s3(sandbox, uri, 5, 4, tmp_path / "old")
    _build_into_s3(sandbox, uri, 10, 4, tmp_path / "new")
    wd = sandbox.user_dir(user, "ckpt-stagein")
    (wd / "task.py").write_text(TASK)
    script = (f"#!/bin/sh\nsrun -N2 -n2 {PYTHON} -u {wd}/task.py {FILE}\n")
    job = sandbox.sbatch(script, user=user, args=[
        "-N2", "-n2", "--nodelist=node1,node2", f"--output={wd}/slurm-%j.out",
        f"--ckpt-uri={uri}"])
    info = sandbox.wait_job(job, timeout=120)
    out = (wd / f"slurm-{job}.out").read_text()
    assert info.state == "COMPLETED", out
    lines = sorted(re.findall(r"task=(\d) step=(\d+) mode=(\w+) fetched=(\d+)", out))
    # Rank 2t's whole file and the short last block of rank 2t+1's file.
    expected = str(FILE + FILE % BLOCK_SIZE)
    assert lines == [("0", "10", "metadata", expected), ("1", "10", "metadata", expected)], out
