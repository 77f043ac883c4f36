"""The slurm.conf merge: our settings join a site's instead of replacing them, and come out again.

Pure functions on file texts (slurmconf.load/merge/unmerge/diff); the files here are
the shapes site configurations take: Include files and globs, repeated keys,
comments, keys in any case, continuation lines, several settings on one line.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath

import pytest

from slurm_resilience.install import conf_step, slurmconf
from slurm_resilience.install.slurmconf import ConfError, Tree, effective, load, merge, unmerge

MAIN = PurePath("/etc/slurm/slurm.conf")
HOOKS = PurePath("/opt/slurm-resilience/hooks")
WANT = slurmconf.wanted(HOOKS, 300)

SITE = """\
# site slurm.conf
ClusterName=gpu
SchedulerParameters=bf_continue,bf_window=4320
PrologFlags=Alloc,Contain,X11   # pam_slurm_adopt needs Contain
Prolog=/etc/slurm/prolog.sh
JobSubmitPlugins=lua,require_timelimit
HealthCheckProgram=/usr/sbin/nhc
HealthCheckInterval=600
NodeName=node[1-4] CPUs=64 State=UNKNOWN
PartitionName=gpu Nodes=node[1-4] Default=YES
"""


def _tree(files: dict[PurePath, str]) -> Tree:
    def read(p: PurePath) -> str:
        if p not in files:
            raise FileNotFoundError(2, "No such file or directory", str(p))
        return files[p]

    def expand(p: PurePath) -> list[PurePath]:
        if not any(c in str(p) for c in "*?["):
            return [p]
        return sorted(q for q in files if q.match(str(p)))

    return load(MAIN, read, expand)


def _apply(files: dict[PurePath, str], result: slurmconf.Result) -> dict[PurePath, str]:
    return {**files, **result.texts}


def _settings(files: dict[PurePath, str]) -> dict[str, str | None]:
    tree = _tree(files)
    keys = ("Prolog", "Epilog", "PrologFlags", "HealthCheckProgram", "HealthCheckInterval",
            "HealthCheckNodeState", "SchedulerParameters", "JobSubmitPlugins")
    return {k: effective(tree, k) for k in keys}


def test_site_settings_survive_and_ours_are_added() -> None:
    """A site's list settings keep their items with ours appended; its programs are chained."""
    files = {MAIN: SITE}
    result = merge(_tree(files), WANT)
    got = _settings(_apply(files, result))
    assert got == {
        "Prolog": f"{HOOKS}/prolog", "Epilog": f"{HOOKS}/epilog",
        "PrologFlags": "Alloc,Contain,X11",
        "HealthCheckProgram": f"{HOOKS}/healthcheck", "HealthCheckInterval": "600",
        "HealthCheckNodeState": "ANY",
        "SchedulerParameters": "bf_continue,bf_window=4320,nohold_on_prolog_fail",
        "JobSubmitPlugins": "lua,require_timelimit"}
    assert result.chained == {"prolog": "/etc/slurm/prolog.sh", "healthcheck": "/usr/sbin/nhc"}


