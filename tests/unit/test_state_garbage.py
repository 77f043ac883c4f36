"""Garbage in every state file a hook or the agent reads: each reader sets the file aside
or ignores it with a log event, never crashes, never passes a sick node, never drains a
healthy one (issue 13, item 10)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import logged

from slurm_resilience import config, log
from slurm_resilience.config import Config
from slurm_resilience.health import gate
from slurm_resilience.health import steps as health_steps
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.sandbox import faults, hardware
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import Answer, FakeRunner, completed

NODE = "node1"

# Every health state key, holding a value of the wrong type: a reader that trusts the shape
# of what it reads crashes on one of them.
POISON: dict[str, Any] = {
    "sw_thermal_streak": "x", "counters": {"mlx5_0/1": "x", "mlx5_1/1": {"symbol_error": "x"}},
    "events": {"e": 5, "f": "x"}, "by_pci": ["a", "b"], "streak": "many", "drained": "yes",
    "failed_jobs": "x", "reasons": 5, "1": "not-a-time", "job_id": 7, "restart": "many",
    "decision": 5, "blame": "x", "state": 3, "steps": ["x"], "timeout_s": "x",
}


def garbage(kind: str, boot_id: str = "") -> bytes:
    """One kind of broken content for a state file."""
    if kind == "empty":
        return b""
    if kind == "truncated":
        return b'{"events": {"a": [1, '
    if kind == "binary":
        return bytes(range(256)) * 8
    if kind == "list":
        return b"[1, 2, 3]"
    if kind == "huge":
        return b'{"x": "' + b"a" * (9 << 20) + b'"}'
    if kind == "wrong-types":
        return json.dumps({**POISON, "boot_id": boot_id}).encode()
    raise AssertionError(kind)


KINDS = ("empty", "truncated", "binary", "list", "huge", "wrong-types")
HEALTH_FILES = ("gpu", "xid", "infiniband", "nvme", "gpu_map")


def load(tmp_path: Path) -> Config:
    """Every health check on a stand-in node (8 GPUs, 8 HCAs, a kernel log, an NVMe)."""
    root = f"{tmp_path}/nodes/{{node}}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "node": {"state_dir": f"{root}/state"},
        "logging": {"syslog": False},
        "health": {
            "backend": "fake", "scenario_dir": f"{tmp_path}/scenarios",
            "collector_timeout_s": 10, "gpu": {"expected_count": 8}, "resume_after_passes": 2,
            "xid": {"source": "file", "path": f"{root}/kmsg",
                    "boot_id_file": f"{root}/boot_id"},
            "infiniband": {"sysfs_root": f"{root}/sys/class/infiniband", "min_rate_gbps": 400,
                           "expected_hcas": [f"mlx5_{i}" for i in range(8)]},
            "nvme": {"path": f"{root}/nvme", "size_limit": 100 << 30, "min_free": 10 << 30,
                     "smart": False}}}))
    return config.load(str(path))


@pytest.fixture
def node(tmp_path: Path) -> Path:
    hardware.prepare_node_hardware(tmp_path, [NODE])
    return tmp_path


def _spoil(node: Path, name: str, kind: str) -> Path:
    cfg = load(node)
    state = Path(gate.state_dir(cfg, NODE))
    state.mkdir(parents=True, exist_ok=True)
    boot = (node / "nodes" / NODE / "boot_id").read_text().strip()
    path = state / f"{name}.json"
    path.write_bytes(garbage(kind, boot))
    return path


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", HEALTH_FILES)
def test_health_state_garbage_never_passes_a_sick_node(node: Path, events: Path, name: str,
                                                        kind: str) -> None:
    """A lost GPU is found whatever the state files hold, and the broken file is named."""
    gate.run(load(node), NODE, "healthcheck")  # a first run writes real state beside it
    _spoil(node, name, kind)
    faults.inject(node, NODE, "gpu-xid:3:79")
    report = gate.run(load(node), NODE, "healthcheck")
    assert not report.verdict.healthy
    assert any("gpu3" in f.message for f in report.verdict.blocking)
    if kind != "empty" and (name, kind) != ("nvme", "wrong-types"):  # nvme keeps no state
        assert any(e.get("path", "").endswith(f"{name}.json") for e in logged(events)), \
            logged(events)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", HEALTH_FILES)
def test_health_state_garbage_never_fails_a_healthy_node(node: Path, events: Path, name: str,
                                                          kind: str) -> None:
    gate.run(load(node), NODE, "healthcheck")
    _spoil(node, name, kind)
    report = gate.run(load(node), NODE, "healthcheck")
    assert report.verdict.healthy, [f.message for f in report.verdict.blocking]
    # The next run is back to normal: the broken file was replaced or set aside.
    assert gate.run(load(node), NODE, "healthcheck").verdict.healthy


LINE = "NodeName=node1 CPUAlloc=0 CPUTot=2 State=IDLE+DRAIN Partitions=debug Reason={reason}"
OUR_DRAIN = "SR: health: mlx5_3 port1 DOWN (expected ACTIVE) [root@t]"


def _hook(cfg: Config, kind: str, runner: FakeRunner | None = None) -> HookContext:
    return HookContext(kind=kind, cfg=cfg, node=NODE, env={}, job_id=42,  # type: ignore[arg-type]
                       _adapter=SlurmAdapter(runner=runner or FakeRunner()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["drains", "jobs"])
def test_hook_state_garbage_never_loses_our_drain(node: Path, events: Path, name: str,
                                                   kind: str) -> None:
    """The gate drained the node; then its memory of that (or of job starts) turns to
    garbage. The healthcheck neither crashes nor calls Slurm with garbage, and once the
    node is healthy again our drain is still resumed (a foreign one never is)."""
    cfg = load(node)
    faults.inject(node, NODE, "ib-down:mlx5_3:1")
    assert health_steps.healthcheck(_hook(cfg, "healthcheck"))
    faults.heal(node, NODE)
    _spoil(node, name, kind)
    assert health_steps.epilog(_hook(cfg, "epilog")) == []
    runners = []
    for _ in range(2):
        answers: list[Answer] = [completed(LINE.format(reason=OUR_DRAIN))] * 3
        runner = FakeRunner({"scontrol": [*answers, completed("")]})
        runners.append(runner)
        assert health_steps.healthcheck(_hook(cfg, "healthcheck", runner)) == []
    assert runners[-1].calls[-1] == ["scontrol", "update", "NodeName=node1", "State=RESUME"]
    assert all(c[:2] != ["scontrol", "show"] or "job" not in c for r in runners
               for c in r.calls), "asked Slurm about a job id read from garbage"


# -- the agent's and the other hooks' state files -------------------------------------------


def _nccl_cfg(tmp_path: Path) -> Config:
    from slurm_resilience.config import load_text

    return load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state/{{node}}", f"  run_dir: {tmp_path}/run/{{node}}",
        "nccl:", "  enabled: true", "  backend: gloo", "  processes: 2", "  idle_verify: false",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme/{{node}}"]) + "\n")


@pytest.mark.parametrize("kind", KINDS)
def test_nccl_result_garbage_reads_as_stale_and_is_said(tmp_path: Path, events: Path,
                                                         kind: str) -> None:
    """A garbage nccl-result.json is no result (the next chance re-tests), never a crash,
    never a drain: the healthcheck step returns no problem."""
    from slurm_resilience.nccl import cache
    from slurm_resilience.nccl import steps as nccl_steps

    cfg = _nccl_cfg(tmp_path)
    ctx = HookContext(kind="healthcheck", cfg=cfg, node="n1", env={})
    path = Path(nccl_steps.cache_path(ctx))
    path.parent.mkdir(parents=True)
    path.write_bytes(garbage(kind))
    fresh, _ = nccl_steps.current_freshness(ctx)
    assert not fresh.fresh
    assert nccl_steps.healthcheck(ctx) == []
    if kind not in ("wrong-types",):  # a dict of unknown keys is merely no usable result
        assert any(e.get("path") == str(path) for e in logged(events)), logged(events)
    assert cache.freshness({"verdict": "pass", "cached_at": "x"}, now=1.0, validity_s=9,
                           boot="", fingerprint="").why == "cached result unreadable"


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_journal_garbage_is_quarantined_and_the_agent_goes_on(
        tmp_path: Path, events: Path, kind: str) -> None:
    """A garbage journal record is quarantined with an error event; the agent starts, and
    the next job's start works; `status` lists the quarantined file."""
    from slurm_resilience.agent.service import Peer
    from slurm_resilience.uploader import upload_status
    from slurm_resilience.uploader.service import Uploader

    cfg = _nccl_cfg(tmp_path)
    jdir = upload_status.journal_dir(cfg, "n1")
    jdir.mkdir(parents=True)
    (jdir / "job-5.json").write_bytes(garbage(kind))
    report = upload_status.collect(jdir)  # status reads it first, and never crashes
    assert report["errors"] or report["jobs"] == []
    up = Uploader(cfg, "n1")
    assert 5 not in up.jobs and not (jdir / "job-5.json").exists()
    assert any("quarantined" in str(e["event"]) for e in logged(events))
    assert upload_status.collect(jdir)["quarantined"]
    root = Peer(pid=1, uid=0, gid=0)
    assert up.on_job_start({"job_id": 6, "uid": 1000, "gid": 1000, "user": "u"}, root)["ok"]
    assert Uploader(cfg, "n1").jobs.keys() == {6}


