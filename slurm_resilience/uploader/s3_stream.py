"""Reading a GET's body straight into a caller's buffer, and writing it out whole.

botocore's ``StreamingBody.readinto`` goes through urllib3 2.x, whose ``readinto`` reads
a new ``bytes`` and copies it: per 1 GiB restored that is a GiB of fresh allocations (the
kernel zeroing and faulting in their pages) and a GiB of copies, about as much CPU as the
transfer itself. Under the body sits the standard library's ``http.client.HTTPResponse``,
whose ``readinto`` receives from the socket into the caller's buffer. Where the body is
exactly that stack and plain (no Content-Encoding), it is read from there; anything else
takes botocore's path. Both honour the response's Content-Length and the client's read
timeout (the socket's).
"""

from __future__ import annotations

import http.client
import os
from typing import Any

_PLAIN = ("", "identity")


def direct_stream(body: Any) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under a botocore body, or None where the body is not
    botocore over urllib3 over ``http.client`` or is encoded (then urllib3 must decode)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse):
        return None
    headers = getattr(raw, "headers", None)
    encoding = headers.get("content-encoding", "") if headers is not None else None
    if encoding is None or encoding.strip().lower() not in _PLAIN:
        return None
    return fp


def read_into(body: Any, view: memoryview, direct: http.client.HTTPResponse | None) -> int:
    """Read up to ``len(view)`` bytes of a response body into ``view``; 0 at its end.

    ``direct`` is ``direct_stream(body)``, looked up once per body by the caller. A body
    that ends before its Content-Length raises ConnectionError (retried as transient), as
    urllib3 would."""
    if direct is not None:
        try:
            n = direct.readinto(view)
        except http.client.HTTPException as exc:  # IncompleteRead and kin
            raise ConnectionError(f"S3 answer ended early: {exc!r}") from exc
        # http.client returns 0 at a closed connection even when Content-Length promised
        # more (``length`` is what is still owed); botocore raises there, and so do we.
        if not n and len(view) and direct.length:
            raise ConnectionError(f"S3 answer ended early: {direct.length} bytes of its "
                                  f"Content-Length never came")
        return n
    readinto = getattr(body, "readinto", None)
    if readinto is not None:
        return int(readinto(view))
    data = body.read(len(view))
    view[:len(data)] = data
    return len(data)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset`` (a short write continues where it stopped)."""
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
