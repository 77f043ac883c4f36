"""Whether another node's daemon takes a TCP connection now: the cheapest evidence that a
node is gone (nothing listens, or nothing answers), gathered side by side and bounded."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

CONNECT_TIMEOUT_S = 1.0
MAX_PROBES = 64  # connects in flight at once, however many addresses


def connect_error(address: tuple[str, int], timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """'' when a TCP connection to ``address`` is accepted within ``timeout_s``, else why not
    (the connection is closed at once: nothing is sent)."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return ""
    except TimeoutError:
        return f"no answer in {timeout_s:g}s"
    except OSError as exc:
        return exc.strerror.lower() if exc.strerror else str(exc)


def connect_errors(addresses: Sequence[tuple[str, int]],
                   timeout_s: float = CONNECT_TIMEOUT_S) -> list[str]:
    """:func:`connect_error` of each address, at most ``MAX_PROBES`` at once, in order."""
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PROBES, len(addresses)),
                            thread_name_prefix="reach") as pool:
        return list(pool.map(lambda a: connect_error(a, timeout_s), addresses))
