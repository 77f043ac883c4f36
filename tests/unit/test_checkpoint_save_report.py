"""A save()'s stall and write time reach the node agent (metrics.ckpt_saved), from the
background writer; only the job's owner (or root) may report; the metrics and the goodput
ledger use them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from agent_state import Goodput, samples, slot, view
from conftest import as_user
from prometheus_client import CollectorRegistry, generate_latest

from slurm_resilience.agent.server import AgentServer
from slurm_resilience.agent.service import Peer, RequestError
from slurm_resilience.checkpoint.manager import CheckpointManager
from slurm_resilience.goodput.ledger import Ledger
from slurm_resilience.goodput.saves import SaveBook
from slurm_resilience.metrics.collector import AgentCollector, AgentSources

ME = os.getuid()


@pytest.fixture
def book_server(tmp_path: Path) -> Iterator[tuple[SaveBook, AgentServer]]:
    book = SaveBook()
    srv = AgentServer(str(tmp_path / "run" / "agent.sock"))
    srv.route("metrics.ckpt_saved", lambda req, peer: (book.report(req, peer, ME), {})[1])
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield book, srv
    srv.shutdown()
    srv.server_close()


def test_a_save_reports_its_stall_and_write_time(tmp_path: Path,
                                                 book_server: tuple[SaveBook, AgentServer]
                                                 ) -> None:
    book, srv = book_server
    staging = tmp_path / "job"
    staging.mkdir()
    mgr = CheckpointManager(staging, job_id=77, agent_socket=srv.path)
    mgr.save(5, {"w": torch.ones(16, 16)})
    mgr.wait()
    mgr.save(10, {"w": torch.ones(16, 16)})
    mgr.wait()
    deadline = time.monotonic() + 60
    while book.snapshot().get(77, None) is None or book.snapshot()[77].saves < 2:
        assert time.monotonic() < deadline, "no save report reached the agent"
        time.sleep(0.05)
    st = book.snapshot()[77]
    assert st.step == 10 and st.run == 0 and st.saves == 2
    assert 0 < st.last_stall_s <= st.max_stall_s <= st.total_stall_s
    assert st.last_write_s > 0


def test_a_relaunchs_saves_are_reported_as_its_own_run(
        tmp_path: Path, book_server: tuple[SaveBook, AgentServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``launch``, relaunch 2 of a job requeued once is attempt 2001, the run its
    heartbeat slots and the goodput ledger name: its stalls are charged there, not to the
    allocation's first run."""
    book, srv = book_server
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_RESILIENCE_RELAUNCH", "2")
    staging = tmp_path / "job"
    staging.mkdir()
    mgr = CheckpointManager(staging, job_id=78, agent_socket=srv.path)
    mgr.save(5, {"w": torch.ones(16, 16)})
    mgr.wait()
    deadline = time.monotonic() + 60
    while book.snapshot().get(78, None) is None:
        assert time.monotonic() < deadline, "no save report reached the agent"
        time.sleep(0.05)
    assert book.snapshot()[78].run == 2001


def test_reports_are_checked_and_bounded() -> None:
    book = SaveBook()
    ok = {"job_id": 3, "run": 0, "step": 5, "stall_s": 0.5, "write_s": 1.0}
    with pytest.raises(RequestError, match="belongs to uid 1000"):
        book.report(ok, Peer(pid=1, uid=1001, gid=1001), 1000)
    with pytest.raises(RequestError, match="not running on this node"):
        book.report(ok, Peer(pid=1, uid=0, gid=0), None)
    for bad in ({"stall_s": float("nan")}, {"stall_s": -1}, {"step": "5"}, {"run": True}):
        with pytest.raises(RequestError):
            book.report({**ok, **bad}, Peer(pid=1, uid=1000, gid=1000), 1000)
    book.report(ok, Peer(pid=1, uid=1000, gid=1000), 1000)
    book.report({**ok, "stall_s": 1.5}, Peer(pid=1, uid=0, gid=0), 1000)
    assert book.snapshot()[3].total_stall_s == 2.0
    book.report({**ok, "run": 1, "stall_s": 0.25}, Peer(pid=1, uid=0, gid=0), 1000)
    st = book.snapshot()[3]
    assert (st.run, st.saves, st.total_stall_s, st.max_stall_s) == (1, 1, 0.25, 0.25)
    book.keep_only(set())
    assert book.snapshot() == {}


