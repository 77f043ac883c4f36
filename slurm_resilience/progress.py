"""Progress a person watches at a terminal: a tqdm bar of bytes on a TTY, nothing when the
output is piped, and never in hooks or logs (only the commands a person runs make one)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from typing import Any, TextIO

# What a long operation calls as bytes arrive.
Advance = Callable[[int], None]


class ByteBar:
    """``with ByteBar(total, "step-00000010") as advance: ... advance(n)``; a bar on a
    terminal, a no-op otherwise."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.bar: Any = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm  # only a person at a terminal pays for the import

            # A terminal that reports no size (0x0: tqdm then shows nothing) gets 80x24.
            size = shutil.get_terminal_size((80, 24))
            self.bar = tqdm(total=total, desc=label, unit="B", unit_scale=True,
                            unit_divisor=1024, file=self.stream, leave=True,
                            ncols=size.columns, nrows=size.lines)

    def __call__(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> ByteBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Makes the bar of one step, once its size is known (``ckpt pull``/``verify``).
BarFactory = Callable[[int, str], ByteBar]


def quiet(total: int, label: str) -> ByteBar:
    """No bar, whatever the stream (the agent's stage-in, tests)."""
    return ByteBar(total, label, enabled=False)
