"""The sandbox's own records in its state directory: the layout it was started with and
how to reach its S3 endpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.sandbox.errors import SandboxError
from slurm_resilience.sandbox.layout import BUCKET, Layout

LAYOUT_FILE = "sandbox.json"


@dataclass(frozen=True)
class S3Info:
    """How to reach the sandbox's S3 endpoint."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str


def save_layout(layout: Layout) -> None:
    data = {"nodes": layout.nodes, "leaves": layout.leaves, "port_base": layout.port_base,
            "repo": str(layout.repo),
            "slurm_overrides": [list(kv) for kv in layout.slurm_overrides]}
    (layout.state_dir / LAYOUT_FILE).write_text(json.dumps(data, indent=1) + "\n")


def load_layout(state_dir: Path) -> Layout:
    """The layout a sandbox was started with, read back from its state directory."""
    path = Path(state_dir).absolute() / LAYOUT_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SandboxError(f"sandbox: no sandbox in {state_dir} ({path} missing); "
                           f"run `slurm-resilience sandbox up` first") from None
    return Layout(state_dir=Path(state_dir), nodes=int(data["nodes"]),
                  leaves=int(data["leaves"]), port_base=int(data["port_base"]),
                  repo=Path(data["repo"]),
                  slurm_overrides=tuple((str(k), str(v))
                                        for k, v in data.get("slurm_overrides", [])))


def s3_info(layout: Layout) -> S3Info:
    access, secret = layout.s3_keys_file.read_text().split()
    return S3Info(layout.s3_endpoint, BUCKET, access, secret)
