"""``slurm-resilience topology generate|check``: fabric → topology.conf, leaf features, Lua data."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from slurm_resilience import config
from slurm_resilience.cli import UsageError
from slurm_resilience.config.topology import TopologySection
from slurm_resilience.topology import block_cli, generate, ibnetdiscover, model, validate
from slurm_resilience.topology.slurmconf import SlurmNodes, parse_slurm_conf

MAX_LISTED = 20


def register(sub: Any) -> None:
    p = sub.add_parser("topology", help="InfiniBand fabric or NVLink domains → topology.conf "
                                        "(or topology.yaml), leaf features, job_submit.lua data")
    tsub = p.add_subparsers(dest="topology_command", metavar="ACTION", required=True)
    gen = tsub.add_parser("generate", help="build the fabric model and write the outputs")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-ibnetdiscover", metavar="FILE",
                     help="an ibnetdiscover capture (default or -p format)")
    src.add_argument("--from-topology-conf", metavar="FILE", help="an existing topology.conf")
    src.add_argument("--from-nvlink-domains", metavar="FILE", nargs="+",
                     help="the nodes' NVLink domain records (nvlink-domain.json in each node's "
                          "health state, GB200 NVL72): one Slurm block per domain, written as "
                          "topology.conf (Slurm 23.11-25.05) or topology.yaml (25.05+)")
    src.add_argument("--from-agents", action="store_true",
                     help="the same records, scraped from every node's agent (metrics "
                          "endpoint, at the node's address in Slurm): no shared filesystem")
    gen.add_argument("--slurm-version", metavar="X.Y",
                     help="the Slurm whose block topology file to write (default: scontrol "
                          "--version); below 23.11 there is no topology/block")
    gen.add_argument("--slurm-conf", metavar="FILE",
                     help="slurm.conf: hosts it lacks are left out (ibnetdiscover) or refused "
                          "(topology.conf); partitions size the leaves per partition")
    gen.add_argument("--site-map", metavar="FILE",
                     help="YAML with 'switches' (GUID or derived name → name) and 'hosts' "
                          "(HCA GUID → host)")
    gen.add_argument("--out-dir", metavar="DIR", default=".",
                     help="where to write topology.conf, leaf-features.conf and the Lua data "
                          "(default: .)")
    gen.add_argument("--apply-features", action="store_true",
                     help="also set each node's leaf feature in slurmctld (scontrol update)")
    gen.add_argument("--dry-run", action="store_true", help="check and report, write nothing")
    gen.set_defaults(func=run_generate)
    chk = tsub.add_parser("check", help="check a topology.conf for what slurmctld rejects")
    chk.add_argument("file", help="topology.conf to check")
    chk.add_argument("--slurm-conf", metavar="FILE", help="slurm.conf whose nodes are known")
    chk.set_defaults(func=run_check)


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError as exc:
        raise UsageError(f"topology: read: couldn't read {what} {path}: "
                                 f"{exc.strerror}") from None


def load_site_map(path: str) -> model.SiteMap:
    """Read and check a site map; every bad entry is named."""
    try:
        data = yaml.safe_load(_read(path, "site map")) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"topology: site map {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"switches", "hosts"}:
        raise UsageError(f"topology: site map {path}: expected a mapping with keys "
                                 "'switches' and/or 'hosts'")
    out: dict[str, dict[str, str]] = {}
    for section in ("switches", "hosts"):
        entries = data.get(section) or {}
        if not isinstance(entries, dict):
            raise UsageError(f"topology: site map {path}: {section}: expected a mapping")
        clean: dict[str, str] = {}
        for key, value in entries.items():
            if not isinstance(value, str) or not model.SWITCH_NAME.match(value):
                raise UsageError(
                    f"topology: site map {path}: {section}.{key}: {value!r} is not a valid "
                    "name (letters, digits, '_', '.', '-')")
            clean[model.norm_site_guid(str(key))] = value
        out[section] = clean
    return model.SiteMap(out["switches"], out["hosts"])


def build(args: argparse.Namespace, cfg: TopologySection
          ) -> tuple[model.Fabric, SlurmNodes | None, list[validate.Finding]]:
    """The fabric, slurm.conf's nodes (if given) and every finding."""
    slurm_path = args.slurm_conf
    slurm = parse_slurm_conf(slurm_path) if slurm_path else None
    known = list(slurm.nodes) if slurm else None
    site = load_site_map(args.site_map) if args.site_map else None
    if args.from_ibnetdiscover:
        path = args.from_ibnetdiscover
        try:
            disc = ibnetdiscover.parse(_read(path, "ibnetdiscover capture"))
        except ibnetdiscover.ParseError as exc:
            raise UsageError(f"topology: parse: {path}: {exc}") from None
        fabric = model.from_discovery(disc, cfg, site, source=os.path.basename(path))
        if slurm is not None:
            fabric = fabric.renamed(slurm.node_names_for(fabric.nodes))
            fabric = fabric.restricted_to(slurm.nodes, why="not in slurm.conf")
        return fabric, slurm, validate.check_fabric(fabric, known)
    path = args.from_topology_conf
    try:
        lines = validate.parse_topology_conf(_read(path, "topology.conf"))
    except ValueError as exc:
        raise UsageError(f"{exc} ({path})") from None
    findings = validate.check_lines(lines, known)
    fabric = model.from_switch_lines(lines, source=os.path.basename(path))
    if not any(f.error for f in findings):
        rooted = model.add_root(fabric, cfg.root_switch)
        findings += [validate.Finding(False, fabric.source, w) for w in rooted.warnings]
        fabric = rooted
    return fabric, slurm, findings


