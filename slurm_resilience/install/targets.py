"""What each role of host gets: the steps behind ``install node|controller|spank``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.install import assets, spank
from slurm_resilience.install.files import Action, Change, drop_line, ensure_line, place, remove
from slurm_resilience.proc import Runner

# The units as shipped name the default prefix; other prefixes get their own ExecStart.
_DEFAULT_BIN = "/opt/slurm-resilience/bin/"


@dataclass(frozen=True)
class Paths:
    """Where things go on the target; every one is a command-line option."""

    prefix: Path
    hooks_dir: Path
    config_dir: Path
    systemd_dir: Path | None  # None: no unit
    slurm_conf: Path

    @property
    def slurm_conf_dir(self) -> Path:
        return self.slurm_conf.parent


# The first line of our job_submit.lua: a file without it is the site's own.
_JOB_SUBMIT_MARK = b"slurm-resilience job_submit.lua"


def _example_config(src: assets.Assets, paths: Paths, dry_run: bool) -> Change:
    return place(paths.config_dir / assets.EXAMPLE_CONFIG,
                 (src.conf / assets.EXAMPLE_CONFIG).read_bytes(), 0o644,
                 "every setting with its default", dry_run=dry_run)


def node(src: assets.Assets, paths: Paths, dry_run: bool = False) -> list[Change]:
    """Hook wrappers (Prolog=, Epilog=, HealthCheckProgram=), the agent's and the hook
    server's units, the example."""
    out = [place(paths.hooks_dir / h, (src.hooks / h).read_bytes(), 0o755, "hook wrapper",
                 dry_run=dry_run)
           for h in assets.HOOKS]
    if paths.systemd_dir is not None:
        for name, what in ((assets.UNIT, "node agent"), (assets.HOOKS_UNIT, "hook server")):
            unit = (src.conf / name).read_text().replace(_DEFAULT_BIN, f"{paths.prefix}/bin/")
            out.append(place(paths.systemd_dir / name, unit.encode(), 0o644, what,
                             dry_run=dry_run))
    out.append(_example_config(src, paths, dry_run))
    return out


def _site_job_submit(path: Path) -> bool:
    """A job_submit.lua is there and is not ours (the site's own script)."""
    try:
        with open(path, "rb") as fh:
            return _JOB_SUBMIT_MARK not in fh.read(512)
    except FileNotFoundError:
        return False


def controller(src: assets.Assets, paths: Paths, dry_run: bool = False) -> list[Change]:
    """job_submit.lua beside slurm.conf (where slurmctld's lua plugin loads it), the example.

    A site's own job_submit.lua is never replaced: ours is left out, and the report says so.
    """
    dest = paths.slurm_conf_dir / assets.JOB_SUBMIT
    if _site_job_submit(dest):
        lua = Change(dest, Action.UNCHANGED,
                     f"the site's own job_submit.lua kept; ours ({src.hooks / assets.JOB_SUBMIT})"
                     " is not installed: merge it into the site's by hand")
    else:
        lua = place(dest, (src.hooks / assets.JOB_SUBMIT).read_bytes(), 0o644,
                    "JobSubmitPlugins=lua", dry_run=dry_run)
    return [lua, _example_config(src, paths, dry_run)]


def remove_node(paths: Paths, dry_run: bool = False) -> list[Change]:
    """What :func:`node` put in place, and the site-program files of the hooks, gone."""
    out = [remove(paths.hooks_dir / h, "hook wrapper", dry_run=dry_run) for h in assets.HOOKS]
    out += [remove(paths.hooks_dir / f"{h}.site", "site program run by our hook",
                   dry_run=dry_run) for h in assets.HOOKS]
    if paths.systemd_dir is not None:
        out += [remove(paths.systemd_dir / name, "unit", dry_run=dry_run)
                for name in (assets.UNIT, assets.HOOKS_UNIT)]
    out.append(remove(paths.config_dir / assets.EXAMPLE_CONFIG, "example", dry_run=dry_run))
    return out


def remove_controller(paths: Paths, dry_run: bool = False) -> list[Change]:
    """Our job_submit.lua (never the site's own) and the example, gone."""
    dest = paths.slurm_conf_dir / assets.JOB_SUBMIT
    lua = (Change(dest, Action.UNCHANGED, "the site's own job_submit.lua kept")
           if _site_job_submit(dest) else remove(dest, "JobSubmitPlugins=lua", dry_run=dry_run))
    return [lua, remove(paths.config_dir / assets.EXAMPLE_CONFIG, "example", dry_run=dry_run)]


@dataclass(frozen=True)
class SpankPaths:
    build_dir: Path
    plugin_dir: Path | None  # None: ask the target's Slurm
    plugstack: Path | None  # None: leave plugstack.conf alone


def _plugin_dir(paths: Paths, where: SpankPaths, runner: Runner) -> spank.PluginDir:
    pdir = (spank.PluginDir(where.plugin_dir, "--plugin-dir") if where.plugin_dir
            else spank.find_plugin_dir(runner, paths.slurm_conf))
    if not pdir.path.is_dir():
        raise spank.SpankError(f"install spank: plugin directory {pdir.path} ({pdir.source}) "
                               "does not exist")
    return pdir


def spank_plugin(src: assets.Assets, paths: Paths, where: SpankPaths,
                 runner: Runner, dry_run: bool = False) -> list[Change]:
    """Build against this host's Slurm (only when source or version changed), then install."""
    version = spank.slurm_version(runner)
    pdir = _plugin_dir(paths, where, runner)
    target = pdir.path / spank.PLUGIN
    if dry_run:
        fresh = spank.fresh_build(src.spank, where.build_dir, version)
        built = Change(where.build_dir / spank.PLUGIN,
                       Action.UNCHANGED if fresh else Action.UPDATED, f"built for {version}")
        out = [built, (place(target, fresh, 0o755, f"plugin dir from {pdir.source}",
                             dry_run=True) if fresh is not None
                       else Change(target, Action.UPDATED, "would be rebuilt and installed"))]
    else:
        data, built = spank.build(runner, src.spank, where.build_dir, version)
        out = [built, place(target, data, 0o755, f"plugin dir from {pdir.source}")]
    if where.plugstack is not None:
        out.append(ensure_line(where.plugstack, f"optional {target}", dry_run=dry_run))
    return out


def remove_spank(paths: Paths, where: SpankPaths, runner: Runner,
                 dry_run: bool = False) -> list[Change]:
    """The plugin, its plugstack.conf line and its build directory, gone."""
    target = _plugin_dir(paths, where, runner).path / spank.PLUGIN
    out = []
    if where.plugstack is not None:
        out.append(drop_line(where.plugstack, f"optional {target}", dry_run=dry_run))
    out.append(remove(target, "SPANK plugin", dry_run=dry_run))
    if where.build_dir.is_dir():
        for f in sorted(where.build_dir.iterdir()):
            out.append(remove(f, "build", dry_run=dry_run))
    out.append(remove(where.build_dir, "build directory", dry_run=dry_run))
    return out
