"""Gather what the doctor's checks judge; the only part of the doctor that does I/O."""

from __future__ import annotations

import glob
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from slurm_resilience.config import lastgood
from slurm_resilience.config.paths import node_path
from slurm_resilience.config.schema import Config
from slurm_resilience.proc import CommandError, CommandTimeout, Runner
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError

# Programs Slurm runs for the node, by slurm.conf key.
PROGRAM_KEYS = ("Prolog", "Epilog", "HealthCheckProgram")
# Our hook wrappers hand over to this module (hooks/prolog and its siblings).
OUR_HOOK_MARK = b"slurm_resilience.hooks"
PLUGIN = "slurm_resilience.so"
PROBE_TIMEOUT_S = 5.0
MAX_INCLUDES = 64


@dataclass(frozen=True)
class Program:
    """One program a slurm.conf key names (a key may name several, comma-separated)."""

    path: str
    exists: bool
    ours: bool


@dataclass(frozen=True)
class Probe:
    """Whether something answered; ``detail`` says what failed (or what answered)."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class HookLimits:
    prolog_timeout_s: float
    epilog_timeout_s: float
    watchdog_grace_s: float


@dataclass(frozen=True)
class Facts:
    """Everything the checks look at; tests build it directly."""

    slurm: Mapping[str, str] | None  # scontrol show config; None: couldn't ask
    slurm_error: str = ""
    programs: Mapping[str, tuple[Program, ...]] = field(default_factory=dict)
    plugstack: str = ""
    plugstack_plugins: tuple[str, ...] | None = None  # None: couldn't read it
    plugstack_error: str = ""
    hooks: HookLimits = HookLimits(20.0, 60.0, 5.0)
    munge: Probe = Probe(True)
    agent: Probe = Probe(True)
    hook_server: Probe = Probe(True)
    config: Probe = Probe(True)
    s3: Probe | None = None  # None: no S3 tier configured
    prefix: str = "/opt/slurm-resilience"  # where our hook wrappers are, for the fixes


def programs(value: str) -> tuple[Program, ...]:
    """The programs a Prolog=/Epilog=/HealthCheckProgram= value names (a comma-separated
    list, each entry a path or a glob), and whether each is one of our hook wrappers."""
    out: list[Program] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        paths = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry]
        for path in paths or [entry]:
            out.append(Program(path, os.path.isfile(path), _is_ours(path)))
    return tuple(out)


_PATH = re.compile(rb"(/[A-Za-z0-9_.+@%/-]+)")


def _head(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(16384)
    except OSError:
        return b""


def _is_ours(path: str) -> bool:
    """Our wrapper, or a site wrapper that runs it (one level: a script that names our
    wrapper's path, as a chain of site programs or the sandbox's does)."""
    head = _head(path)
    if OUR_HOOK_MARK in head:
        return True
    named = {m.decode(errors="replace") for m in _PATH.findall(head)} - {path}
    return any(OUR_HOOK_MARK in _head(p) for p in sorted(named)[:32] if os.path.isfile(p))


def plugstack_plugins(path: str) -> tuple[str, ...]:
    """The plugin paths a plugstack.conf lists, following its ``include`` lines."""
    found: list[str] = []
    todo, seen = [path], 0
    while todo and seen < MAX_INCLUDES:
        current = todo.pop(0)
        seen += 1
        with open(current, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
        for line in lines:
            words = line.split("#", 1)[0].split()
            if len(words) >= 2 and words[0] == "include":
                pattern = os.path.join(os.path.dirname(current), words[1])
                todo += sorted(glob.glob(pattern))
            elif len(words) >= 2 and words[0] in ("required", "optional"):
                found.append(words[1])
    return tuple(found)


def munge_socket(auth_info: str) -> str:
    """The munged socket Slurm uses: ``AuthInfo=socket=PATH,...``; "" for munge's default."""
    for part in auth_info.split(","):
        key, _, value = part.strip().partition("=")
        if key == "socket":
            return value
    return ""


