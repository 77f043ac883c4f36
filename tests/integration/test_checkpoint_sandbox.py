"""Checkpoint staging end to end in the sandbox: real slurmctld/slurmd, prolog/epilog hooks,
one agent per node, the sandbox's rclone S3, and examples/train.py (PyTorch, gloo) run by
an unprivileged test user."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from hang_jobs import s3_stopped

from slurm_resilience.agent import client
from slurm_resilience.sandbox import control, daemons, resilience_conf
from slurm_resilience.sandbox.handle import Sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
PYTHON = REPO / ".venv" / "bin" / "python"




def _train(sandbox: Sandbox, user: str, wd: Path, uri: str, nodes: list[str], args: str,
           before: str = "", after: str = "", spank: bool = False) -> int:
    """Submit examples/train.py with the run URI in the environment or, with ``spank``,
    as the SPANK option --ckpt-uri (the prolog then starts the stage-in)."""
    export = "" if spank else f"export SLURM_RESILIENCE_CKPT_URI={uri}\n"
    script = (f"#!/bin/sh\n{export}{before}"
              f"srun --kill-on-bad-exit=1 -N{len(nodes)} -n{len(nodes)} {PYTHON} -u {TRAIN} "
              f"--state-mb 2 --step-seconds 0.2 {args}\n{after}")
    return sandbox.sbatch(script, user=user, args=[
        f"-N{len(nodes)}", f"-n{len(nodes)}", f"--nodelist={','.join(nodes)}",
        f"--output={wd}/slurm-%j.out", *([f"--ckpt-uri={uri}"] if spank else [])])


def _out(wd: Path, job: int) -> str:
    path = wd / f"slurm-{job}.out"
    return path.read_text() if path.exists() else ""


def _s3_run(sandbox: Sandbox, uri: str) -> Path:
    return sandbox.layout.s3_dir / uri.removeprefix("s3://")


def _ckpt(sandbox: Sandbox, *args: str, check: bool = True) -> str:
    out = sandbox.run([str(PYTHON), "-m", "slurm_resilience", "--config",
                       str(sandbox.resilience_config), "ckpt", *args], check=check, timeout=120)
    return out.stdout + out.stderr


def test_crash_then_new_job_on_other_nodes_resumes_from_s3(sandbox: Sandbox,
                                                          test_users: tuple[str, ...]) -> None:
    """Acceptance: a 2-node run crashes at step 17; a new job with the same URI on two other
    nodes (empty NVMe) stages step 15 from S3, resumes from it and finishes; verify passes."""
    user = test_users[0]
    wd = sandbox.user_dir(user, "ckpt-accept")
    uri = f"s3://ckpt/{user}/accept-{time.time_ns()}"
    first = _train(sandbox, user, wd, uri, ["node1", "node2"],
                   "--steps 25 --ckpt-every 5 --crash-at-step 17")
    info = sandbox.wait_job(first, timeout=180)
    out1 = _out(wd, first)
    assert info.state == "FAILED", out1
    assert "checkpoint step=15" in out1 and "crashing at step=17" in out1
    run = _s3_run(sandbox, uri)
    assert (run / "step-00000015" / "COMMIT.json").is_file(), sorted(
        p.relative_to(run).as_posix() for p in run.rglob("*"))
    for node in ("node3", "node4"):
        nvme = sandbox.layout.node_dir(node) / "nvme"
        assert not nvme.exists() or not any(nvme.glob("job-*/step-*")), node

    second = _train(sandbox, user, wd, uri, ["node3", "node4"], "--steps 25 --ckpt-every 5")
    info = sandbox.wait_job(second, timeout=180)
    out2 = _out(wd, second)
    assert info.state == "COMPLETED", out2
    assert "done step=25 resumed_from=15 restarts=0" in out2
    assert (run / "step-00000025" / "COMMIT.json").is_file()
    report = _ckpt(sandbox, "verify", uri, "--all")
    assert "step-00000015: ok" in report and "step-00000025: ok" in report
    print(f"\nacceptance: first job {first} crashed at 17; job {second} resumed_from=15;\n"
          f"{_ckpt(sandbox, 'ls', uri)}")


def test_uri_outside_user_prefix_fails_clearly_and_writes_nothing(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """A job naming another user's prefix fails at start with a clear error; S3 stays empty."""
    user, other = test_users[0], test_users[1]
    wd = sandbox.user_dir(user, "ckpt-prefix")
    uri = f"s3://ckpt/{other}/stolen-{time.time_ns()}"
    job = _train(sandbox, user, wd, uri, ["node1"], "--steps 5 --ckpt-every 5")
    info = sandbox.wait_job(job, timeout=120)
    out = _out(wd, job)
    assert info.state == "FAILED"
    assert f"is outside the prefix user {user} may write to: s3://ckpt/{user}/" in out
    assert not _s3_run(sandbox, uri).exists()


