"""``topology generate --from-nvlink-domains``: the nodes' NVLink domain records → Slurm blocks."""

from __future__ import annotations

import argparse
import json
import os
import sys

from slurm_resilience import config
from slurm_resilience.cli import UsageError
from slurm_resilience.health.nvlink_domain import NodeFabric
from slurm_resilience.topology import block, generate
from slurm_resilience.topology.slurmconf import parse_slurm_conf

MAX_RECORD_BYTES = 1 << 20


def read_records(paths: list[str]) -> list[NodeFabric]:
    out = []
    for path in paths:
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_RECORD_BYTES + 1)
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
            out.append(NodeFabric.from_json(json.loads(raw)))
        except OSError as exc:
            raise UsageError(f"topology: read: couldn't read NVLink domain record {path}: "
                             f"{exc.strerror}") from None
        except (ValueError, TypeError) as exc:
            raise UsageError(f"topology: {path}: not an NVLink domain record: {exc}") from None
    return out


def version_of(args: argparse.Namespace) -> tuple[int, int]:
    if args.slurm_version:
        try:
            return block.parse_version(args.slurm_version)
        except ValueError as exc:
            raise UsageError(f"topology: --slurm-version: {exc}") from None
    from slurm_resilience.slurm.adapter import from_config

    return from_config(config.load(args.config)).slurm_version()


def run(args: argparse.Namespace) -> int:
    records = read_records(args.from_nvlink_domains)
    known = list(parse_slurm_conf(args.slurm_conf).nodes) if args.slurm_conf else None
    plan = block.plan(records, known)
    for line in plan.warnings:
        print(f"topology: warning: {line}", file=sys.stderr)
    for node, why in sorted(plan.left_out.items()):
        print(f"topology: {node}: left out of every block: {why}", file=sys.stderr)
    try:
        name, text = block.render(plan, version_of(args))
    except block.VersionError as exc:
        print(f"topology: generate: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"topology: generate: couldn't write a block topology: {exc}", file=sys.stderr)
        return 1
    sizes = sorted({len(b.nodes) for b in plan.blocks})
    print(f"topology: {sum(len(b.nodes) for b in plan.blocks)} nodes in {len(plan.blocks)} "
          f"NVLink blocks (sizes {', '.join(map(str, sizes))}), {len(plan.left_out)} left out")
    if args.dry_run:
        return 0
    cfg = config.load(args.config).topology
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, name)
    generate.write_atomic(path, text)
    print(f"topology: wrote {path}")
    # job_submit.lua pins a job to one block as to one leaf: the blocks are its leaves.
    slurm = parse_slurm_conf(args.slurm_conf) if args.slurm_conf else None
    data = os.path.join(args.out_dir, generate.DATA_FILE)
    generate.write_atomic(data, block.lua_data(plan, cfg, slurm))
    print(f"topology: wrote {data}")
    if plan.left_out:
        print(f"topology: {len(plan.left_out)} node(s) in no block (listed above): Slurm "
              "cannot place them until their fabric is repaired and this is rerun",
              file=sys.stderr)
    return 0
