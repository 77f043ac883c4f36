"""Our drain reasons, written and recognised by their structure, never by their text.

A reason we set reads ``<prefix> <owners>: <first finding>`` with `` (+N more)`` when more
was found: ``SR: health: gpu3 XID 79 (GPU fell off the bus) 12:01:07 (+2 more)``. The owners
(the steps that found something, ``health``, ``nccl``...) sit right after the prefix, so
whoever resumes knows whose drain it is however Slurm or we shortened the end.

``sinfo -R`` shows 20 characters by default, and ``SR: health: `` takes 12 of them. A site
that reads reasons there puts the owners last (``slurm.reason_owners: last``):
``SR: gpu3 XID 79 (GPU fell off the bus) 12:01:07 (+2 more) [by health]``. Both layouts are
always recognised, so changing the setting never orphans a drain set before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# Slurm keeps reasons short in sinfo's default width; longer ones are still stored.
MAX_REASON = 200
_OWNER = re.compile(r"[a-z][a-z0-9_-]{0,23}")
# The owners-last layout's tail: `` [by health,nccl]``.
_OWNERS_LAST = re.compile(r" \[by ([a-z][a-z0-9_,-]{0,99})\]$")
_ELLIPSIS = "..."


def clean_reason(text: str) -> str:
    """One line, printable, bounded: a reason must never break ``scontrol`` or ``sinfo``."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text[:MAX_REASON]


def owner_of(step: str) -> str:
    """A step's name as an owner tag; anything else (a crashed step's spec) is ``hooks``."""
    return step if _OWNER.fullmatch(step) else "hooks"


@dataclass(frozen=True)
class OwnReason:
    """A reason we set, taken apart."""

    owners: frozenset[str]
    text: str


def compose(prefix: str, owners: Iterable[str], first: str, more: int = 0,
            limit: int = MAX_REASON, owners_last: bool = False) -> str:
    """``<prefix> <owners>: <first> (+more more)`` (or ``<prefix> <first> (+more more)
    [by <owners>]``), within ``limit`` characters: the first finding is shortened, never the
    owners or the count."""
    tags = sorted({owner_of(o) for o in owners}) or ["hooks"]
    if owners_last:
        head = f"{prefix} "
        tail = (f" (+{more} more)" if more > 0 else "") + f" [by {','.join(tags)}]"
    else:
        head = f"{prefix} {','.join(tags)}: "
        tail = f" (+{more} more)" if more > 0 else ""
    text = clean_reason(first).removeprefix(head)
    room = max(limit - len(head) - len(tail), len(_ELLIPSIS) + 1)
    if len(text) > room:
        text = text[:room - len(_ELLIPSIS)].rstrip() + _ELLIPSIS
    return head + text + tail


def parse(reason: str, prefix: str) -> OwnReason | None:
    """The owners of a reason we set; None for anyone else's reason, or one of ours
    from before reasons carried their owners."""
    if not reason.startswith(prefix):
        return None
    last = _OWNERS_LAST.search(reason)
    if last is not None:
        names = last.group(1).split(",")
        if all(_OWNER.fullmatch(n) for n in names):
            return OwnReason(frozenset(names), reason[len(prefix):last.start()].strip())
    owners, sep, text = reason[len(prefix):].lstrip().partition(": ")
    names = owners.split(",")
    if not sep or not all(_OWNER.fullmatch(n) for n in names):
        return None
    return OwnReason(frozenset(names), text)


def owned_by(reason: str, prefix: str, owner: str, legacy: Iterable[str] = ()) -> bool:
    """Whether ``reason`` is a drain ``owner`` alone set, whatever its length: its owner
    tag says so. ``legacy``: the reasons an older version remembered setting, from before
    reasons carried their owners; an untagged reason made only of those is also ours."""
    own = parse(reason, prefix)
    if own is not None:
        return own.owners == {owner}
    remembered = set(legacy)
    parts = reason[len(prefix):].strip().split("; ")
    return reason.startswith(prefix) and bool(remembered) and set(parts) <= remembered


def cause_of(reason: str, prefix: str) -> str:
    """The cause of one of our Slurm reasons: its owner tags (``health``, ``nccl``,
    ``hang``...), else ``other``."""
    own = parse(reason, prefix)
    if own is not None:
        return ",".join(sorted(own.owners))
    if "hang" in reason:
        return "hang_suspect" if "suspect" in reason else "hang"
    return "other"
