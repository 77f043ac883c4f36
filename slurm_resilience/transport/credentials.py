"""Munge credentials for the agents' messages: Debian's ``munge``/``unmunge`` through the
one subprocess seam; this project writes no cryptography of its own.

``munge`` seals a payload with the cluster's munge key and the encoding process's uid;
``unmunge`` (on any node with the key) returns the payload with that uid and the encode
time, and refuses a credential it has already decoded (a replay) or one past its TTL.
Credentials are restricted to the agent's uid, so a user process that receives one (e.g.
by binding the port before the agent) can't read it.
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from dataclasses import dataclass
from typing import Protocol

from slurm_resilience.config.heartbeat import ExchangeSection
from slurm_resilience.proc import CommandError, Runner

# What munge writes: "MUNGE:" base64 ":" — checked before any process is started for it.
CREDENTIAL = re.compile(rb"^MUNGE:[A-Za-z0-9+/=]+:$")
# Credentials remembered (by digest) so a replay is refused without running unmunge again.
RECENT_CREDENTIALS = 16384
# munge_err_t values unmunge --numeric reports in STATUS (munge.h) for refused credentials.
_STATUS = {14: "Invalid credential", 15: "Expired credential", 16: "Rewound credential",
           17: "Replayed credential", 18: "Unauthorized credential"}


class CredentialError(ValueError):
    """A credential that could not be made, or one that is refused (a ValueError, so code
    that knows only the :class:`Credentials` protocol can catch it)."""


@dataclass(frozen=True)
class Decoded:
    """What munged vouches for: the encoding process's uid and gid, when, and the payload."""

    uid: int
    gid: int
    encode_time: int
    payload: bytes


class Credentials(Protocol):
    """Seal and open messages; the real one is :class:`MungeCredentials`."""

    def encode(self, payload: bytes) -> bytes: ...

    def decode(self, credential: bytes) -> Decoded: ...


class MungeCredentials:
    """``munge``/``unmunge`` run through :class:`slurm_resilience.proc.Runner` (argv, timeout).

    Payloads must be ASCII (the exchange sends JSON with non-ASCII escaped)."""

    def __init__(self, *, socket: str = "", munge: str = "munge", unmunge: str = "unmunge",
                 restrict_uid: int = 0, ttl_s: int = 120, timeout_s: float = 5.0,
                 runner: Runner | None = None):
        self.socket_args = [f"--socket={socket}"] if socket else []
        self.munge, self.unmunge = munge, unmunge
        self.restrict_uid = restrict_uid
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.runner = runner or Runner()
        self.seen = RecentDigests(RECENT_CREDENTIALS)

    def encode(self, payload: bytes) -> bytes:
        argv = [self.munge, *self.socket_args, f"--restrict-uid={self.restrict_uid}",
                f"--ttl={self.ttl_s}", "--zip=zlib"]
        try:
            out = self.runner.run(argv, timeout=self.timeout_s, input_text=payload.decode("ascii"))
        except (CommandError, UnicodeDecodeError) as exc:
            raise CredentialError(f"couldn't seal message with munge: {exc}") from exc
        cred = out.stdout.strip().encode("ascii", "replace")
        if not CREDENTIAL.match(cred):
            raise CredentialError("couldn't seal message with munge: output is not a credential")
        return cred

    def decode(self, credential: bytes) -> Decoded:
        if not CREDENTIAL.match(credential):
            raise CredentialError("not a munge credential")
        if not self.seen.add(credential):
            # munged refuses it too (replayed, or expired by now): no process for a replay.
            raise CredentialError("munge refused the credential: Replayed credential "
                                  "(seen before on this node; not decoded again)")
        argv = [self.unmunge, *self.socket_args, "--numeric"]
        try:
            out = self.runner.run(argv, timeout=self.timeout_s,
                                  input_text=credential.decode("ascii"))
        except CommandError as exc:
            if exc.result is None:  # unmunge didn't start or timed out: munged never saw it
                self.seen.forget(credential)
            raise CredentialError(f"munge refused the credential: {_refusal(exc)}") from exc
        return parse_unmunge(out.stdout)


def _refusal(exc: CommandError) -> str:
    """unmunge's own words ("Replayed credential", "Unauthorized credential for client
    UID=..."), or the STATUS it printed; never its stdout whole, which ends with the
    payload whoever made the credential chose (a replay prints it with STATUS 17)."""
    if exc.result is None:
        return str(exc)
    words = exc.result.stderr.strip()
    if words:
        return words[:200]
    match = re.search(r"^STATUS:\s*(\d+)", exc.result.stdout, re.MULTILINE)
    if match:
        code = int(match.group(1))
        return f"{_STATUS.get(code, 'munge error')} (status {code})"
    return f"unmunge exit status {exc.result.returncode}"


class RecentDigests:
    """The digests of the last ``size`` credentials seen, oldest forgotten first."""

    def __init__(self, size: int):
        self.size = size
        self._digests: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, credential: bytes) -> bool:
        """Remember ``credential``; False when it was seen before."""
        digest = hashlib.sha256(credential).digest()
        with self._lock:
            if digest in self._digests:
                return False
            self._digests[digest] = None
            if len(self._digests) > self.size:
                self._digests.popitem(last=False)
            return True

    def forget(self, credential: bytes) -> None:
        with self._lock:
            self._digests.pop(hashlib.sha256(credential).digest(), None)


def parse_unmunge(text: str) -> Decoded:
    """``unmunge --numeric`` output: ``KEY: value`` lines, a blank line, the payload."""
    head, sep, payload = text.partition("\n\n")
    if not sep:
        raise CredentialError("couldn't parse unmunge output: no payload separator")
    meta: dict[str, str] = {}
    for line in head.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            meta[key.strip()] = value.strip()
    try:
        if int(meta["STATUS"].split()[0]) != 0:
            raise CredentialError(f"munge status {meta['STATUS']}")
        length = int(meta["LENGTH"])
        uid, gid, when = int(meta["UID"]), int(meta["GID"]), int(meta["ENCODE_TIME"])
    except (KeyError, ValueError, IndexError) as exc:
        raise CredentialError(f"couldn't parse unmunge output: {exc}") from exc
    data = payload.encode("ascii", "replace")
    if len(data) != length:
        raise CredentialError(f"unmunge payload is {len(data)} bytes, metadata says {length}")
    return Decoded(uid, gid, when, data)


def for_queries(exchange: ExchangeSection) -> MungeCredentials:
    """Munge as the exchange is configured, for a login node's questions to the agents
    (:mod:`slurm_resilience.queries`): sealed for root, which only the agent is."""
    return MungeCredentials(socket=exchange.munge_socket, munge=exchange.munge,
                            unmunge=exchange.unmunge, restrict_uid=0, ttl_s=60)