@pytest.mark.parametrize("kind", KINDS)
def test_heartbeat_state_garbage_is_ignored_with_a_word(tmp_path: Path, events: Path,
                                                        kind: str) -> None:
    """The agent's hang-handling state (suspicions, tuned timeouts, incident progress, job
    records, incident reports, the checkpoint facts it reads from the journal): garbage in
    any of them reads as nothing, with a log event or an error line, never a crash."""
    from slurm_resilience.hang import ckptfacts, incident, jobrecord
    from slurm_resilience.hang.store import IncidentStore
    from slurm_resilience.hang.suspect import SuspectHistory
    from slurm_resilience.hang.tune import TunedTimeouts

    state = tmp_path / "hb"
    state.mkdir(mode=0o700)
    (state / "suspicions.json").write_bytes(garbage(kind))
    assert SuspectHistory(str(state / "suspicions.json")).load() == []
    (state / "tune-7.json").write_bytes(garbage(kind))
    assert TunedTimeouts(str(state)).get(7) is None
    (state / "acted").mkdir(mode=0o700)
    (state / "acted" / "7-0").write_bytes(garbage(kind))
    store = IncidentStore(str(state / "acted"))
    assert store.load(7, 0) is None and store.unfinished() == []
    (state / "jobs").mkdir(mode=0o755)
    (state / "jobs" / "7.json").write_bytes(garbage(kind))
    records, errors = jobrecord.read_all(str(state / "jobs"))
    assert records == [] and errors
    (state / "incidents").mkdir(mode=0o700)
    (state / "incidents" / "hang-job7-run0-n1.json").write_bytes(garbage(kind))
    assert incident.reports_of_job(str(state / "incidents"), 7) == []
    assert all(r.error and r.report is None
               for r in incident.list_reports(str(state / "incidents")))
    cfg = _nccl_cfg(tmp_path)
    jdir = Path(ckptfacts.journal_dir(cfg, "n1"))
    jdir.mkdir(parents=True)
    (jdir / "job-7.json").write_bytes(garbage(kind))
    assert ckptfacts.committed_step(cfg, "n1", 7).step == -1
    said = {str(e.get("event")) for e in logged(events)}
    assert len([s for s in said if "couldn't read" in s]) >= 3, said


