"""``slurm-resilience``: the command-line entry point.

Subcommands live with their code; each module in :data:`COMMANDS` exposes
``register(subparsers)``, which adds its parser and sets ``func``. Modules are
imported only when their command runs, so the prolog path stays light.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from slurm_resilience import __version__
from slurm_resilience.config import ConfigError

# command name → module with register(subparsers); one line per capability.
COMMANDS: dict[str, str] = {
    "config": "slurm_resilience.config.cli",
    "slurm": "slurm_resilience.slurm.cli",
    "sandbox": "slurm_resilience.sandbox.cli",
    "agent": "slurm_resilience.agent.cli",
    "nccl-test": "slurm_resilience.nccl.cli",
    "status": "slurm_resilience.statuscli",
    "report": "slurm_resilience.hang.reportcli",
    "ckpt": "slurm_resilience.uploader.cli",
    "check": "slurm_resilience.health.cli",
    "xid-repaired": "slurm_resilience.health.repaircli",
    "topology": "slurm_resilience.topology.cli",
    "install": "slurm_resilience.install.cli",
    "goodput": "slurm_resilience.goodput.cli",
    "doctor": "slurm_resilience.doctor.cli",
}


class UsageError(Exception):
    """A command was given input it cannot use; the message says what to change."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurm-resilience",
        description="Node health gates, checkpoint staging and hang recovery for Slurm.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--config", metavar="FILE",
        help="configuration file (default: $SLURM_RESILIENCE_CONFIG, then "
             "slurm-resilience.yaml beside $SLURM_CONF or /etc/slurm/slurm.conf, then "
             "/etc/slurm-resilience/config.yaml)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            # Only the command being run is imported; the rest need just a name here.
            sub.add_parser(name, add_help=False)
            continue
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Import only the module of the command being run (cheap --help for the rest).
    only = next((a for a in args_list if a in COMMANDS), None)
    parser = build_parser(only)
    args = parser.parse_args(args_list)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from slurm_resilience import log

    log.configure(mode="cli", level="debug" if args.verbose else "warning")
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"slurm-resilience: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
