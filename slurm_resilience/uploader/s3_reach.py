"""Whether the S3 endpoint takes a TCP connection now: one connect, bounded.

A stage-in first lists S3 and retries it for ``checkpoint.stagein_retry_s`` before the job's
nodes are asked for a step S3 can't give. On a node that joined a relaunch after a node
loss with S3 down, those seconds are most of the restore (the survivors and the buddy copy
have the step). An endpoint that refuses the connection, or does not answer it, is down
now; that is cheap to know before the first request. A connection that is accepted says
nothing more: S3 is then asked as always.

The probe is skipped where a direct connection says nothing: no endpoint configured (AWS's
own, reached through its regional names) or a proxy in between (the proxy variables).
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping

from slurm_resilience.transport.reach import connect_error

PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
              "all_proxy")
PROBE_TIMEOUT_S = 1.0


def endpoint_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of an ``http(s)://`` endpoint URL; None when it names none."""
    try:
        url = urllib.parse.urlsplit(endpoint)
        port = url.port
    except ValueError:
        return None
    if url.scheme not in ("http", "https") or not url.hostname:
        return None
    return url.hostname, port or (443 if url.scheme == "https" else 80)


def refusing(endpoint: str, env: Mapping[str, str] | None = None,
             timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Why ``endpoint`` takes no TCP connection now ('' when it does, or when the probe
    says nothing: see the module doc)."""
    env = os.environ if env is None else env
    address = endpoint_address(endpoint)
    if address is None or any(env.get(v) for v in PROXY_VARS):
        return ""
    return connect_error(address, timeout_s)
