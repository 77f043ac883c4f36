"""Public helpers for testing code that uses slurm-resilience.

Sites write their own health checks and training scripts; these stand-ins let
their tests run without Slurm or a GPU, with the same call shapes as the real
thing:

* :class:`FakeRunner` stands in for :class:`slurm_resilience.proc.Runner`, the one
  seam through which every external program runs (give it to ``SlurmAdapter``).
"""

from __future__ import annotations

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
