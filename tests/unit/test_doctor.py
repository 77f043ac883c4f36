"""`slurm-resilience doctor`: each check is a pure function of gathered facts, silent on a
well set-up node and firing, with a fix, on each kind of misconfiguration."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_resilience.config import Config, load_text
from slurm_resilience.doctor import checks, facts
from slurm_resilience.doctor.facts import Facts, HookLimits, Probe, Program
from slurm_resilience.slurm.parse import parse_show_config
from slurm_resilience.uploader.s3 import S3

SHOW_CONFIG = """\
Configuration data as of 2026-11-26T11:00:00
AccountingStorageBackupHost = (null)
HealthCheckInterval     = 300 sec
HealthCheckNodeState    = ANY
HealthCheckProgram      = /opt/slurm-resilience/hooks/healthcheck
PlugStackConfig         = /etc/slurm/plugstack.conf
Prolog                  = /etc/slurm/site-prolog,/opt/slurm-resilience/hooks/prolog
PrologEpilogTimeout     = 65534
PrologFlags             = Alloc,Contain,X11
SchedulerParameters     = bf_continue,nohold_on_prolog_fail
Epilog                  = /opt/slurm-resilience/hooks/epilog
"""


def ours(path: str) -> tuple[Program, ...]:
    return (Program(path, True, True),)


HEALTHY = Facts(
    slurm=parse_show_config(SHOW_CONFIG),
    programs={"Prolog": (Program("/etc/slurm/site-prolog", True, False),
                         *ours("/opt/slurm-resilience/hooks/prolog")),
              "Epilog": ours("/opt/slurm-resilience/hooks/epilog"),
              "HealthCheckProgram": ours("/opt/slurm-resilience/hooks/healthcheck")},
    plugstack="/etc/slurm/plugstack.conf",
    plugstack_plugins=("/usr/lib/x86_64-linux-gnu/slurm-wlm/slurm_resilience.so",),
    hooks=HookLimits(20.0, 60.0, 5.0), s3=Probe(True, "bucket ckpt"),
)


def slurm(**values: str) -> Callable[[Facts], Facts]:
    def change(f: Facts) -> Facts:
        assert f.slurm is not None
        return dataclasses.replace(f, slurm={**f.slurm, **values})
    return change


def programs(key: str, *progs: Program) -> Callable[[Facts], Facts]:
    return lambda f: dataclasses.replace(f, programs={**f.programs, key: progs})


def test_show_config_reads_keys_and_null() -> None:
    """`scontrol show config` lines become keys; "(null)" reads as empty."""
    values = parse_show_config(SHOW_CONFIG)
    assert values["HealthCheckInterval"] == "300 sec"
    assert values["AccountingStorageBackupHost"] == ""
    assert values["PrologFlags"] == "Alloc,Contain,X11"
    assert "Configuration" not in values


def test_a_well_set_up_node_has_no_problems() -> None:
    """The healthy facts (a site prolog beside ours, unlimited PrologEpilogTimeout) pass."""
    assert checks.run(HEALTHY) == []


BROKEN: dict[str, tuple[Callable[[Facts], Facts], str, str]] = {
    "config": (lambda f: dataclasses.replace(f, config=Probe(False, "config: /c.yaml:3: x: "
                                                              "unknown key; gating with y")),
               "unknown key", "config check"),
    "slurm_conf": (lambda f: dataclasses.replace(f, slurm=None, slurm_error="Unable to "
                                                 "contact slurm controller"),
                   "Unable to contact", "scontrol show config"),
    "health_check_interval": (slurm(HealthCheckInterval="0 sec"), "0 sec",
                              "HealthCheckInterval=300"),
    "healthcheckprogram": (programs("HealthCheckProgram", Program("/usr/sbin/nhc", True,
                                                                  False)),
                           "/usr/sbin/nhc, not", "hooks/healthcheck"),
    "prolog": (programs("Prolog"), "names nothing", "hooks/prolog"),
    "epilog": (programs("Epilog", Program("/opt/slurm-resilience/hooks/epilog", False,
                                          False)), "does not exist", "install node"),
    "prolog_epilog_timeout": (slurm(PrologEpilogTimeout="60"), "PrologEpilogTimeout is 60s",
                              "PrologEpilogTimeout=75"),
    "prolog_flags": (slurm(PrologFlags="Contain"), "without Alloc", "add Alloc"),
    "nohold_on_prolog_fail": (slurm(SchedulerParameters="bf_continue"),
                              "lacks nohold_on_prolog_fail", "SchedulerParameters="),
    "plugstack": (lambda f: dataclasses.replace(f, plugstack_plugins=("/x/pyxis.so",)),
                  "does not list slurm_resilience.so", "install spank"),
    "munge": (lambda f: dataclasses.replace(f, munge=Probe(False, "Failed to access "
                                                           "munge.socket.2")),
              "munge.socket.2", "systemctl start munge"),
    "agent": (lambda f: dataclasses.replace(f, agent=Probe(False, "couldn't reach x")),
              "does not answer", "slurm-resilience-agent"),
    "hook_server": (lambda f: dataclasses.replace(f, hook_server=Probe(False, "refused")),
                    "no hook server", "slurm-resilience-hooks"),
    "s3": (lambda f: dataclasses.replace(f, s3=Probe(False, "EndpointConnectionError")),
           "EndpointConnectionError", "s3_endpoint"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_check_fires_with_a_fix(name: str) -> None:
    """One misconfiguration gives exactly its own problem, saying what and how to fix."""
    change, what, fix = BROKEN[name]
    problems = checks.run(change(HEALTHY))
    assert [p.check for p in problems] == [name], problems
    assert what in problems[0].what and fix in problems[0].fix, problems[0]


def test_every_check_has_a_test_that_makes_it_fire() -> None:
    """No check without a case above (hook_programs reports under each key's name)."""
    names = {c.__name__ for c in checks.CHECKS} - {"hook_programs"}
    assert names <= set(BROKEN)


def test_programs_and_plugstack_are_read_from_files(tmp_path: Path) -> None:
    """Our wrapper is recognised by its hand-over line, a site program is not; plugstack
    includes are followed."""
    mine, site = tmp_path / "prolog", tmp_path / "site"
    mine.write_text("#!/bin/sh\nexec python3 -I -m slurm_resilience.hooks prolog\n")
    site.write_text("#!/bin/sh\nexit 0\n")
    got = facts.programs(f"{site},{mine},{tmp_path}/gone")
    assert [(p.path.rsplit("/", 1)[-1], p.exists, p.ours) for p in got] == [
        ("site", True, False), ("prolog", True, True), ("gone", False, False)]
    chain = tmp_path / "chain"  # a site wrapper that runs ours after its own program
    chain.write_text(f"#!/bin/sh\n{site} || exit 1\nexec {mine} \"$@\"\n")
    assert facts.programs(str(chain)) == (Program(str(chain), True, True),)
    (tmp_path / "plugstack.conf.d").mkdir()
    (tmp_path / "plugstack.conf").write_text("include plugstack.conf.d/*.conf\n"
                                             "required /x/pyxis.so  # containers\n")
    (tmp_path / "plugstack.conf.d" / "sr.conf").write_text("optional /y/slurm_resilience.so\n")
    assert facts.plugstack_plugins(str(tmp_path / "plugstack.conf")) == (
        "/x/pyxis.so", "/y/slurm_resilience.so")


def test_munge_is_probed_on_the_socket_slurm_uses() -> None:
    """AuthInfo's socket= is the munged socket Slurm talks to; none means munge's default."""
    assert facts.munge_socket("socket=/run/m/munge.sock,cred_expire=30") == "/run/m/munge.sock"
    assert facts.munge_socket("cred_expire=30") == ""


def test_s3_is_probed_on_the_configured_bucket(s3: S3, moto_endpoint: str) -> None:
    """A real S3 endpoint with the bucket answers; a missing bucket is the finding."""
    def cfg(prefix: str) -> Config:
        return load_text(Config, f"checkpoint:\n  enabled: true\n  allowed_prefix: {prefix}\n"
                                 f"  s3_endpoint: {moto_endpoint}\n  request_timeout_s: 5\n")

    assert facts.s3_probe(Config()) is None
    ok = facts.s3_probe(cfg("s3://ckpt/{user}/"))
    assert ok is not None and ok.ok, ok
    missing = facts.s3_probe(cfg("s3://nosuch/{user}/"))
    assert missing is not None and not missing.ok and "bucket nosuch" in missing.detail
    problems = checks.s3(dataclasses.replace(HEALTHY, s3=missing))
    assert [p.check for p in problems] == ["s3"]
