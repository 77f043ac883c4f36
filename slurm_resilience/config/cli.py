"""``slurm-resilience config check``: validate a file and print the effective configuration."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from slurm_resilience import config
from slurm_resilience.log import redact


def register(sub: Any) -> None:
    p = sub.add_parser("config", help="validate and show the configuration")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = csub.add_parser("check", help="validate a file and print the effective configuration")
    check.add_argument("file", nargs="?", help="file to check (default: the one in use)")
    check.add_argument("--quiet", "-q", action="store_true", help="print nothing when valid")
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    path = args.file or args.config
    source, _ = config.resolve_path(path)
    cfg = config.load(path)
    if not args.quiet:
        print(f"# {source}: valid. Effective configuration (defaults filled in):")
        # Secrets (S3 keys) are shown as *** so the output can be pasted into a ticket.
        print(yaml.safe_dump(redact(config.to_dict(cfg)), sort_keys=False), end="")
    return 0