def _munge(runner: Runner, auth_info: str) -> Probe:
    """A credential made and decoded again, through the socket Slurm uses: munged runs
    with a key this host can read."""
    sock = munge_socket(auth_info)
    opt = ["--socket", sock] if sock else []
    try:
        cred = runner.run(["munge", *opt, "-n"], timeout=PROBE_TIMEOUT_S).stdout
        runner.run(["unmunge", *opt], timeout=PROBE_TIMEOUT_S, input_text=cred)
    except (CommandError, CommandTimeout, OSError) as exc:
        return Probe(False, str(exc).strip().splitlines()[-1] if str(exc).strip() else
                     type(exc).__name__)
    return Probe(True)


def _agent(cfg: Config, node: str) -> Probe:
    from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call

    path = node_path(cfg.agent.socket, node)
    try:
        call(path, "ping", timeout=PROBE_TIMEOUT_S)
    except (AgentUnavailable, AgentRefused) as exc:
        return Probe(False, str(exc))
    return Probe(True, path)


def _hook_server(config_source: str, node: str) -> Probe:
    from slurm_resilience.hooks import endpoint

    path = endpoint.socket_path(os.path.realpath(config_source), node)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(PROBE_TIMEOUT_S)
            sock.connect(path)
            # An empty request: a live server answers "refused: request too short" and
            # runs nothing (a socket left by a dead one accepts nothing at all).
            sock.shutdown(socket.SHUT_WR)
            answer = sock.recv(200)
    except OSError as exc:
        return Probe(False, f"couldn't connect to {path}: {exc.strerror or exc}")
    if not answer:
        return Probe(False, f"{path} accepted the connection but did not answer")
    return Probe(True, path)


def s3_probe(cfg: Config) -> Probe | None:
    """The S3 tier answering, when one is configured (None: none is)."""
    ck = cfg.checkpoint
    if not (ck.enabled and ck.allowed_prefix.startswith("s3://")):
        return None
    bucket = ck.allowed_prefix.removeprefix("s3://").split("/", 1)[0]
    try:
        from slurm_resilience.uploader.s3 import S3
        from slurm_resilience.uploader.service import s3_settings

        client = S3(s3_settings(cfg)).client
        if "{" in bucket:  # a per-user bucket: the endpoint answering is what we can check
            client.list_buckets()
        else:
            client.head_bucket(Bucket=bucket)
    except Exception as exc:  # noqa: BLE001 - any failure is the finding, named
        return Probe(False, f"{ck.s3_endpoint or 'AWS'} bucket {bucket}: "
                            f"{type(exc).__name__}: {exc}")
    return Probe(True, f"{ck.s3_endpoint or 'AWS'} bucket {bucket}")


def gather(loaded: lastgood.Loaded, node: str, adapter: SlurmAdapter,
           runner: Runner | None = None) -> Facts:
    """Every fact about this node; each part that fails is itself a fact, never raised."""
    cfg = loaded.cfg
    runner = runner or Runner()
    try:
        slurm: Mapping[str, str] | None = adapter.show_config()
        slurm_error = ""
    except SlurmError as exc:
        slurm, slurm_error = None, str(exc)
    progs = {k: programs(slurm.get(k, "")) for k in PROGRAM_KEYS} if slurm else {}
    plugstack = (slurm or {}).get("PlugStackConfig") or os.path.join(
        os.path.dirname(cfg.slurm.conf or "/etc/slurm/slurm.conf"), "plugstack.conf")
    try:
        plugins: tuple[str, ...] | None = plugstack_plugins(plugstack)
        plug_error = ""
    except OSError as exc:
        plugins, plug_error = None, f"{plugstack}: {exc.strerror or exc}"
    h = cfg.hooks
    return Facts(
        slurm=slurm, slurm_error=slurm_error, programs=progs, plugstack=plugstack,
        plugstack_plugins=plugins, plugstack_error=plug_error,
        hooks=HookLimits(h.prolog_timeout_s, h.epilog_timeout_s, h.watchdog_grace_s),
        munge=_munge(runner, (slurm or {}).get("AuthInfo", "")), agent=_agent(cfg, node),
        hook_server=_hook_server(loaded.source, node),
        config=Probe(loaded.valid, loaded.problem()), s3=s3_probe(cfg), prefix=sys.prefix)
