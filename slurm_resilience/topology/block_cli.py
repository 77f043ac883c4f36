"""``topology generate --from-nvlink-domains``: the nodes' NVLink domain records → Slurm blocks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from slurm_resilience import config
from slurm_resilience.cli import UsageError
from slurm_resilience.health.nvlink_domain import GpuFabric, NodeFabric
from slurm_resilience.metrics.cluster import P, Scrape
from slurm_resilience.topology import block, generate
from slurm_resilience.topology.slurmconf import parse_slurm_conf

MAX_RECORD_BYTES = 1 << 20
SCRAPE_TIMEOUT_S = 5.0  # per agent, as status --cluster


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


def records_from_scrapes(scrapes: list[Scrape]) -> tuple[list[NodeFabric], dict[str, str]]:
    """Each agent's NVLink domain series back into its node's record; nodes whose agent
    could not be scraped, or that exports no record, with why."""
    records, failed = [], {}
    for sc in scrapes:
        if sc.error:
            failed[sc.node] = f"couldn't scrape its agent at {sc.url}: {sc.error}"
            continue
        by_gpu: dict[int, dict[str, Any]] = {}
        when = None
        for name, labels, value in sc.samples:
            short = name.removeprefix(P)
            if short == "gpu_nvlink_domain_timestamp_seconds":
                when = value
            elif short == "gpu_nvlink_domain_info":
                by_gpu.setdefault(int(labels["gpu"]), {}).update(
                    cluster_uuid=labels["cluster_uuid"] or None,
                    clique_id=int(labels["clique_id"]))
            elif short.startswith("gpu_fabric_") and "gpu" in labels:
                key = short.removeprefix("gpu_fabric_")
                # gpu_fabric_health: the summary (promtool refuses a name ending in _summary)
                by_gpu.setdefault(int(labels["gpu"]), {})[
                    "health_summary" if key == "health" else key] = int(value)
        if when is None or not by_gpu:
            failed[sc.node] = "its agent exports no NVLink domain (has its health check run?)"
            continue
        gpus = [GpuFabric(i, d.get("state", 0), d.get("status", 0), d.get("cluster_uuid"),
                          d.get("clique_id"), d.get("health_mask"), d.get("health_summary"))
                for i, d in sorted(by_gpu.items())]
        records.append(NodeFabric(sc.node, when, gpus))
    return records, failed


def scrape_agents(args: argparse.Namespace, known: list[str] | None
                  ) -> tuple[list[NodeFabric], dict[str, str]]:
    from slurm_resilience.metrics.cluster import metrics_urls, scrape_all
    from slurm_resilience.slurm.adapter import from_config

    cfg = config.load(args.config)
    adapter = from_config(cfg)
    nodes = known if known is not None else [n.name for n in adapter.list_nodes()]
    addresses = adapter.node_addresses(nodes)
    urls = metrics_urls(cfg, addresses)
    records, failed = records_from_scrapes(scrape_all(urls, SCRAPE_TIMEOUT_S))
    for node in nodes:
        if node not in urls and node not in failed:
            failed[node] = "no agent endpoint (metrics.port: 0, or Slurm has no address)"
    return records, failed


def version_of(args: argparse.Namespace) -> tuple[int, int]:
    if args.slurm_version:
        try:
            return block.parse_version(args.slurm_version)
        except ValueError as exc:
            raise UsageError(f"topology: --slurm-version: {exc}") from None
    from slurm_resilience.slurm.adapter import from_config

    return from_config(config.load(args.config)).slurm_version()


def run(args: argparse.Namespace) -> int:
    known = list(parse_slurm_conf(args.slurm_conf).nodes) if args.slurm_conf else None
    failed: dict[str, str] = {}
    if args.from_agents:
        from slurm_resilience.slurm.errors import SlurmError

        try:
            records, failed = scrape_agents(args, known)
        except SlurmError as exc:
            print(f"topology: generate: couldn't ask Slurm for the nodes' agents: {exc}",
                  file=sys.stderr)
            return 1
    else:
        records = read_records(args.from_nvlink_domains)
    plan = block.plan(records, known)
    plan.left_out.update(failed)
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