def test_a_drain_whose_memory_was_lost_is_still_resumed(node: Path) -> None:
    """The gate drained the node while its state dir was unusable, so it kept no memory of
    the drain. Healthy again, the healthcheck still looks at the node every
    LOOK_EVERY_PASSES passes and resumes the drain, which is ours by its owner tag."""
    cfg = load(node)
    faults.inject(node, NODE, "ib-down:mlx5_3:1")
    assert health_steps.healthcheck(_hook(cfg, "healthcheck"))
    (Path(gate.state_dir(cfg, NODE)) / f"{health_steps.OURS}.json").unlink()  # memory lost
    faults.heal(node, NODE)
    for _ in range(health_steps.LOOK_EVERY_PASSES - 1):
        quiet = FakeRunner()
        assert health_steps.healthcheck(_hook(cfg, "healthcheck", quiet)) == []
        assert quiet.calls == []  # no Slurm call on the other passes
    answers: list[Answer] = [completed(LINE.format(reason=OUR_DRAIN))] * 3
    runner = FakeRunner({"scontrol": [*answers, completed("")]})
    assert health_steps.healthcheck(_hook(cfg, "healthcheck", runner)) == []
    assert runner.calls[-1] == ["scontrol", "update", "NodeName=node1", "State=RESUME"]


