"""Public helpers for testing code that uses slurm-resilience.

Sites write their own health checks and training scripts; these stand-ins let
their tests run without Slurm or a GPU, with the same call shapes as the real
thing:

* :class:`FakeRunner` stands in for :class:`slurm_resilience.proc.Runner`, the one
  seam through which every external program runs (give it to ``SlurmAdapter``).
* :class:`FakeClock` stands in for :class:`slurm_resilience.clock.Clock`: time moves
  only when the code sleeps on it or the test advances it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from slurm_resilience.proc import CommandError, Completed

Answer = Completed | Exception | Callable[[Sequence[str]], Completed]


def completed(stdout: str = "", returncode: int = 0, stderr: str = "") -> Completed:
    """A finished command's result, for scripting :class:`FakeRunner`."""
    return Completed((), returncode, stdout, stderr, 0.0)


@dataclass
class FakeRunner:
    """Answers commands from a script and records every argv it was given.

    ``answers`` maps a program name (``"scontrol"``) to the answers it gives, in
    order; the last answer repeats. An answer is a :class:`Completed`, an
    exception to raise (e.g. :class:`~slurm_resilience.proc.CommandTimeout`), or a
    function of the argv. ``scontrol --version``, which the adapter asks once to
    choose between the text and JSON forms, is answered from ``slurm_version`` and
    not recorded; the default is 22.05, whose text form the scripts are written in.
    """

    answers: dict[str, list[Answer]] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)
    slurm_version: str = "22.05.8"

    def run(
        self, argv: Sequence[str], *, timeout: float, check: bool = True,
        input_text: str | None = None, env: Mapping[str, str] | None = None,
    ) -> Completed:
        program = argv[0].rsplit("/", 1)[-1]
        if program == "scontrol" and list(argv[1:]) == ["--version"]:
            return completed(f"slurm {self.slurm_version}\n")
        self.calls.append(list(argv))
        script = self.answers.get(program)
        if not script:
            raise CommandError(argv, f"FakeRunner has no answer for {program}")
        answer = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(answer, Exception):
            raise answer
        result = answer(argv) if callable(answer) else answer
        if check and result.returncode != 0:
            raise CommandError(argv, result.stderr.strip() or f"exit {result.returncode}", result)
        return result


class FakeClock:
    """A :class:`~slurm_resilience.clock.Clock` whose time moves only when code sleeps on
    it (each sleep is recorded in ``slept``) or a test calls ``advance``.

    Monotonic time starts at ``start`` and wall time at ``wall``; with ``real=True`` both
    are the real clocks moved forward by what was slept and advanced (for files stamped
    with real times).
    """

    def __init__(self, start: float = 0.0, *, wall: float = 1_700_000_000.0,
                 real: bool = False) -> None:
        self.start, self.wall, self.real = start, wall, real
        self.offset = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return (time.monotonic() if self.real else self.start) + self.offset

    def time(self) -> float:
        return (time.time() if self.real else self.wall) + self.offset

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.offset += seconds

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    @property
    def now(self) -> float:
        return self.monotonic()
