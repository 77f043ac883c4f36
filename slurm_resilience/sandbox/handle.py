"""A handle on a running sandbox for tests and the demo: run commands in its
environment, submit jobs (optionally as another user), wait for them, and
change the hooks' configuration.
"""

from __future__ import annotations

import copy
import os
import pwd
import shlex
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from slurm_resilience.proc import Completed, Runner
from slurm_resilience.sandbox import control, resilience_conf
from slurm_resilience.sandbox.layout import Layout
from slurm_resilience.sandbox.statefiles import S3Info
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import SlurmError
from slurm_resilience.slurm.parse import JOB_FINAL_STATES, JobInfo

FINISHED = JOB_FINAL_STATES


class Sandbox:
    """One started sandbox; :meth:`start` brings it up, :meth:`stop` takes it down."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.state_dir = layout.state_dir
        self.nodes = layout.node_names
        self.slurm_conf = layout.slurm_conf
        self.resilience_config = layout.resilience_conf
        self.env = control.user_env(layout)
        self.runner = Runner(env=self.env)
        self.jobs_dir = layout.state_dir / "jobs"
        self._job_count = 0

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def start(cls, layout: Layout, *, install: bool = False) -> Sandbox:
        control.up(layout, install=install)
        box = cls(layout)
        box.jobs_dir.mkdir(exist_ok=True)
        box.jobs_dir.chmod(0o1777)  # job scripts and outputs of any test user
        return box

    def stop(self) -> list[str]:
        return control.down(self.layout)

    def restart_slurmctld(self) -> None:
        control.restart_slurmctld(self.layout)

    @property
    def s3(self) -> S3Info:
        return control.s3_info(self.layout)

    def node_dir(self, name: str) -> Path:
        return self.layout.node_dir(name)

    def leaf_of(self, node: str) -> str:
        return self.layout.leaf_of()[node]

    # -- commands ----------------------------------------------------------------------------

    def adapter(self, timeout: float = 10.0) -> SlurmAdapter:
        """The suite's Slurm adapter, pointed at this sandbox."""
        return control.adapter(self.layout, timeout=timeout)

    def run(self, argv: Sequence[str], *, user: str | None = None, timeout: float = 30.0,
            check: bool = True, env: Mapping[str, str] | None = None,
            input_text: str | None = None) -> Completed:
        """Run ``argv`` with the sandbox's environment, as ``user`` when given (via runuser)."""
        full = list(argv)
        if user is not None:
            full = [control.tool("runuser"), "-u", user, "--", *full]
        return self.runner.run(full, timeout=timeout, check=check, env=env,
                               input_text=input_text)

    def sbatch(self, script: str | Sequence[str], *, user: str | None = None,
               args: Sequence[str] = (), timeout: float = 30.0,
               env: Mapping[str, str] | None = None) -> int:
        """Submit a batch job and return its id.

        ``script`` is either the text of a batch script (``#!/bin/sh`` added when
        missing) or an argv list run with ``--wrap``. Output goes to
        ``jobs/slurm-<id>.out`` unless ``args`` choose otherwise.
        """
        self._job_count += 1
        argv = ["sbatch", "--parsable", f"--chdir={self.jobs_dir}"]
        if not any(a.startswith(("--output", "-o")) for a in args):
            argv.append(f"--output={self.jobs_dir}/slurm-%j.out")
        argv += list(args)
        if isinstance(script, str):
            text = script if script.startswith("#!") else "#!/bin/sh\n" + script
            path = self.jobs_dir / f"job-{time.time_ns()}-{self._job_count}.sh"
            path.write_text(text)
            path.chmod(0o755)
            argv.append(str(path))
        else:
            argv.append(f"--wrap={shlex.join(script)}")
        out = self.run(argv, user=user, timeout=timeout, env=env)
        return int(out.stdout.strip().split(";")[0])

    def user_dir(self, user: str, name: str) -> Path:
        """A fresh directory under jobs/ owned by ``user``, for a test job's files."""
        pw = pwd.getpwnam(user)
        d = self.jobs_dir / f"{name}-{time.time_ns()}"
        d.mkdir(mode=0o755)
        os.chown(d, pw.pw_uid, pw.pw_gid)
        return d

    def output(self, job_id: int) -> str:
        """The default output file of a job submitted with :meth:`sbatch`."""
        path = self.jobs_dir / f"slurm-{job_id}.out"
        return path.read_text() if path.exists() else ""

    def job(self, job_id: int) -> JobInfo:
        return self.adapter().show_job(job_id)

    def wait_job(self, job_id: int, states: Collection[str] = FINISHED, timeout: float = 60.0,
                 *, poll: float = 0.25) -> JobInfo:
        """Wait until the job's state is one of ``states``; returns the job then.

        Raises TimeoutError naming the last state seen.
        """
        deadline = time.monotonic() + timeout
        ctl = self.adapter()
        last: JobInfo | None = None
        while True:
            last = ctl.show_job(job_id)
            if last.state in states:
                return last
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {last.state} ({last.reason}) after "
                                   f"{timeout:g}s, expected one of {sorted(states)}")
            time.sleep(poll)

    def wait_nodes_ready(self, timeout: float = 30.0) -> None:
        """Wait until every node is IDLE and schedulable."""
        ctl = self.adapter()
        deadline = time.monotonic() + timeout
        while True:
            nodes = ctl.list_nodes()
            if all(control.ready(n) for n in nodes):
                return
            if time.monotonic() > deadline:
                bad = [f"{n.name}={n.state}+{'+'.join(sorted(n.flags))} {n.reason}"
                       for n in nodes if not control.ready(n)]
                raise TimeoutError(f"nodes not ready after {timeout:g}s: {bad}")
            time.sleep(0.2)

    # -- the hooks' configuration --------------------------------------------------------------

    def base_resilience_sections(self) -> dict[str, dict[str, Any]]:
        return resilience_conf.sections(self.layout)

    def update_resilience_config(self, sections: Mapping[str, Mapping[str, Any]]) -> None:
        """Merge ``sections`` into the sandbox defaults and rewrite the hooks' YAML.

        Hooks read it on every run, so the change applies to the next prolog,
        epilog or health check. A key set to None is removed. Each call starts
        from the defaults, so changes of earlier calls do not pile up.
        """
        merged = copy.deepcopy(self.base_resilience_sections())
        for name, values in sections.items():
            section = merged.setdefault(name, {})
            for key, value in values.items():
                if value is None:
                    section.pop(key, None)
                else:
                    section[key] = value
        control.write_resilience_conf(self.layout, merged)

    def reset(self, timeout: float = 30.0) -> None:
        """Back to a clean cluster between tests: cancel every job, resume every
        drained node (whoever drained it) and clear node Comments, heal every node's
        stand-in hardware and restore the default hooks' config."""
        from slurm_resilience.sandbox import faults

        control.write_resilience_conf(self.layout, self.base_resilience_sections())
        for name in self.nodes:
            faults.heal(self.state_dir, name)
        ctl = self.adapter()
        jobs = [j for j in ctl.list_jobs() if j.state not in FINISHED]
        if jobs:
            self.run(["scancel", *[str(j.job_id) for j in jobs]], check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not [j for j in ctl.list_jobs() if j.state not in FINISHED]:
                break
            time.sleep(0.2)
        for node in ctl.list_nodes():
            # Not NOT_RESPONDING alone: a just-resumed node shows it until slurmctld's ping.
            if node.drained or node.state == "DOWN":
                try:
                    self.run(["scontrol", "update", f"NodeName={node.name}", "State=RESUME"])
                except Exception as exc:  # the message says which node could not be resumed
                    raise SlurmError("reset", f"couldn't resume {node.name}: {exc}") from exc
            if node.comment:
                # Hang handling's record of take-outs lives there and outlives a resume: left
                # in place it would spend the next test's hourly hang budget.
                try:
                    self.run(["scontrol", "update", f"NodeName={node.name}", "Comment="])
                except Exception as exc:
                    raise SlurmError("reset", f"couldn't clear the Comment of {node.name}: "
                                              f"{exc}") from exc
        self.wait_nodes_ready(timeout)
