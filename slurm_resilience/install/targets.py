"""What each role of host gets: the steps behind ``install node|controller|spank``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.install import assets, spank
from slurm_resilience.install.files import Change, ensure_line, place
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


def _example_config(src: assets.Assets, paths: Paths) -> Change:
    return place(paths.config_dir / assets.EXAMPLE_CONFIG,
                 (src.conf / assets.EXAMPLE_CONFIG).read_bytes(), 0o644,
                 "every setting with its default")


def node(src: assets.Assets, paths: Paths) -> list[Change]:
    """Hook wrappers (Prolog=, Epilog=, HealthCheckProgram=), the agent's and the hook
    server's units, the example."""
    out = [place(paths.hooks_dir / h, (src.hooks / h).read_bytes(), 0o755, "hook wrapper")
           for h in assets.HOOKS]
    if paths.systemd_dir is not None:
        for name, what in ((assets.UNIT, "node agent"), (assets.HOOKS_UNIT, "hook server")):
            unit = (src.conf / name).read_text().replace(_DEFAULT_BIN, f"{paths.prefix}/bin/")
            out.append(place(paths.systemd_dir / name, unit.encode(), 0o644, what))
    out.append(_example_config(src, paths))
    return out


def controller(src: assets.Assets, paths: Paths) -> list[Change]:
    """job_submit.lua beside slurm.conf (where slurmctld's lua plugin loads it), the example."""
    return [place(paths.slurm_conf_dir / assets.JOB_SUBMIT,
                  (src.hooks / assets.JOB_SUBMIT).read_bytes(), 0o644, "JobSubmitPlugins=lua"),
            _example_config(src, paths)]


@dataclass(frozen=True)
class SpankPaths:
    build_dir: Path
    plugin_dir: Path | None  # None: ask the target's Slurm
    plugstack: Path | None  # None: leave plugstack.conf alone


def spank_plugin(src: assets.Assets, paths: Paths, where: SpankPaths,
                 runner: Runner) -> list[Change]:
    """Build against this host's Slurm (only when source or version changed), then install."""
    version = spank.slurm_version(runner)
    pdir = (spank.PluginDir(where.plugin_dir, "--plugin-dir") if where.plugin_dir
            else spank.find_plugin_dir(runner, paths.slurm_conf))
    if not pdir.path.is_dir():
        raise spank.SpankError(f"install spank: plugin directory {pdir.path} ({pdir.source}) "
                               "does not exist")
    data, built = spank.build(runner, src.spank, where.build_dir, version)
    target = pdir.path / spank.PLUGIN
    out = [built, place(target, data, 0o755, f"plugin dir from {pdir.source}")]
    if where.plugstack is not None:
        out.append(ensure_line(where.plugstack, f"optional {target}"))
    return out