@pytest.mark.parametrize("kind", KINDS)
def test_intent_record_garbage_is_refused_by_name(kind: str) -> None:
    """An intent record (read back from S3 by every node of a run) that is garbage is
    refused with an error naming where it was, never taken for a node's intent."""
    from slurm_resilience.checkpoint.commit import CheckpointError
    from slurm_resilience.uploader.intent import Intent

    with pytest.raises(CheckpointError, match="run/step-00000005/x: not a valid intent"):
        Intent.from_json(garbage(kind), "run/step-00000005/x")


@pytest.mark.parametrize("log_file", ["/dev/full", "/etc/hostname/sr.jsonl"])
def test_a_broken_log_file_never_fails_a_hook(node: Path, log_file: str,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    """The log disk is full (writes fail with ENOSPC) or the log path can't be opened: the
    hook still runs to its verdict (exit 0 on a healthy node, never a traceback that slurmd
    would turn into its own "Prolog error" drain), and says where its log went."""
    from slurm_resilience.hooks import runner

    load(node)  # writes config.yaml
    data = yaml.safe_load((node / "config.yaml").read_text())
    data["logging"] = {"file": log_file, "syslog": False, "level": "info"}
    cfg = node / "hook.yaml"
    cfg.write_text(yaml.safe_dump(data))
    try:
        code = runner.main("prolog", env={"SLURM_RESILIENCE_CONFIG": str(cfg),
                                          "SLURMD_NODENAME": NODE})
    finally:
        log.reset()
    assert code == 0
    err = capfd.readouterr().err
    assert "couldn't" in err and "log file" in err and '"hook ok"' in err, err


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled up, for the case (root: the suite runs hooks as root)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True,
                   capture_output=True, timeout=30)
    try:
        with contextlib.suppress(OSError), open(mnt / "filler", "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, capture_output=True, timeout=30)


def test_nccl_failure_on_a_full_state_dir_still_drains_and_leaves_no_temp(
        full_dir: Path, events: Path) -> None:
    """A failed NCCL result can't be cached or remembered on a full state dir: the failure
    is still returned (the node drains), the cause is said, and no temp file is left."""
    from slurm_resilience.config import load_text
    from slurm_resilience.nccl import cache
    from slurm_resilience.nccl import steps as nccl_steps

    cfg = load_text(Config, f"node:\n  state_dir: {full_dir}\nnccl:\n  enabled: true\n")
    ctx = HookContext(kind="healthcheck", cfg=cfg, node="n1", env={})
    entry: dict[str, object] = {"verdict": "fail",
                                "reasons": ["gpu0 busbw 1 GB/s (expected >=300)"]}
    assert [p.reason for p in nccl_steps.cached_failure(ctx, entry)] == entry["reasons"]
    said = [str(e["event"]) for e in logged(events)]
    assert "nccl: couldn't record the reasons we drain with" in said, said
    assert "nccl: couldn't mark the failure reported" in said, said
    with pytest.raises(OSError):
        cache.write(nccl_steps.cache_path(ctx), entry)
    assert sorted(os.listdir(full_dir)) == ["filler"]


def test_agent_starts_on_a_read_only_state_dir(tmp_path: Path, events: Path) -> None:
    """The node's state_dir turned read-only before the agent (re)starts: every service that
    can run without writing starts, any that can't is named in the log, and the agent
    serves the rest; none takes the others down."""
    import subprocess

    from slurm_resilience.agent.daemon import load_services
    from slurm_resilience.agent.service import AgentContext
    from slurm_resilience.config import load_text

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(state)], check=True,
                   capture_output=True, timeout=30)
    try:
        cfg = load_text(Config, "\n".join([
            "node:", f"  state_dir: {state}", f"  run_dir: {tmp_path}/run",
            "heartbeat:", "  rendezvous: directory", f"  rendezvous_dir: {tmp_path}/hang",
            "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme"]) + "\n")
        first = load_services(AgentContext(cfg, "n1", SlurmAdapter()))  # writes its dirs
        for svc in first:
            svc.close()
        subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True,
                       capture_output=True, timeout=30)
        services = load_services(AgentContext(cfg, "n1", SlurmAdapter()))
        try:
            assert {s.name for s in services} == {s.name for s in first}, logged(events)
        finally:
            for svc in services:
                svc.close()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=True, capture_output=True,
                       timeout=30)


