"""``install slurm-conf``: merge our settings into this host's slurm.conf, or take them out.

The merge itself is :mod:`.slurmconf` (pure); this step reads the files, writes the
ones that change (keeping their mode) and the ``<hook>.site`` files beside our hook
wrappers, which name the site's own program for the wrapper to run too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.install import slurmconf
from slurm_resilience.install.files import Change, mode_of, place, remove


@dataclass(frozen=True)
class Outcome:
    changes: list[Change]
    diff: str
    edits: tuple[slurmconf.Edit, ...]


def site_program_file(hooks_dir: Path, hook: str) -> Path:
    """Where our ``hook`` wrapper finds the site's program it runs too."""
    return hooks_dir / f"{hook}.site"


def _write(path: Path, text: str, why: str, dry_run: bool) -> Change:
    """``text`` into the file ``path`` is, through a site's symlink (slurm.conf shared from
    elsewhere stays shared), with its mode and owner kept."""
    dest = Path(os.path.realpath(path))
    if dest != path:
        why += f", through the link {path}"
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        st = None
    change = place(dest, text.encode(), mode_of(dest), why, dry_run=dry_run)
    if change.changed and not dry_run and st is not None:
        os.chown(dest, st.st_uid, st.st_gid)
    return change


def run(slurm_conf: Path, hooks_dir: Path, interval: int, *, uninstall: bool = False,
        dry_run: bool = False) -> Outcome:
    """Merge (or unmerge) and write; ``dry_run``: compute and report only."""
    tree = slurmconf.load(slurm_conf, slurmconf.read_file, slurmconf.expand_glob)
    want = slurmconf.wanted(hooks_dir, interval)
    result = slurmconf.unmerge(tree, want) if uninstall else slurmconf.merge(tree, want)
    left = slurmconf.still_ours(tree, result, want) if uninstall else []
    if left:
        msg = (f"install slurm-conf: couldn't take our settings out of {slurm_conf}: it (or a "
               f"file it includes) still has {', '.join(left)} without our marker, written "
               "by hand; put the site's own values back on those lines first, or every job "
               "would fail once the hooks are gone")
        raise slurmconf.ConfError(msg)
    changes = []
    for path, text in result.texts.items():
        changes.append(_write(Path(path), text, "our settings taken out" if uninstall
                              else "our settings merged", dry_run))
    for hook in sorted(set(slurmconf.PROGRAM_HOOKS.values())):
        dest = site_program_file(hooks_dir, hook)
        program = result.chained.get(hook)
        if program is None:
            changes.append(remove(dest, "no site program to run", dry_run=dry_run))
        else:
            changes.append(place(dest, (program + "\n").encode(), 0o644,
                                 f"our {hook} runs the site's {program} too", dry_run=dry_run))
    return Outcome(changes, slurmconf.diff(tree, result), result.edits)