def test_metrics_and_goodput_use_the_reported_stalls(tmp_path: Path) -> None:
    book = SaveBook()
    me = Peer(pid=1, uid=0, gid=0)
    for stall in (0.2, 0.6):
        book.report({"job_id": 8, "run": 0, "step": 5, "stall_s": stall, "write_s": 2.0}, me,
                    0)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(AgentSources(node="n1", events_path="", nccl_path="",
                                             goodput=Goodput(saves=book))))
    got = samples(generate_latest(reg).decode())
    j = (("job_id", "8"),)
    assert got[("slurm_resilience_checkpoint_save_stall_last_seconds", j)] == 0.6
    assert got[("slurm_resilience_checkpoint_save_stall_max_seconds", j)] == 0.6
    assert got[("slurm_resilience_checkpoint_save_stall_seconds_total", j)] == pytest.approx(0.8)
    assert got[("slurm_resilience_checkpoint_saves_total", j)] == 2
    ledger = Ledger(str(tmp_path))
    stalls = {j_: (s.run, s.total_stall_s) for j_, s in book.snapshot().items()}
    ledger.observe([view(8, [slot(0, 5, 1.0, 8)])], 10.0, stalls=stalls)
    assert ledger.jobs[8].runs[0].checkpoint_stall_s == pytest.approx(0.8)
    assert ledger.jobs[8].runs[0].stall_reported


REPORTER = """
import json, socket, sys
def ask(request):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sys.argv[1])
        s.sendall(json.dumps(request).encode() + b"\\n")
        return s.makefile().readline().strip()
good = {"op": "metrics.ckpt_saved", "run": 0, "step": 5, "stall_s": 0.5, "write_s": 1.0}
print("other:", ask({**good, "job_id": 1}))
print("own:", ask({**good, "job_id": 2}))
print("huge:", ask({**good, "job_id": 2, "stall_s": 1e300}))
"""


def test_an_unprivileged_user_reports_only_for_their_own_job(
        tmp_path: Path, test_users: tuple[str, ...]) -> None:
    """Through the agent's real socket and the goodput service's handler: a user's report
    for root's job is refused, for their own job accepted, nonsense refused."""
    import pwd
    import shutil
    import subprocess
    import tempfile

    from slurm_resilience.config import Config, load_text
    from slurm_resilience.goodput.service import GoodputService

    pw = pwd.getpwnam(test_users[0])

    from agent_state import Uploads

    cfg = load_text(Config, f"node: {{state_dir: '{tmp_path}'}}\nmetrics: {{port: 0}}\n", "t")
    uploads = Uploads({1: {"job_id": 1, "uid": 0}, 2: {"job_id": 2, "uid": pw.pw_uid}})
    svc = GoodputService(cfg, "n1", {"checkpoint": uploads})
    run = Path(tempfile.mkdtemp(prefix="sr-sock-", dir="/tmp"))
    run.chmod(0o755)
    srv = AgentServer(str(run / "agent.sock"))
    for op, handler in svc.handlers().items():
        srv.route(op, handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        out = subprocess.run(["/usr/bin/python3", "-c", REPORTER, srv.path], **as_user(pw.pw_uid),
                             capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    finally:
        srv.shutdown()
        srv.server_close()
        svc.close()
        shutil.rmtree(run)
    assert f"belongs to uid 0, not to you (uid {pw.pw_uid})" in out, out
    assert 'own: {"ok": true}' in out, out
    assert "huge:" in out and "is not a number of seconds" in out, out
    assert list(svc.saves.snapshot()) == [2]
