"""What a question looks like on the wire; shared by the agent's side and the asker's."""

from __future__ import annotations

import re
from typing import Protocol

KINDS = ("goodput", "report")
PATH = re.compile(r"^/v1/(goodput|report)/(\d{1,12})$")
HEADER = "X-Munge-Credential"
# A credential over a few dozen bytes of question is well under this.
MAX_CREDENTIAL = 4096
# An answer is a node's ledger of one job, or its reports cut at max_report_bytes.
MAX_ANSWER = 4 << 20


class Decoded(Protocol):
    @property
    def uid(self) -> int: ...

    @property
    def payload(self) -> bytes: ...


class Seal(Protocol):
    """Munge as the agents use it (transport.credentials.MungeCredentials); its
    ``encode`` and ``decode`` raise ValueError for a credential not made or refused."""

    def encode(self, payload: bytes) -> bytes: ...

    def decode(self, credential: bytes) -> Decoded: ...


def path(kind: str, job_id: int) -> str:
    return f"/v1/{kind}/{int(job_id)}"


def question(kind: str, job_id: int, node: str) -> bytes:
    """What the credential seals: the whole question, so it answers this one only."""
    return f"slurm-resilience query v1 {kind} job {int(job_id)} node {node}".encode("ascii")