def report(fabric: model.Fabric, findings: list[validate.Finding]) -> None:
    """Findings and left-out HCAs on stderr, so a cron job's mail shows them."""
    for finding in findings:
        print(f"topology: {finding}", file=sys.stderr)
    for title, hcas in (("unknown host", fabric.unknown_hcas),
                        ("storage or service host, kept out", fabric.storage_hcas)):
        if not hcas:
            continue
        print(f"topology: {len(hcas)} HCA(s) {title}:", file=sys.stderr)
        for hca in hcas[:MAX_LISTED]:
            where = f" on {hca.switch}" if hca.switch else ""
            print(f"  0x{hca.guid} {hca.description!r}{where}: {hca.reason}", file=sys.stderr)
        if len(hcas) > MAX_LISTED:
            print(f"  ... and {len(hcas) - MAX_LISTED} more", file=sys.stderr)


def summary(fabric: model.Fabric) -> str:
    groups = sum(1 for lf in fabric.leaves if lf.rail_group)
    sizes = sorted((len(lf.nodes) for lf in fabric.leaves), reverse=True)
    largest = sizes[0] if sizes else 0
    return (f"{len(fabric.nodes)} nodes on {len(fabric.leaves)} leaves ({groups} rail groups, "
            f"largest {largest} nodes), {len(fabric.uppers)} switches above")


def run_generate(args: argparse.Namespace) -> int:
    if args.from_nvlink_domains or args.from_agents:
        return block_cli.run(args)
    cfg = config.load(args.config).topology
    fabric, slurm, findings = build(args, cfg)
    report(fabric, findings)
    if any(f.error for f in findings):
        print("topology: generate: couldn't write outputs: the errors above would make "
              "slurmctld reject or misuse them", file=sys.stderr)
        return 1
    print(f"topology: {summary(fabric)}")
    if args.dry_run:
        return 0
    outputs = generate.render(fabric, cfg, slurm)
    for path in generate.write_outputs(outputs, args.out_dir):
        print(f"topology: wrote {path}")
    print(f"topology: install {generate.DATA_FILE} beside slurm.conf and job_submit.lua, then "
          "touch job_submit.lua (slurmctld reloads the script, and its data, when it changes)")
    if args.apply_features:
        from slurm_resilience.slurm.adapter import from_config

        adapter = from_config(config.load(args.config))
        changed = generate.apply_features(adapter, fabric, cfg)
        print(f"topology: leaf features set on {changed} node(s)")
    return 0


def run_check(args: argparse.Namespace) -> int:
    text = _read(args.file, "topology.conf")
    known: Mapping[str, Any] | None = parse_slurm_conf(args.slurm_conf).nodes \
        if args.slurm_conf else None
    try:
        lines = validate.parse_topology_conf(text)
    except ValueError as exc:
        raise UsageError(f"{exc} ({args.file})") from None
    findings = validate.check_lines(lines, known)
    for finding in findings:
        print(f"topology: {args.file}: {finding}", file=sys.stderr)
    if any(f.error for f in findings):
        return 1
    print(f"topology: {args.file}: {len(lines)} switches, no errors")
    return 0
