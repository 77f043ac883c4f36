"""``slurm-resilience install node|controller|spank|slurm-conf`` (and ``--uninstall``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from slurm_resilience.install import assets, conf_step, slurmconf, spank, targets
from slurm_resilience.install.files import Change

DEFAULT_SLURM_CONF = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))


def register(sub: Any) -> None:
    p = sub.add_parser("install", help="put hooks, unit, job_submit.lua or the SPANK plugin "
                                       "into place on this host (idempotent)")
    isub = p.add_subparsers(dest="install_command", metavar="TARGET", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--prefix", type=Path, default=Path(sys.prefix),
                       help=f"the virtualenv holding this package (default: {sys.prefix})")
        q.add_argument("--config-dir", type=Path, default=Path("/etc/slurm-resilience"),
                       help="where config.example.yaml goes (default: /etc/slurm-resilience)")
        q.add_argument("--slurm-conf", type=Path, default=DEFAULT_SLURM_CONF,
                       help=f"this host's slurm.conf (default: $SLURM_CONF or "
                            f"{DEFAULT_SLURM_CONF})")
        q.add_argument("--json", action="store_true",
                       help="print {'changed': bool, 'files': [...]} instead of lines")
        q.add_argument("--dry-run", action="store_true",
                       help="change nothing; report what would change")
        q.add_argument("--uninstall", action="store_true",
                       help="remove what this target installs (a site's own files, such as "
                            "its job_submit.lua, stay)")

    n = isub.add_parser("node", help="hook wrappers into PREFIX/hooks, the agent's systemd unit")
    common(n)
    n.add_argument("--hooks-dir", type=Path,
                   help="where the prolog, epilog and healthcheck wrappers go "
                        "(default: PREFIX/hooks; they find PREFIX/bin/python3 from there)")
    n.add_argument("--systemd-dir", type=Path, default=Path("/etc/systemd/system"),
                   help="where slurm-resilience-agent.service goes (default: /etc/systemd/system)")
    n.add_argument("--no-unit", action="store_true", help="don't install the systemd unit")
    n.set_defaults(func=run_node)

    c = isub.add_parser("controller", help="job_submit.lua beside slurm.conf")
    common(c)
    c.set_defaults(func=run_controller)

    s = isub.add_parser("spank", help="build the SPANK plugin against this host's Slurm and "
                                      "install it (rebuilt when source or Slurm version changes)")
    common(s)
    s.add_argument("--plugin-dir", type=Path,
                   help="Slurm's plugin directory (default: PluginDir= of --slurm-conf, else "
                        "found from libslurm's location)")
    s.add_argument("--build-dir", type=Path,
                   help="where the plugin is built and its stamp kept "
                        "(default: PREFIX/spank-build)")
    s.add_argument("--plugstack", type=Path,
                   help="plugstack.conf to list the plugin in (default: beside --slurm-conf)")
    s.add_argument("--no-plugstack", action="store_true",
                   help="leave plugstack.conf alone")
    s.set_defaults(func=run_spank)

    k = isub.add_parser("slurm-conf", help="merge our settings into slurm.conf (and the files "
                                           "it includes) without replacing the site's")
    common(k)
    k.add_argument("--hooks-dir", type=Path,
                   help="where the hook wrappers are (default: PREFIX/hooks)")
    k.add_argument("--health-check-interval", type=int, default=300,
                   help="HealthCheckInterval= where the site has none or 0 (default: 300)")
    k.add_argument("--diff", action="store_true",
                   help="also print a unified diff of the lines that change")
    k.set_defaults(func=run_slurm_conf)


def _paths(args: argparse.Namespace) -> targets.Paths:
    prefix = args.prefix.absolute()
    hooks = getattr(args, "hooks_dir", None) or prefix / "hooks"
    systemd = None if getattr(args, "no_unit", True) else args.systemd_dir
    return targets.Paths(prefix=prefix, hooks_dir=hooks, config_dir=args.config_dir,
                         systemd_dir=systemd, slurm_conf=args.slurm_conf)


def _report(args: argparse.Namespace, changes: list[Change], diff: str = "") -> int:
    changed = any(c.changed for c in changes)
    would = "would be " if args.dry_run else ""
    if args.json:
        out: dict[str, Any] = {"changed": changed, "dry_run": args.dry_run, "files": [
            {"path": str(c.path), "action": c.action.value, "detail": c.detail}
            for c in changes]}
        if diff or getattr(args, "diff", False):
            out["diff"] = diff
        print(json.dumps(out))
    else:
        for c in changes:
            print(f"{would}{c.action.value:9} {c.path}" + (f"  ({c.detail})" if c.detail else ""))
        print(f"{sum(c.changed for c in changes)} of {len(changes)} {would or ''}changed")
        if getattr(args, "diff", False):
            print(diff, end="")
    return 0


def _fail(exc: Exception) -> int:
    print(f"slurm-resilience: {exc}", file=sys.stderr)
    return 1


def run_node(args: argparse.Namespace) -> int:
    try:
        if args.uninstall:
            return _report(args, targets.remove_node(_paths(args), args.dry_run))
        return _report(args, targets.node(assets.find(), _paths(args), args.dry_run))
    except (assets.AssetError, OSError) as exc:
        return _fail(exc)


def run_controller(args: argparse.Namespace) -> int:
    try:
        if args.uninstall:
            return _report(args, targets.remove_controller(_paths(args), args.dry_run))
        return _report(args, targets.controller(assets.find(), _paths(args), args.dry_run))
    except (assets.AssetError, OSError) as exc:
        return _fail(exc)


def run_slurm_conf(args: argparse.Namespace) -> int:
    paths = _paths(args)
    try:
        done = conf_step.run(paths.slurm_conf, paths.hooks_dir, args.health_check_interval,
                             uninstall=args.uninstall, dry_run=args.dry_run)
    except (slurmconf.ConfError, OSError) as exc:
        return _fail(exc)
    return _report(args, done.changes, done.diff)


def run_spank(args: argparse.Namespace) -> int:
    from slurm_resilience.proc import Runner

    paths = _paths(args)
    plugstack = None if args.no_plugstack else (args.plugstack
                                               or paths.slurm_conf_dir / "plugstack.conf")
    where = targets.SpankPaths(build_dir=args.build_dir or paths.prefix / "spank-build",
                               plugin_dir=args.plugin_dir, plugstack=plugstack)
    try:
        if args.uninstall:
            return _report(args, targets.remove_spank(paths, where, Runner(), args.dry_run))
        return _report(args, targets.spank_plugin(assets.find(), paths, where, Runner(),
                                                  args.dry_run))
    except (assets.AssetError, spank.SpankError, OSError) as exc:
        return _fail(exc)
