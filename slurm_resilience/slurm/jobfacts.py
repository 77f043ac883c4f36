"""What Slurm says of one job, asked once by a command a person runs (``goodput``,
``report``): its runs in accounting with each run's nodes, and its state now. A failure is
kept as one line, so it is said once and cleanly."""

from __future__ import annotations

from dataclasses import dataclass, field

from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import JobNotFound, SlurmError
from slurm_resilience.slurm.parse import JobInfo, JobRun


@dataclass
class SlurmFacts:
    """What Slurm says of the job, asked once: its runs in accounting, and its state now.
    A failure is kept as one line (shown once, in the notes)."""

    runs: list[JobRun] = field(default_factory=list)
    runs_error: str = ""
    info: JobInfo | None = None
    gone: bool = False  # slurmctld no longer knows the job
    info_error: str = ""

    def nodes(self) -> list[str]:
        """Every node of every run, first seen first."""
        seen = [n for r in self.runs for n in r.nodes] + list(self.info.nodes if self.info
                                                               else ())
        return list(dict.fromkeys(seen))


def one_line(exc: BaseException) -> str:
    """An error from a Slurm command as one line: its first non-empty line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def slurm_facts(adapter: SlurmAdapter, job_id: int) -> SlurmFacts:
    facts = SlurmFacts()
    try:
        facts.runs = adapter.job_runs(job_id)
    except SlurmError as exc:
        facts.runs_error = one_line(exc)
    try:
        facts.info = adapter.show_job(job_id)
    except JobNotFound:
        facts.gone = True
    except SlurmError as exc:
        facts.info_error = one_line(exc)
    return facts
