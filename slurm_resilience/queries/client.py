"""The asker's side: one question to one agent, or the same question to a job's nodes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from slurm_resilience.queries import wire

WORKERS = 16


@dataclass(frozen=True)
class Answer:
    node: str
    body: Mapping[str, Any] | None  # None: see error
    error: str = ""


def ask(base_url: str, node: str, kind: str, job_id: int, credentials: wire.Seal,
        timeout: float) -> Answer:
    """``kind`` of ``job_id`` from the agent of ``node`` at ``base_url`` (http://host:port)."""
    try:
        cred = credentials.encode(wire.question(kind, job_id, node))
    except ValueError as exc:  # munge could not seal it
        return Answer(node, None, str(exc))
    if not base_url.startswith("http://"):
        return Answer(node, None, f"not an http:// endpoint: {base_url}")
    req = urllib.request.Request(base_url + wire.path(kind, job_id),  # noqa: S310 - http only
                                 headers={wire.HEADER: cred.decode("ascii")})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http only
            return Answer(node, _body(resp.read(wire.MAX_ANSWER + 1)))
    except urllib.error.HTTPError as exc:
        try:
            said = _body(exc.read(wire.MAX_ANSWER + 1)).get("error", "")
        except ValueError:
            said = ""
        return Answer(node, None, str(said or f"HTTP {exc.code}"))
    except (OSError, ValueError) as exc:
        return Answer(node, None, f"couldn't reach the agent at {base_url}: {exc}")


def ask_all(urls: Mapping[str, str], kind: str, job_id: int, credentials: wire.Seal,
            timeout: float) -> list[Answer]:
    """The same question to every node's agent at once (bounded), in node order."""
    if not urls:
        return []
    items: Sequence[tuple[str, str]] = sorted(urls.items())
    with ThreadPoolExecutor(max_workers=min(WORKERS, len(items))) as pool:
        return list(pool.map(lambda item: ask(item[1], item[0], kind, job_id, credentials,
                                              timeout), items))


def _body(data: bytes) -> dict[str, Any]:
    if len(data) > wire.MAX_ANSWER:
        raise ValueError(f"answer over {wire.MAX_ANSWER} bytes")
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError("answer is not a JSON object")
    return body