def test_s3_down_training_unblocked_epilog_bounded_upload_later(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """With S3 down at job start the job fails with a clear stage-in error (never a silent
    fresh start); with the explicit opt-in it starts fresh, loudly, trains and ends
    normally, the epilog waits only epilog_wait_s, and the agent uploads the pending step
    once S3 is back."""
    user = test_users[0]
    wd = sandbox.user_dir(user, "ckpt-down")
    uri = f"s3://ckpt/{user}/down-{time.time_ns()}"
    with s3_stopped(sandbox):
        refused = _train(sandbox, user, wd, uri, ["node2"], "--steps 10 --ckpt-every 5")
        assert sandbox.wait_job(refused, timeout=120).state == "FAILED", _out(wd, refused)
        assert "couldn't restore the run: stage-in failed" in _out(wd, refused)
        job = _train(sandbox, user, wd, uri, ["node2"], "--steps 10 --ckpt-every 5",
                     before="export SLURM_RESILIENCE_CKPT_ALLOW_FRESH_START=1\n")
        info = sandbox.wait_job(job, timeout=120)
        ended = time.monotonic()
        assert info.state == "COMPLETED", _out(wd, job)
        assert "done step=10 resumed_from=0" in _out(wd, job)
        assert "STARTING FROM SCRATCH" in _out(wd, job)
        time.sleep(2)
        assert not (_s3_run(sandbox, uri) / "step-00000010" / "COMMIT.json").exists()
    marker = _s3_run(sandbox, uri) / "step-00000010" / "COMMIT.json"
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.is_file()
    print(f"\nS3 down: step 10 committed in S3 {time.monotonic() - ended:.1f}s after the job "
          "ended (endpoint restarted after ~2 s)")
    assert "step-00000010: ok" in _ckpt(sandbox, "verify", uri)
    log = (sandbox.state_dir / "log" / "slurm-resilience.jsonl").read_text()
    assert "S3 unreachable; uploads wait" in log
    assert "uploads still pending; the agent finishes them after the job" in log


def test_planted_symlinks_not_followed_by_cleanup_nor_uploaded(
        sandbox: Sandbox, test_users: tuple[str, ...], tmp_path: Path) -> None:
    """Links the job plants in its staging dir (to /etc and to a canary dir) are neither
    uploaded nor followed by the epilog's cleanup."""
    user = test_users[0]
    wd = sandbox.user_dir(user, "ckpt-links")
    uri = f"s3://ckpt/{user}/links-{time.time_ns()}"
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "precious").write_text("keep")
    tmp_path.chmod(0o755)
    nvme = f"{sandbox.layout.nodes_dir}/$SLURMD_NODENAME/nvme/job-$SLURM_JOB_ID"
    plant = (f"mkdir -p {nvme}/step-00000009/rank-00000.tmp\n"
             f"ln -s /etc {nvme}/etc-link\n"
             f"ln -s {canary} {nvme}/step-00000005/rank-00000/canary\n"
             f"ln -s {canary} {nvme}/step-00000009/rank-00000.tmp/canary\n")
    job = _train(sandbox, user, wd, uri, ["node3"], "--steps 5 --ckpt-every 5", after=plant)
    info = sandbox.wait_job(job, timeout=120)
    assert info.state == "COMPLETED", _out(wd, job)
    assert (canary / "precious").read_text() == "keep"
    assert os.path.isfile("/etc/passwd")
    run = _s3_run(sandbox, uri)
    uploaded = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    assert "step-00000005/COMMIT.json" in uploaded
    assert not [u for u in uploaded if "canary" in u or "etc" in u]
    assert not (sandbox.layout.node_dir("node3") / "nvme" / f"job-{job}").exists()