def test_only_the_lines_that_change_are_in_the_diff() -> None:
    """The diff shows exactly the lines that change: untouched site lines are context only."""
    files = {MAIN: SITE}
    tree = _tree(files)
    text = slurmconf.diff(tree, merge(tree, WANT))
    removed = [ln for ln in text.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == ["-SchedulerParameters=bf_continue,bf_window=4320",
                       "-Prolog=/etc/slurm/prolog.sh", "-HealthCheckProgram=/usr/sbin/nhc"]
    added = [ln for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert "+Epilog=/opt/slurm-resilience/hooks/epilog" in added
    assert not any("PrologFlags" in ln or "JobSubmitPlugins" in ln for ln in added)


def test_second_merge_changes_nothing_and_still_knows_the_chained_programs() -> None:
    """Merging an already merged file is a no-op that still reports the site programs to chain."""
    files = {MAIN: SITE}
    once = _apply(files, merge(_tree(files), WANT))
    again = merge(_tree(once), WANT)
    assert not again.changed and again.edits == ()
    assert again.chained == {"prolog": "/etc/slurm/prolog.sh", "healthcheck": "/usr/sbin/nhc"}


def test_unmerge_gives_back_the_site_file_byte_for_byte() -> None:
    """Taking our settings out restores the site's file exactly as it was."""
    files = {MAIN: SITE}
    merged = _apply(files, merge(_tree(files), WANT))
    back = _apply(merged, unmerge(_tree(merged), WANT))
    assert back[MAIN] == SITE


def test_unmerge_keeps_what_the_site_changed_after_the_merge() -> None:
    """A site edit made after the merge survives the uninstall; only our items go."""
    files = {MAIN: SITE}
    merged = _apply(files, merge(_tree(files), WANT))
    edited = merged[MAIN].replace("bf_window=4320,", "bf_window=4320,bf_max_job_test=500,")
    edited = edited.replace(f"Prolog={HOOKS}/prolog", "Prolog=/etc/slurm/new-prolog.sh")
    back = _apply({MAIN: edited}, unmerge(_tree({MAIN: edited}), WANT))
    got = _settings(back)
    assert got["SchedulerParameters"] == "bf_continue,bf_window=4320,bf_max_job_test=500"
    assert got["Prolog"] == "/etc/slurm/new-prolog.sh"
    assert "slurm-resilience" not in back[MAIN]


def test_keys_are_matched_without_case_and_items_too() -> None:
    """A site's `prologflags=alloc` already has what we need: nothing is added twice."""
    files = {MAIN: "prologflags=alloc,contain\nschedulerparameters=NOHOLD_ON_PROLOG_FAIL\n"
                   "jobsubmitplugins=Lua\n"}
    result = merge(_tree(files), WANT)
    merged = _apply(files, result)
    assert merged[MAIN].splitlines()[:3] == files[MAIN].splitlines()
    assert "PrologFlags" not in {e.key for e in result.edits}


def test_the_last_of_repeated_keys_is_the_one_edited() -> None:
    """Slurm keeps the last definition of a key, so the merge edits that one only."""
    files = {MAIN: "PrologFlags=X11\nSchedulerParameters=bf_continue\nPrologFlags=Contain\n"}
    merged = _apply(files, merge(_tree(files), WANT))
    lines = merged[MAIN].splitlines()
    assert lines[0] == "PrologFlags=X11"
    assert lines[2].startswith("PrologFlags=Contain,Alloc ")
    assert effective(_tree(merged), "PrologFlags") == "Contain,Alloc"


def test_a_setting_in_an_include_file_is_edited_in_that_file() -> None:
    """Include files are read (relative and glob), and the effective line is edited where it is."""
    sched = PurePath("/etc/slurm/conf.d/10-sched.conf")
    hc = PurePath("/etc/slurm/health.conf")
    files = {MAIN: "ClusterName=c\nInclude conf.d/*.conf\ninclude /etc/slurm/health.conf\n",
             sched: "SchedulerParameters=bf_continue\nPrologFlags=Contain\n",
             hc: "HealthCheckProgram=/usr/sbin/nhc\n"}
    result = merge(_tree(files), WANT)
    assert set(result.texts) == {MAIN, sched, hc}
    merged = _apply(files, result)
    assert merged[sched].startswith("SchedulerParameters=bf_continue,nohold_on_prolog_fail ")
    assert merged[hc].startswith(f"HealthCheckProgram={HOOKS}/healthcheck ")
    assert "HealthCheckProgram" not in merged[MAIN]
    back = _apply(merged, unmerge(_tree(merged), WANT))
    assert back == files


def test_a_missing_include_file_is_an_error_naming_it() -> None:
    """An Include that names no readable file stops the merge with the file's name."""
    with pytest.raises(ConfError, match=r"couldn't read /etc/slurm/gone.conf \(included from"):
        _tree({MAIN: "Include gone.conf\n"})


def test_an_include_loop_is_an_error() -> None:
    """A file that includes itself is reported instead of recursing forever."""
    with pytest.raises(ConfError, match="includes itself"):
        _tree({MAIN: f"Include {MAIN}\n"})


def test_a_continued_line_is_read_whole_and_rewritten_as_one() -> None:
    """A backslash-continued value is one setting; its rewrite keeps every item."""
    files = {MAIN: "SchedulerParameters=bf_continue,\\\nbf_window=4320\nClusterName=c\n"}
    assert effective(_tree(files), "SchedulerParameters") == "bf_continue,bf_window=4320"
    merged = _apply(files, merge(_tree(files), WANT))
    assert merged[MAIN].splitlines()[0].startswith(
        "SchedulerParameters=bf_continue,bf_window=4320,nohold_on_prolog_fail ")
    assert merged[MAIN].splitlines()[1] == "ClusterName=c"


def test_comments_and_commented_out_keys_are_left_alone() -> None:
    """A commented-out setting is not a setting; a site's comment stays on its line."""
    files = {MAIN: "#Prolog=/old\nEpilog=/etc/slurm/epilog.sh # cleanup\n"}
    tree = _tree(files)
    assert effective(tree, "Prolog") is None
    merged = _apply(files, merge(tree, WANT))
    lines = merged[MAIN].splitlines()
    assert lines[0] == "#Prolog=/old"
    assert lines[1] == (f"Epilog={HOOKS}/epilog # cleanup "
                        "# slurm-resilience was: /etc/slurm/epilog.sh")
    assert f"Prolog={HOOKS}/prolog" in merged[MAIN].split("# BEGIN slurm-resilience")[1]


def test_node_and_partition_lines_are_not_global_settings() -> None:
    """Keys on NodeName= and PartitionName= lines describe records, not the cluster."""
    files = {MAIN: "NodeName=n1 Prolog=/x Features=a\nPartitionName=p Nodes=n1\n"}
    assert effective(_tree(files), "Prolog") is None


def test_one_setting_of_several_on_a_line_moves_to_its_own_line() -> None:
    """A line with several settings keeps the others; the edited one gets a line with its marker."""
    files = {MAIN: "Epilog=/e HealthCheckInterval=60\n"}
    merged = _apply(files, merge(_tree(files), WANT))
    assert merged[MAIN].splitlines()[:2] == [
        "HealthCheckInterval=60", f"Epilog={HOOKS}/epilog # slurm-resilience was: /e"]
    assert effective(_tree(merged), "HealthCheckInterval") == "60"


def test_a_disabled_health_check_interval_is_replaced_and_restored() -> None:
    """HealthCheckInterval=0 (health checks off) is replaced by ours, until uninstall."""
    files = {MAIN: "HealthCheckInterval=0\n"}
    merged = _apply(files, merge(_tree(files), WANT))
    assert effective(_tree(merged), "HealthCheckInterval") == "300"
    assert _apply(merged, unmerge(_tree(merged), WANT)) == files


def test_an_empty_program_is_taken_without_chaining_anything() -> None:
    """`Prolog=` (empty) means no site prolog: ours takes it and nothing is chained."""
    files = {MAIN: "Prolog=\n"}
    result = merge(_tree(files), WANT)
    assert "prolog" not in result.chained
    merged = _apply(files, result)
    assert _apply(merged, unmerge(_tree(merged), WANT)) == files


def test_the_old_appended_block_is_replaced_by_a_merge() -> None:
    """A block an earlier release appended (which overrode the site) gives way to a merge."""
    old = ("PrologFlags=Contain\n# BEGIN slurm-resilience\nPrologFlags=Alloc\n"
           "Prolog=/opt/slurm-resilience/hooks/prolog\n# END slurm-resilience\n")
    merged = _apply({MAIN: old}, merge(_tree({MAIN: old}), WANT))
    assert effective(_tree(merged), "PrologFlags") == "Contain,Alloc"
    assert merged[MAIN].count("# BEGIN slurm-resilience") == 1


def test_an_unterminated_block_is_an_error() -> None:
    """A block without its END line is not guessed at."""
    text = "# BEGIN slurm-resilience\nPrologFlags=Alloc\n"
    with pytest.raises(ConfError, match="without"):
        merge(_tree({MAIN: text}), WANT)


def test_an_empty_slurm_conf_gets_every_setting_in_the_block() -> None:
    """With no site settings at all, every one of ours is in the block, and uninstall empties it."""
    files = {MAIN: ""}
    merged = _apply(files, merge(_tree(files), WANT))
    assert _settings(merged)["HealthCheckInterval"] == "300"
    assert len(merged[MAIN].splitlines()) == len(WANT) + 2
    assert _apply(merged, unmerge(_tree(merged), WANT)) == files


def test_step_writes_files_keeps_their_mode_and_names_the_site_programs(tmp_path: Path) -> None:
    """install slurm-conf writes only changed files, keeps their mode, and writes <hook>.site."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(SITE)
    conf.chmod(0o640)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    preview = conf_step.run(conf, hooks, 300, dry_run=True)
    assert conf.read_text() == SITE and not list(hooks.iterdir())
    assert "+Epilog=" in preview.diff
    done = conf_step.run(conf, hooks, 300)
    assert [c.action.value for c in done.changes if c.path == conf] == ["updated"]
    assert conf.stat().st_mode & 0o777 == 0o640
    assert (hooks / "healthcheck.site").read_text() == "/usr/sbin/nhc\n"
    assert not (hooks / "epilog.site").exists()
    assert not any(c.changed for c in conf_step.run(conf, hooks, 300).changes)
    conf_step.run(conf, hooks, 300, uninstall=True)
    assert conf.read_text() == SITE and not list(hooks.iterdir())


def test_uninstall_refuses_while_hand_set_lines_still_name_our_hooks(tmp_path: Path) -> None:
    """Lines set by hand (no marker) that name our hooks stop the uninstall, naming them."""
    conf = tmp_path / "slurm.conf"
    hooks = tmp_path / "hooks"
    conf.write_text(f"Prolog={hooks}/prolog\nPrologFlags=Alloc\n")
    with pytest.raises(ConfError, match=rf"still has Prolog={hooks}/prolog without our marker"):
        conf_step.run(conf, hooks, 300, uninstall=True)
    assert conf.read_text() == f"Prolog={hooks}/prolog\nPrologFlags=Alloc\n"


def test_a_linked_slurm_conf_is_edited_where_it_lives(tmp_path: Path) -> None:
    """A slurm.conf that is a link to a shared file stays a link; the shared file is merged."""
    shared = tmp_path / "shared" / "slurm.conf"
    shared.parent.mkdir()
    shared.write_text("PrologFlags=Contain\n")
    link = tmp_path / "slurm.conf"
    link.symlink_to(shared)
    done = conf_step.run(link, tmp_path / "hooks", 300)
    assert link.is_symlink() and os.readlink(link) == str(shared)
    assert shared.read_text().startswith("PrologFlags=Contain,Alloc ")
    assert "through the link" in next(c.detail for c in done.changes if c.path == shared)