def test_a_service_that_cannot_start_leaves_the_others_running(tmp_path: Path,
                                                                 events: Path) -> None:
    """The checkpoint journal's directory can't be made (a file stands in its way): the
    checkpoint service doesn't start and says why; hang watching, the run-dir sweeper, the
    time-limit warnings and the metrics start all the same."""
    from slurm_resilience.agent.daemon import load_services
    from slurm_resilience.agent.service import AgentContext
    from slurm_resilience.config import load_text

    (tmp_path / "blocker").write_text("not a directory\n")
    cfg = load_text(Config, "\n".join([
        "node:", f"  state_dir: {tmp_path}/state", f"  run_dir: {tmp_path}/run",
        "heartbeat:", "  rendezvous: directory", f"  rendezvous_dir: {tmp_path}/hang",
        "checkpoint:", "  enabled: true", f"  staging_root: {tmp_path}/nvme",
        f"  journal_dir: {tmp_path}/blocker/journal", "metrics:", "  port: 0"]) + "\n")
    services = load_services(AgentContext(cfg, "n1", SlurmAdapter()))
    try:
        assert [s.name for s in services] == ["heartbeat", "run-dir", "limits", "stragglers",
                                              "goodput", "metrics"]
    finally:
        for svc in services:
            svc.close()
    said = [e for e in logged(events) if "couldn't start" in str(e["event"])]
    assert said and said[0]["service"] == "slurm_resilience.uploader.service:factory"


# -- the state files added later: stragglers, metrics events, NCCL drains, goodput, idle diag --

# Per file, a document of the right outer shape whose fields have the wrong types: the
# case a reader that only checks "is it JSON" trips on.
WRONG_FIELDS = {
    "stragglers": [{"at": "x", "job_id": [1], "ranks": 5, "slowdown": None}],
    "events": {"counters": {"drain|x": "many", "y": -3}, "gate": {"gpu": {"at": [1]}}},
    "ledger": {"job_id": 7, "runs": [{"run": "x", "start": "soon", "end": [],
                                      "ckpt_step": {}}]},
}