def _restart_agent(sandbox: Sandbox, node: str, sig: int = signal.SIGTERM) -> None:
    """Stop a node's agent (SIGKILL: no cleanup at all) and start it again."""
    extra = next(e for e in control.agent_extras(sandbox.layout)
                 if e.daemon.name == f"agent-{node}")
    pid = extra.daemon.pid()
    if pid is not None:
        os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while extra.daemon.pid() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    daemons.spawn(extra.argv, log_file=sandbox.layout.log_dir / f"{extra.daemon.name}.log",
                  pid_file=extra.daemon.pid_file,
                  env={**control.daemon_env(sandbox.layout), **extra.env})
    # The old agent's socket file can outlive it (SIGKILL): only an answer to a ping says
    # the new one listens (a job started before that would find no agent).
    sock = str(resilience_conf.agent_socket(sandbox.layout, node))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if extra.daemon.pid() is not None and client.call(sock, "ping", timeout=2)["ok"]:
                return
        except (OSError, client.AgentUnavailable, client.AgentRefused):
            pass
        time.sleep(0.1)
    raise AssertionError(f"agent on {node} did not come back")


def _journal_parts(sandbox: Sandbox, node: str, job: int) -> int:
    path = sandbox.layout.node_dir(node) / "state" / "ckpt-journal" / f"job-{job}.json"
    try:
        rec = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0
    return sum(len(f.get("parts", {})) for st in rec["steps"].values()
               for f in st.get("files", {}).values())


