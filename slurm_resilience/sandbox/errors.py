"""The sandbox's one error type, and the log excerpt its messages carry."""

from __future__ import annotations

from pathlib import Path


class SandboxError(Exception):
    """The sandbox could not be brought up, or is in a state the command cannot use."""


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a daemon's log, headed by its path (or that it is missing)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"--- {path}: missing"
    except OSError as exc:
        return f"--- {path}: couldn't read: {exc}"
    if not text:
        return f"--- {path}: empty"
    return f"--- last {min(lines, len(text))} lines of {path}:\n" + "\n".join(text[-lines:])


def failed(daemon: str, what: str, logs: list[Path], lines: int = 15) -> SandboxError:
    """``sandbox: up: <daemon> <what>`` followed by the tails of its logs."""
    return SandboxError(f"sandbox: up: {daemon} {what}\n"
                        + "\n".join(tail(p, lines) for p in logs))
