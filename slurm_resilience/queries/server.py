"""The agent's side: answers questions on its metrics endpoint, everything else goes on to
the Prometheus app. Nothing here trusts the asker's words: the credential says who asks
(munged vouches for the uid), and it must seal exactly the question asked of this node."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text
from slurm_resilience.queries import wire

log = get_logger("queries")
_FAILED_LOG = LogBudget(log, "questions not answered", level="error")  # askers choose how often

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
# (job id, the asker's uid) -> the answer; raises Refused.
Handler = Callable[[int, int], Mapping[str, Any]]


class Refused(Exception):
    """The agent has nothing for this asker (the same words for "none" and "not yours")."""


class QueryApp:
    """WSGI: ``/v1/<kind>/<job>`` answered here, any other path by ``fallback``."""

    def __init__(self, node: str, credentials: wire.Seal, handlers: Mapping[str, Handler],
                 fallback: WsgiApp):
        self.node, self.credentials = node, credentials
        self.handlers, self.fallback = dict(handlers), fallback

    def __call__(self, environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        path = str(environ.get("PATH_INFO", ""))
        if not path.startswith("/v1/"):
            return self.fallback(environ, start)
        status, body = self.answer(path, str(environ.get("REQUEST_METHOD", "")),
                                   str(environ.get("HTTP_X_MUNGE_CREDENTIAL", "")))
        data = json.dumps(body).encode()
        start(status, [("Content-Type", "application/json"),
                       ("Content-Length", str(len(data)))])
        return [data]

    def answer(self, path: str, method: str, credential: str) -> tuple[str, dict[str, Any]]:
        m = wire.PATH.match(path)
        if method != "GET" or m is None or m.group(1) not in self.handlers:
            return "404 Not Found", _no(f"no such question: GET /v1/<{'|'.join(wire.KINDS)}>"
                                        "/<job id>")
        kind, job_id = m.group(1), int(m.group(2))
        cred = credential.encode("ascii", "replace")
        if not cred or len(cred) > wire.MAX_CREDENTIAL:
            return "401 Unauthorized", _no(f"a munge credential in {wire.HEADER} is needed")
        try:
            decoded = self.credentials.decode(cred)  # checks the form before munge runs
        except ValueError as exc:
            return "403 Forbidden", _no(str(exc))
        if decoded.payload != wire.question(kind, job_id, self.node):
            return "403 Forbidden", _no(f"the credential was made for another question than "
                                        f"{kind} of job {job_id} on {self.node}")
        try:
            return "200 OK", dict(self.handlers[kind](job_id, decoded.uid))
        except Refused as exc:
            return "404 Not Found", _no(str(exc))
        except Exception as exc:  # noqa: BLE001 - said to the asker and logged, never a crash
            _FAILED_LOG.log(f"uid {decoded.uid}", "queries: couldn't answer", kind=kind,
                            job_id=job_id, uid=decoded.uid,
                            error=user_text(f"{type(exc).__name__}: {exc}"))
            return "500 Internal Server Error", _no(f"{type(exc).__name__} on {self.node}")


def _no(error: str) -> dict[str, Any]:
    return {"ok": False, "error": error}
