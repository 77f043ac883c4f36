"""A real S3-protocol endpoint for unit tests: moto's ThreadedMotoServer on 127.0.0.1.

It speaks HTTP S3 like the sandbox's rclone, and unlike rclone it honours
``If-None-Match: *`` on PutObject (412 when the key exists), so the conditional commit
marker's path runs against it. moto comes with the ``dev`` extra; without it the tests
that need it (fixtures ``moto_endpoint`` and ``s3`` in tests/conftest.py) skip, which CI
(SLURM_RESILIENCE_REQUIRE_SANDBOX=1) turns into failures.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from slurm_resilience.checkpoint.commit import COMMIT
from slurm_resilience.uploader.s3 import S3


def upload_step(s3: S3, run: str, step_dir: Path, *, commit: bool = True,
                only: str = "") -> None:
    """Put a local step dir's files under ``s3://ckpt/<run>/<step>/`` (COMMIT.json last)."""
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != COMMIT)
    for p in files:
        rel = p.relative_to(step_dir).as_posix()
        if rel.startswith(only):
            s3.client.put_object(Bucket="ckpt", Key=f"{run}/{step_dir.name}/{rel}",
                                 Body=p.read_bytes())
    if commit:
        s3.client.put_object(Bucket="ckpt", Key=f"{run}/{step_dir.name}/{COMMIT}",
                             Body=(step_dir / COMMIT).read_bytes())


def copy_step(src: Path, dest_job: Path) -> Path:
    dest = dest_job / src.name
    shutil.copytree(src, dest)
    return dest
