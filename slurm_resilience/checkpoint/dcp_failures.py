"""What a failed DCP load says: DCP gathers every rank's failure into one exception
(a CheckpointException with ``failures``), which every rank then holds alike."""

from __future__ import annotations

from slurm_resilience.checkpoint.errors import CorruptStep


def corrupt_message(exc: BaseException) -> str | None:
    """The message of a CorruptStep behind ``exc`` (DCP wraps each rank's failure), if any."""
    if isinstance(exc, CorruptStep):
        return str(exc)
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for _rank, err in sorted(failures.items()):
            inner = err[0] if isinstance(err, tuple) else err
            # DCP turns a failed read_metadata into an AssertionError carrying its message.
            if isinstance(inner, CorruptStep) or CorruptStep.MARK in str(inner):
                return str(inner)
    inner_exc = exc.__cause__ or exc.__context__
    return corrupt_message(inner_exc) if inner_exc is not None and inner_exc is not exc else None


def failure_cause(exc: BaseException) -> str:
    """DCP wraps each rank's failure (a CheckpointException); name the first one plainly."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, err = sorted(failures.items())[0]
        inner = err[0] if isinstance(err, tuple) else err
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"
