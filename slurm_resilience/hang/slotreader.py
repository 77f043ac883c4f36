"""Reading a job's heartbeat slots on this node, as root, trusting nothing in them but their
numbers: only regular files owned by the job's user in its private run directory."""

from __future__ import annotations

import os

from slurm_resilience import safefs
from slurm_resilience.hang import jobrecord
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.heartbeat import slot as S

MAX_SLOTS = 4096


def read_slots(run_dir_template: str, node: str, rec: jobrecord.JobRecord
               ) -> tuple[list[S.SlotView], list[str]]:
    """Every valid slot of the job, checked to belong to the job's user; and what was refused."""
    directory = P.job_dir(run_dir_template, node, rec.job_id)
    views: list[S.SlotView] = []
    errors: list[str] = []
    try:
        fd = safefs.open_dir(directory)
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [f"{directory}: {exc}"]
    try:
        safefs.check_owned_dir(fd, rec.uid, private=True, what=directory)
        for name in os.listdir(fd)[:MAX_SLOTS]:
            if not S.SLOT_NAME.match(name):
                continue
            try:
                view = S.read_consistent(lambda n=name: safefs.read_owned_file(
                    fd, n, rec.uid, max_bytes=S.SIZE, exact=S.SIZE))
            except (OSError, S.SlotFormatError) as exc:
                errors.append(f"{name}: {exc}")
                continue
            if view.job_id != rec.job_id or name != S.slot_filename(view.rank):
                errors.append(f"{name}: slot says job {view.job_id} rank {view.rank}")
                continue
            views.append(view)
    except OSError as exc:
        errors.append(f"{directory}: {exc}")
    finally:
        os.close(fd)
    return views, errors
