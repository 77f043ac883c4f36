"""Checkpoint exceptions, in a module of their own so that the prolog's staging step can
catch them without importing the commit protocol (and its CRC32C extension)."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint that cannot be saved, found, or trusted; the message says which and why."""


class CorruptStep(CheckpointError):
    """Bytes of a committed step don't match its manifest: the one failure that lets a
    restore fall back to an older step (never a transient error, never a missing agent)."""

    MARK = "does not verify"  # in every message, so the agent's answer carries the kind
