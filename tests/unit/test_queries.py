"""A login node's questions to the agents: sealed by munge for the exact question, answered
on the metrics endpoint, by whom munge vouches for."""

from __future__ import annotations

import json
import pwd
import subprocess
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from conftest import PYTHON_SYS, REPO, as_user, free_port
from prometheus_client import CollectorRegistry

from slurm_resilience.metrics import http
from slurm_resilience.queries import client, wire
from slurm_resilience.queries.server import QueryApp, Refused
from slurm_resilience.transport.credentials import MungeCredentials

asked: list[tuple[str, int, int]] = []


def _goodput(job_id: int, uid: int) -> Mapping[str, Any]:
    asked.append(("goodput", job_id, uid))
    return {"ok": True, "node": "n1", "ledger": {"job_id": job_id, "runs": []}}


def _report(job_id: int, uid: int) -> Mapping[str, Any]:
    asked.append(("report", job_id, uid))
    if uid not in (0, 4242):
        raise Refused(f"no hang report of job {job_id} for uid {uid} on n1")
    return {"ok": True, "text": "hung"}


@pytest.fixture
def endpoint(munge_socket: str) -> Iterator[str]:
    creds = MungeCredentials(socket=munge_socket)
    port = free_port()
    server = http.serve("127.0.0.1", port, CollectorRegistry(), wrap=lambda app: QueryApp(
        "n1", creds, {"goodput": _goodput, "report": _report}, app))
    asked.clear()
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def test_a_sealed_question_is_answered_and_metrics_still_served(endpoint: str,
                                                                munge_socket: str) -> None:
    """Root's credential for goodput of job 7 on n1 gets the handler's answer with uid 0;
    /metrics still answers beside it."""
    creds = MungeCredentials(socket=munge_socket)
    a = client.ask(endpoint, "n1", "goodput", 7, creds, timeout=10)
    assert a.error == "" and a.body is not None and a.body["ledger"]["job_id"] == 7
    assert asked == [("goodput", 7, 0)]
    import urllib.request

    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as resp:
        assert resp.status == 200


def test_a_credential_for_another_question_or_node_or_a_replay_is_refused(
        endpoint: str, munge_socket: str) -> None:
    """A credential opens only the question it sealed: not another job, not another node,
    and not twice (munged refuses a replay); none at all is refused before munge runs."""
    creds = MungeCredentials(socket=munge_socket)
    other_node = client.ask(endpoint, "n2", "goodput", 7, creds, timeout=10)
    assert "made for another question" in other_node.error
    cred = creds.encode(wire.question("goodput", 8, "n1")).decode()
    import urllib.error
    import urllib.request

    def get(path: str, credential: str) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(endpoint + path, headers={wire.HEADER: credential})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    wrong = creds.encode(wire.question("goodput", 8, "n1")).decode()
    assert get("/v1/goodput/9", wrong)[0] == 403  # sealed for job 8
    assert get("/v1/goodput/8", cred)[0] == 200
    code, body = get("/v1/goodput/8", cred)
    assert code == 403 and "munge refused the credential" in body["error"]
    code, body = get("/v1/goodput/8", "")
    assert code == 401 and wire.HEADER in body["error"]
    assert get("/v1/shell/8", cred)[0] == 404
    assert asked == [("goodput", 8, 0)]


_ASK = """
import json, sys
from slurm_resilience.transport.credentials import MungeCredentials
from slurm_resilience.queries import client
a = client.ask(sys.argv[1], "n1", "report", 5, MungeCredentials(socket=sys.argv[2]), 10)
print(json.dumps({"body": a.body, "error": a.error}))
"""


def test_the_asker_is_who_munge_says_not_who_it_claims(endpoint: str, munge_socket: str,
                                                       test_users: tuple[str, ...]) -> None:
    """An unprivileged user's question reaches the handler with that user's uid, so the
    report handler refuses another's job in its usual words."""
    user = test_users[0]
    out = subprocess.run([PYTHON_SYS, "-c", _ASK, endpoint, munge_socket],
                         capture_output=True, text=True, timeout=60, check=True, cwd="/",
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         **as_user(user)).stdout
    got = json.loads(out)
    uid = pwd.getpwnam(user).pw_uid
    assert got == {"body": None, "error": f"no hang report of job 5 for uid {uid} on n1"}
    assert asked == [("report", 5, uid)]