def _spoiled(path: Path, kind: str, which: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "wrong-types":
        path.write_text(json.dumps(WRONG_FIELDS[which]))
    else:
        path.write_bytes(garbage(kind))
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_straggler_record_garbage_reads_as_empty_and_is_rewritten(
        tmp_path: Path, events: Path, kind: str) -> None:
    """stragglers.json: read as no entry with a warning naming it; the next naming is kept."""
    from slurm_resilience.stragglers.record import FILENAME, Entry, StragglerRecord

    path = _spoiled(tmp_path / "state" / FILENAME, kind, "stragglers")
    record = StragglerRecord(str(path))
    assert record.load() == []
    assert any(e.get("path") == str(path) for e in logged(events)), logged(events)
    entry = Entry(100.0, 7, (3,), 0.3, "alice")
    assert record.add(entry, now=101.0, window_s=3600) == [entry]
    assert record.load() == [entry]


@pytest.mark.parametrize("kind", KINDS)
def test_metrics_events_garbage_counts_from_zero_and_is_said(
        tmp_path: Path, events: Path, kind: str) -> None:
    """metrics-events.json: counting goes on from zero with a warning; the collector never
    sees an exception other than the ones it reports."""
    from slurm_resilience import events as metric_events

    path = _spoiled(tmp_path / "state" / metric_events.FILENAME, kind, "events")
    with contextlib.suppress(OSError, ValueError):  # the documented ways to refuse a file
        metric_events.read(str(path))
    metric_events.count(str(path), metric_events.DRAIN, "health")
    doc = metric_events.read(str(path))
    assert doc["counters"].get("drain|health") == 1
    assert any(e.get("path") == str(path) for e in logged(events)), logged(events)


@pytest.mark.parametrize("kind", KINDS)
def test_nccl_drains_garbage_is_said_and_only_our_tagged_drain_is_lifted(
        tmp_path: Path, events: Path, kind: str) -> None:
    """nccl-drains.json (the reasons we drained with) turned to garbage: said, never a
    crash. After a passing test our own drain is still lifted, known by its owner tag as
    with lost memory; a drain that is not ours never is. A later failure records afresh."""
    from slurm_resilience.nccl import cache
    from slurm_resilience.nccl import steps as nccl_steps

    cfg = _nccl_cfg(tmp_path)
    line = "NodeName=n1 CPUAlloc=0 CPUTot=2 State=IDLE+DRAIN Partitions=debug Reason={}"
    for reason, lifted in (("Kernel panic [admin@t]", False),
                           ("SR: nccl: gpu0 busbw 1 GB/s [root@t]", True)):
        runner = FakeRunner({"scontrol": [completed(line.format(reason))] * 2
                             + [completed("")]})
        ctx = HookContext(kind="healthcheck", cfg=cfg, node="n1", env={},
                          _adapter=SlurmAdapter(runner=runner))
        path = Path(nccl_steps.drains_path(ctx))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(garbage(kind))
        assert nccl_steps.maybe_resume(ctx) is lifted
        assert bool([c for c in runner.calls if "State=RESUME" in c]) is lifted
    if kind != "wrong-types":  # an object of unknown keys: merely no remembered reason
        assert any(e.get("path") == str(path) for e in logged(events)), logged(events)
    nccl_steps.cached_failure(ctx, {"verdict": "fail", "reasons": ["gpu0 busbw 1 GB/s"]})
    assert cache.read(str(path)) == {"reasons": ["gpu0 busbw 1 GB/s"]}


@pytest.mark.parametrize("kind", KINDS)
def test_goodput_ledger_garbage_starts_afresh_and_the_tick_goes_on(
        tmp_path: Path, events: Path, kind: str) -> None:
    """A job's goodput ledger: garbage is set aside for a fresh ledger with a warning; the
    agent's tick over that job neither raises nor keeps the garbage."""
    from agent_state import slot, view

    from slurm_resilience.goodput.ledger import Ledger

    ledger = Ledger(str(tmp_path / "goodput"))
    path = _spoiled(Path(ledger.path(7)), kind, "ledger")
    ledger.observe([view(7, [slot(r, 5, 1.0, 7) for r in range(8)])], now=1000.0)
    assert any(e.get("path") == str(path) for e in logged(events)), logged(events)
    job = ledger.load(7)
    assert job is not None and job.job_id == 7 and list(job.runs) == [0]


@pytest.mark.parametrize("kind", [*KINDS, "wrong-fields"])
def test_idle_diag_record_garbage_reads_as_no_run(tmp_path: Path, events: Path,
                                                  kind: str) -> None:
    """The idle-diagnostics record: garbage reads as "no run yet" (one is due), is set aside
    with a warning, and never as a failed run that would keep the node drained."""
    from slurm_resilience.health import idle_diag

    store = gate.StateStore(str(tmp_path / "health"))
    path = tmp_path / "health" / f"{idle_diag.RECORD}.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(garbage(kind) if kind != "wrong-fields" else
                     json.dumps({"time": "x", "healthy": "no", "reason": 5}).encode())
    last = idle_diag.IdleRecord.from_state(store.load(idle_diag.RECORD))
    assert last is None and idle_diag.due(last, 1000.0, 3600)
    if kind not in ("wrong-types", "wrong-fields"):  # an object of other fields: no record
        assert any(e.get("path", "").endswith(f"{idle_diag.RECORD}.json")
                   for e in logged(events)), logged(events)