def test_agent_sigkilled_mid_upload_resumes_without_resending_parts(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """The node agent is SIGKILLed in the middle of a multipart upload; restarted, it
    resumes from its journal (completed parts are not sent again) and the S3 copy verifies."""
    user = test_users[0]
    wd = sandbox.user_dir(user, "ckpt-kill")
    uri = f"s3://ckpt/{user}/kill-{time.time_ns()}"
    sandbox.update_resilience_config({"checkpoint": {"rate_limit": "4MiB", "concurrency": 1,
                                                     "epilog_wait_s": 1.0}})
    try:
        _restart_agent(sandbox, "node4")  # picks up the throttled config
        job = _train(sandbox, user, wd, uri, ["node4"],
                     "--steps 5 --ckpt-every 5 --state-mb 40")
        deadline = time.monotonic() + 120
        while _journal_parts(sandbox, "node4", job) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        done = _journal_parts(sandbox, "node4", job)
        assert done >= 3
        _restart_agent(sandbox, "node4", signal.SIGKILL)
        marker = _s3_run(sandbox, uri) / "step-00000005" / "COMMIT.json"
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marker.is_file()
        assert sandbox.wait_job(job, timeout=60).state == "COMPLETED"
    finally:
        sandbox.update_resilience_config({})
        _restart_agent(sandbox, "node4")
    log = [json.loads(line) for line in
           (sandbox.state_dir / "log" / "slurm-resilience.jsonl").read_text().splitlines()
           if '"resuming multipart upload"' in line]
    resumed = [e for e in log if e.get("node") == "node4" and uri.removeprefix("s3://ckpt/")
               in e.get("key", "")]
    assert resumed and resumed[-1]["parts_done"] >= done, log
    assert "step-00000005: ok" in _ckpt(sandbox, "verify", uri)
    print(f"\nagent SIGKILLed after {done} journaled parts; restart resumed with "
          f"{resumed[-1]['parts_done']} of {resumed[-1]['parts']} parts already in S3")


@pytest.mark.parametrize("name", [".metadata", "data.distcp"])
def test_corrupt_object_in_s3_stage_in_falls_back(sandbox: Sandbox, test_users: tuple[str, ...],
                                                  name: str) -> None:
    """One object of the newest step is corrupted in S3: a new job detects it (CRC32C: the
    metadata at stage-in, a data block while the restore reads it) and resumes from the step
    before, with the fallback in the log; every rank passes over the same step."""
    user = test_users[0]
    wd = sandbox.user_dir(user, f"ckpt-corrupt-{name.strip('.')}")
    uri = f"s3://ckpt/{user}/corrupt-{time.time_ns()}"
    first = _train(sandbox, user, wd, uri, ["node1"], "--steps 10 --ckpt-every 5")
    assert sandbox.wait_job(first, timeout=120).state == "COMPLETED", _out(wd, first)
    obj = _s3_run(sandbox, uri) / "step-00000010" / "rank-00000" / name
    data = bytearray(obj.read_bytes())
    data[len(data) // 3] ^= 0x40
    obj.write_bytes(bytes(data))
    second = _train(sandbox, user, wd, uri, ["node2"], "--steps 12 --ckpt-every 5")
    assert sandbox.wait_job(second, timeout=120).state == "COMPLETED", _out(wd, second)
    assert "done step=12 resumed_from=5 restarts=0" in _out(wd, second)
    log = (sandbox.state_dir / "log" / "slurm-resilience.jsonl").read_text()
    assert "stage-in: step does not verify, falling back" in log


def test_spank_option_starts_stage_in_from_the_prolog(sandbox: Sandbox,
                                                      test_users: tuple[str, ...]) -> None:
    """With --ckpt-uri (SPANK) instead of the environment variable, the prolog hands the URI
    to the agent, stage-in starts before the tasks, and the tasks see the same URI."""
    user = test_users[0]
    wd = sandbox.user_dir(user, "ckpt-spank")
    uri = f"s3://ckpt/{user}/spank-{time.time_ns()}"
    first = _train(sandbox, user, wd, uri, ["node1"], "--steps 5 --ckpt-every 5", spank=True)
    assert sandbox.wait_job(first, timeout=120).state == "COMPLETED", _out(wd, first)
    assert (_s3_run(sandbox, uri) / "step-00000005" / "COMMIT.json").is_file()
    second = _train(sandbox, user, wd, uri, ["node2"], "--steps 8 --ckpt-every 5", spank=True)
    assert sandbox.wait_job(second, timeout=120).state == "COMPLETED", _out(wd, second)
    assert "done step=8 resumed_from=5 restarts=0" in _out(wd, second)
    events = [json.loads(line) for line in
              (sandbox.state_dir / "log" / "slurm-resilience.jsonl").read_text().splitlines()
              if f'"job_id": {second},' in line]
    started = [e for e in events if e.get("event") == "stage-in finished"]
    assert started and started[0]["source"] == "s3" and started[0]["step"] == 5


def test_deep_tree_and_broken_journal_do_not_stop_another_users_upload(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """Mis-shaped journal records don't stop the agent from starting (quarantined), and a
    user's 1,500-level tree in their staging dir doesn't stop another user's upload on the
    node; the tree is removed."""
    user, other = test_users[0], test_users[1]
    node = "node2"
    journal = sandbox.layout.node_dir(node) / "state" / "ckpt-journal"
    journal.mkdir(parents=True, exist_ok=True)
    (journal / "job-990001.json").write_text(json.dumps({"job_id": 990001, "stagein": None}))
    (journal / "job-990002.json").write_text("\x00 not json")
    _restart_agent(sandbox, node, signal.SIGKILL)  # comes back although the records are bad
    deadline = time.monotonic() + 30
    while len(list(journal.glob("job-99000*"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list((journal / "quarantine").glob("job-99000*"))) == 2

    wd = sandbox.user_dir(user, "ckpt-deep")
    nvme = f"{sandbox.layout.nodes_dir}/$SLURMD_NODENAME/nvme/job-$SLURM_JOB_ID"
    plant = (f"{PYTHON} -c \"import os\nos.chdir('{nvme}'.replace('$SLURMD_NODENAME', "
             "os.environ['SLURMD_NODENAME']).replace('$SLURM_JOB_ID', "
             "os.environ['SLURM_JOB_ID']))\nfor _ in range(1500):\n"
             "    os.mkdir('d'); os.chdir('d')\nos.symlink('/etc/passwd', 'p')\"\n")
    hostile = _train(sandbox, user, wd, f"s3://ckpt/{user}/deep-{time.time_ns()}", [node],
                     "--steps 5 --ckpt-every 5", after=plant)
    info = sandbox.wait_job(hostile, timeout=120)
    assert info.state == "COMPLETED", _out(wd, hostile)

    owd = sandbox.user_dir(other, "ckpt-victim")
    uri = f"s3://ckpt/{other}/victim-{time.time_ns()}"
    victim = _train(sandbox, other, owd, uri, [node], "--steps 5 --ckpt-every 5")
    assert sandbox.wait_job(victim, timeout=120).state == "COMPLETED", _out(owd, victim)
    marker = _s3_run(sandbox, uri) / "step-00000005" / "COMMIT.json"
    hostile_dir = sandbox.layout.node_dir(node) / "nvme" / f"job-{hostile}"
    deadline = time.monotonic() + 60
    while (not marker.exists() or hostile_dir.exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.is_file() and not hostile_dir.exists()
    assert os.path.isfile("/etc/passwd")
    log = (sandbox.state_dir / "log" / "slurm-resilience.jsonl").read_text()
    assert "quarantined a mis-shaped record" in log
