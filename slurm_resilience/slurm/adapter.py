"""The Slurm adapter: the only module that talks to Slurm.

Every operation is an argv list run through :mod:`slurm_resilience.proc`
(``shell=False``, a timeout, counted and logged). Failures come back as the
typed exceptions in :mod:`slurm_resilience.slurm.errors`, carrying Slurm's
message. Jobs and nodes are read as JSON (``scontrol --json``, 23.02+); on
22.05, whose scontrol has no ``--json``, from the ``-o`` text records, whose
parser refuses a record where a user-written value could pass for another
field. Our drains carry a fixed reason prefix; :meth:`SlurmAdapter.resume`
re-reads the node just before acting and never touches anyone else's drain.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from slurm_resilience.log import get_logger
from slurm_resilience.proc import CommandError, CommandTimeout, Completed, Runner
from slurm_resilience.slurm.errors import (
    ForeignDrain,
    JobNotFound,
    JobUpdateRefused,
    NodeNotFound,
    SlurmError,
    SlurmTimeout,
)
from slurm_resilience.slurm.parse import (
    AmbiguousRecord,
    JobInfo,
    JobRun,
    NodeInfo,
    collect_hostlist,
    expand_hostlist,
    parse_job,
    parse_node,
    parse_partition_preempt_mode,
    parse_sacct_runs,
    parse_show_config,
)
from slurm_resilience.slurm.parse_json import parse_jobs_json, parse_nodes_json
from slurm_resilience.slurm.reasons import MAX_REASON, cause_of, clean_reason

__all__ = ["MAX_REASON", "SlurmAdapter", "clean_reason", "from_config"]

log = get_logger("slurm")

_STEP_ID = re.compile(r"^\d+\.\d+$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-\[\],]*$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_NOT_FOUND = re.compile(r"(invalid node name|node .* not found|invalid job id)", re.IGNORECASE)
_UPDATE_REFUSED = re.compile(r"DB index is being set", re.IGNORECASE)
_VERSION = re.compile(r"\b(\d+)\.(\d+)(?:\.\d+)?\b")
# The first release whose scontrol prints JSON (data_parser v0.0.39).
JSON_SINCE = (23, 2)
# A node Comment we set stays this short (scontrol and sinfo show it on one line).
MAX_NODE_COMMENT = 1024


class RunnerLike(Protocol):
    def run(
        self, argv: Sequence[str], *, timeout: float, check: bool = True,
        input_text: str | None = None, env: dict[str, str] | None = None,
    ) -> Completed: ...


def _check_node_name(name: str) -> str:
    if not _NODE_NAME.match(name):
        raise ValueError(f"slurm: {name!r} is not a valid node name")
    return name


def _check_job_id(job_id: int | str) -> str:
    text = str(job_id)
    if not text.isdigit():
        raise ValueError(f"slurm: {job_id!r} is not a job id")
    return text


class SlurmAdapter:
    """Drain, resume, requeue and inspect through Slurm's CLI."""

    def __init__(
        self,
        *,
        runner: RunnerLike | None = None,
        timeout: float = 10.0,
        reason_prefix: str = "SR:",
        reason_owners_last: bool = False,
        bin_dir: str = "",
        slurm_conf: str = "",
        slurm_version: tuple[int, int] | None = None,
        observe: bool = False,
    ):
        self.runner: RunnerLike = runner or Runner()
        # Asked of `scontrol --version` (no slurmctld call) on first need, unless given.
        self._version = slurm_version
        self.timeout = timeout
        self.prefix = reason_prefix
        self.owners_last = reason_owners_last  # the layout of reasons we compose
        self.bin_dir = bin_dir
        self.env: dict[str, str] | None = None
        # The node's metrics events file (metrics.events); set by whoever knows the node.
        self.events_path = ""
        if slurm_conf:
            self.env = {"SLURM_CONF": slurm_conf}
        # mode: observe: every action is decided as usual, then recorded, not carried out.
        self.observe = observe

    # -- plumbing ---------------------------------------------------------------------------

    def _tool(self, name: str) -> str:
        return os.path.join(self.bin_dir, name) if self.bin_dir else name

    def _run(self, operation: str, argv: list[str], *, check: bool = True) -> Completed:
        argv = [self._tool(argv[0]), *argv[1:]]
        try:
            result = self.runner.run(argv, timeout=self.timeout, check=check, env=self.env)
        except CommandTimeout as exc:
            log.error("slurm call timed out", operation=operation, argv=argv)
            raise SlurmTimeout(operation, str(exc)) from exc
        except CommandError as exc:
            message = (exc.result.stderr or exc.result.stdout).strip() if exc.result else str(exc)
            log.warning("slurm call failed", operation=operation, argv=argv, error=message)
            if _NOT_FOUND.search(message):
                kind = JobNotFound if "job" in operation else NodeNotFound
                raise kind(operation, message) from exc
            if _UPDATE_REFUSED.search(message):
                raise JobUpdateRefused(operation, message) from exc
            raise SlurmError(operation, message) from exc
        log.info("slurm call", operation=operation, argv=argv, seconds=round(result.seconds, 3))
        return result

    def _would(self, action: str, target: str, detail: str) -> bool:
        """In observe mode, record the decision instead of acting and return True."""
        if not self.observe:
            return False
        from slurm_resilience.slurm import observed

        log.warning(f"observe: would {action} {target}: {detail}", action=action,
                    target=target)
        observed.record(observed.path_beside(self.events_path), action, target, detail)
        return True

    @contextlib.contextmanager
    def _node_actions_lock(self, name: str) -> Iterator[None]:
        """Serialise read-then-act on this node's drain state among the hooks and the agent
        of the node (they share its events file): a prolog and a HealthCheckProgram pass
        that find the same Xid at once would both see the node in service, both drain it
        and count two drains. Waits at most for two Slurm calls of the holder; past that it
        acts without the lock and says so. Drains of other nodes (a hang's suspect drained
        by the batch host's agent) are not covered: they share no file."""
        if not self.events_path:
            yield
            return
        path = os.path.join(os.path.dirname(self.events_path) or ".", ".node-actions.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("acting without the node-action lock", target=name, path=path,
                        error=str(exc))
            yield
            return
        try:
            deadline = time.monotonic() + 2 * self.timeout + 1.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.warning("acting without the node-action lock: its holder kept "
                                    "it past two Slurm calls", target=name, path=path)
                        break
                    time.sleep(0.02)
            yield
        finally:
            os.close(fd)

    def _count(self, kind: str, reason: str) -> None:
        if self.events_path:
            from slurm_resilience import events

            cause = reason if kind in ("requeue", "hold", "cancel") else \
                cause_of(reason, self.prefix)
            events.count(self.events_path, kind, cause)

    def slurm_version(self) -> tuple[int, int]:
        """(major, minor) of the Slurm tools, e.g. (24, 11)."""
        if self._version is None:
            out = self._run("version", ["scontrol", "--version"]).stdout
            m = _VERSION.search(out)
            if not m:
                raise SlurmError("version", f"no version in scontrol --version: {out[:80]!r}")
            self._version = (int(m.group(1)), int(m.group(2)))
        return self._version

    def _json(self) -> bool:
        return self.slurm_version() >= JSON_SINCE

    def _nodes(self, operation: str, names: str | None) -> list[NodeInfo]:
        """``scontrol show node [NAMES]`` as records, JSON where Slurm has it."""
        target = [names] if names else []
        if self._json():
            out = self._run(operation, ["scontrol", "--json", "show", "node", *target])
            try:
                return parse_nodes_json(out.stdout)
            except ValueError as exc:
                raise self._unreadable(operation, exc) from exc
        out = self._run(operation, ["scontrol", "show", "node", *target, "-o"])
        return [parse_node(line) for line in out.stdout.splitlines()
                if line.startswith("NodeName=")]

    @staticmethod
    def _unreadable(operation: str, exc: ValueError) -> SlurmError:
        message = str(exc)
        if _NOT_FOUND.search(message):
            kind = JobNotFound if "job" in operation else NodeNotFound
            return kind(operation, message)
        return SlurmError(operation, message)

    def ours(self, reason: str) -> bool:
        """Whether a node reason was set by this suite."""
        return reason.startswith(self.prefix)

    def with_prefix(self, reason: str) -> str:
        reason = clean_reason(reason)
        return reason if self.ours(reason) else clean_reason(f"{self.prefix} {reason}")

    # -- nodes ------------------------------------------------------------------------------

    def show_node(self, name: str) -> NodeInfo:
        """The node's current state, reason and features."""
        for node in self._nodes("show node", _check_node_name(name)):
            if node.name == name:
                return node
        raise NodeNotFound("show node", f"no record for {name} in scontrol output")

    def list_nodes(self) -> list[NodeInfo]:
        """Every node slurmctld knows."""
        return self._nodes("list nodes", None)

    def show_nodes(self, names: Sequence[str]) -> dict[str, NodeInfo]:
        """Several nodes' states at once: one ``scontrol show node <hostlist>``; nodes
        Slurm does not know are left out."""
        if not names:
            return {}
        expr = collect_hostlist([_check_node_name(n) for n in names])
        wanted = set(names)
        return {n.name: n for n in self._nodes("show nodes", expr) if n.name in wanted}

    def node_addresses(self, names: Sequence[str]) -> dict[str, str]:
        """Where each node is reached: its NodeAddr, else NodeHostName, else its name.

        One ``scontrol show node <hostlist>`` for all of them; nodes Slurm does not know
        are left out."""
        if not names:
            return {}
        expr = collect_hostlist([_check_node_name(n) for n in names])
        found = {node.name: node.address or node.hostname or node.name
                 for node in self._nodes("show node addresses", expr)}
        return {n: found[n] for n in names if n in found}

    def drain(self, name: str, reason: str) -> str:
        """Drain ``name`` with our prefixed reason; returns the reason set.

        An existing drain by someone else is left as it is (their reason is not
        overwritten): :class:`ForeignDrain` is raised instead. Counted as a drain only when
        the node goes into our drain: a node already out with one of our reasons (a hook
        or health check draining again at each pass) gets the new reason, not a count.
        """
        with self._node_actions_lock(name):
            return self._drain_locked(name, reason)

    def _drain_locked(self, name: str, reason: str) -> str:
        node = self.show_node(name)
        out = node.drained or node.down
        if out and node.reason and not self.ours(node.reason):
            raise ForeignDrain("drain", f"{name} already drained by {node.reason_user or '?'}: "
                                        f"{node.reason!r}; leaving it")
        text = self.with_prefix(reason)
        if self._would("drain", name, text):
            return text
        self._run("drain node", ["scontrol", "update", f"NodeName={name}", "State=DRAIN",
                                 f"Reason={text}"])
        if out and self.ours(node.reason):
            log.info("node drained again", target=name, reason=text, previous=node.reason)
        else:
            log.warning("node drained", target=name, reason=text)
            self._count("drain", text)
        return text

    def resume(self, name: str) -> bool:
        """Resume ``name`` only if its drain is ours; re-reads the reason just before acting.

        Returns False when the node is not drained. Raises :class:`ForeignDrain`
        when someone else's reason is on it.
        """
        with self._node_actions_lock(name):
            return self._resume_locked(name)

    def _resume_locked(self, name: str) -> bool:
        node = self.show_node(name)
        if not (node.drained or node.down):
            return False
        if not self.ours(node.reason):
            raise ForeignDrain("resume", f"{name} is {node.state}+{'+'.join(sorted(node.flags))} "
                                         f"with reason {node.reason!r} not set by us; leaving it")
        if self._would("resume", name, f"drained with {node.reason!r}"):
            return False
        self._run("resume node", ["scontrol", "update", f"NodeName={name}", "State=RESUME"])
        log.warning("node resumed", target=name, previous_reason=node.reason)
        self._count("resume", node.reason)
        return True

    def set_node_comment(self, name: str, text: str) -> None:
        """Replace a node's Comment (operators' field, kept across resume); one printable line."""
        line = " ".join("".join(c if c.isprintable() else " " for c in text).split())
        if self._would("comment", name, line[:MAX_NODE_COMMENT]):
            return
        self._run("set node comment", ["scontrol", "update", f"NodeName={_check_node_name(name)}",
                                       f"Comment={line[:MAX_NODE_COMMENT]}"])

    def set_features(self, name: str, available: Iterable[str], active: Iterable[str] | None = None
                     ) -> None:
        """Replace a node's available (and optionally active) features."""
        argv = ["scontrol", "update", f"NodeName={_check_node_name(name)}",
                f"AvailableFeatures={','.join(available)}"]
        if active is not None:
            argv.append(f"ActiveFeatures={','.join(active)}")
        self._run("set node features", argv)

    # -- jobs -------------------------------------------------------------------------------

    def show_job(self, job_id: int | str) -> JobInfo:
        """The job's state, nodes, restarts and comments."""
        jid = _check_job_id(job_id)
        if self._json():
            out = self._run("show job", ["scontrol", "--json", "show", "job", jid])
            try:
                jobs = parse_jobs_json(out.stdout)
            except ValueError as exc:
                raise self._unreadable("show job", exc) from exc
        else:
            out = self._run("show job", ["scontrol", "show", "job", jid, "-o"])
            try:
                jobs = [parse_job(ln) for ln in out.stdout.splitlines() if ln.startswith("JobId=")]
            except AmbiguousRecord as exc:
                log.error("job record ambiguous", job_id=jid, error=str(exc))
                raise SlurmError("show job", str(exc)) from exc
        # An array's or a het job's id can list several records; the one asked for first.
        jobs.sort(key=lambda j: j.job_id != int(jid))
        if not jobs:
            raise JobNotFound("show job", f"no record for job {job_id}")
        return jobs[0]

    def list_jobs(self, *, node: str | None = None, user: str | None = None) -> list[JobInfo]:
        """Jobs slurmctld still holds, from ``squeue --json``; filtered here because
        22.05 ignores squeue's filters when printing JSON."""
        out = self._run("list jobs", ["squeue", "--json"])
        try:
            jobs = parse_jobs_json(out.stdout)
        except ValueError as exc:
            raise self._unreadable("list jobs", exc) from exc
        if node is not None:
            jobs = [j for j in jobs if node in j.nodes]
        if user is not None:
            jobs = [j for j in jobs if j.user == user]
        return jobs

    def job_runs(self, job_id: int | str) -> list[JobRun]:
        """Every run of the job from Slurm accounting (``sacct --duplicates``), oldest first;
        raises SlurmError where accounting is not configured."""
        out = self._run("job runs", ["sacct", "-j", _check_job_id(job_id), "--duplicates",
                                     "-X", "-n", "-P", "-o",
                                     "JobID,State,Start,End,NodeList"])
        return parse_sacct_runs(out.stdout)

    def job_steps(self, job_id: int | str) -> list[tuple[str, str]]:
        """The job's running steps as (``JOB.STEP``, name); the job's own launcher reads
        them (as the job's user) to end the step it started."""
        return [(step, name) for step, name in self._step_rows(job_id, "%j")
                if _STEP_ID.match(step)]

    def _step_rows(self, job_id: int | str, field: str) -> list[tuple[str, str]]:
        """The job's running steps (batch and extern included) as (``JOB.STEP``, ``field``
        of squeue's step format)."""
        out = self._run("list job steps", ["squeue", "--steps",
                                           f"--jobs={_check_job_id(job_id)}", "--noheader",
                                           f"--format=%i|{field}"])
        rows = [line.strip().partition("|") for line in out.stdout.splitlines()]
        return [(step, value) for step, _, value in rows if step]

    def node_in_use(self, node: str, job_id: int) -> str:
        """Whether anything but job ``job_id``'s bare allocation uses ``node``: "" when that
        job is the only one on it and none of its steps (the batch script included; its
        ``extern`` step holds no work) runs there, else what does. Two squeue calls."""
        name = _check_node_name(node)
        out = self._run("list jobs on node", ["squeue", f"--nodelist={name}", "--noheader",
                                              "--format=%A"])
        others = sorted({j.strip() for j in out.stdout.split()} - {str(job_id)})
        if others:
            return f"job {', '.join(others)} on {node}"
        for step, nodes in self._step_rows(job_id, "%N"):
            if not step.endswith(".extern") and node in expand_hostlist(nodes):
                return f"step {step} on {node}"
        return ""

    def signal_step(self, step_id: str, signal: str = "KILL") -> None:
        """Send ``signal`` to every task of one step (the caller's own: scancel checks)."""
        if not _STEP_ID.match(step_id) or not signal.isalnum():
            raise ValueError(f"slurm: {step_id!r} is not a step id or {signal!r} a signal")
        self._run("signal job step", ["scancel", f"--signal={signal}", step_id])

    def requeue(self, job_id: int | str, cause: str = "hang") -> None:
        """Put a running job back in the queue; it restarts with Restarts+1. ``cause``: what
        the metrics count it as (hang, node_fault, time_limit, preempt)."""
        if self._would("requeue", f"job {job_id}", "requeue"):
            return
        self._run("requeue job", ["scontrol", "requeue", _check_job_id(job_id)])
        log.warning("job requeued", job_id=str(job_id), cause=cause)
        self._count("requeue", cause)

    def requeue_hold(self, job_id: int | str, reason: str = "", *, released: bool = False,
                     cause: str = "hang") -> None:
        """Requeue and hold; a human (or :meth:`release`) must let it go. ``released``: the
        caller releases it next (held only while its exclusions are set), so it is counted
        as a requeue, not a hold."""
        jid = _check_job_id(job_id)
        if self._would("hold", f"job {jid}", reason or "requeue held"):
            return
        self._run("requeue-hold job", ["scontrol", "requeuehold", jid])
        if reason:
            self.set_admin_comment(jid, reason)
        log.warning("job requeued held", job_id=jid, reason=reason)
        self._count("requeue" if released else "hold", cause)

    def cancel(self, job_id: int | str) -> None:
        """Cancel a job (e.g. a hung ``--no-requeue`` job, when the policy says so)."""
        if self._would("cancel", f"job {job_id}", "cancel"):
            return
        self._run("cancel job", ["scancel", _check_job_id(job_id)])
        log.warning("job cancelled", job_id=str(job_id))
        self._count("cancel", "hang")

    def release(self, job_id: int | str) -> None:
        """Release a held job."""
        if self._would("release", f"job {job_id}", "release"):
            return
        self._run("release job", ["scontrol", "release", _check_job_id(job_id)])

    def set_admin_comment(self, job_id: int | str, text: str) -> None:
        """Set the job's AdminComment (visible to operators, not settable by users)."""
        if self._would("comment", f"job {job_id}", text):
            return
        self._run("set admin comment", ["scontrol", "update", f"JobId={_check_job_id(job_id)}",
                                        f"AdminComment={clean_reason(self.with_prefix(text))}"])

    def set_excluded_nodes(self, job_id: int | str, nodes: Sequence[str]) -> None:
        """Replace the job's excluded node list (a pending job will avoid them)."""
        names = [_check_node_name(n) for n in nodes]
        if self._would("exclude", f"job {job_id}", f"ExcNodeList={collect_hostlist(names)}"):
            return
        self._run("update excluded nodes", ["scontrol", "update", f"JobId={_check_job_id(job_id)}",
                                            f"ExcNodeList={collect_hostlist(names)}"])

    def exclude_nodes(self, job_id: int | str, nodes: Sequence[str]) -> tuple[str, ...]:
        """Add ``nodes`` to the job's excluded list, keeping what was there."""
        job = self.show_job(job_id)
        merged = sorted(set(job.exc_nodes) | set(nodes))
        self.set_excluded_nodes(job_id, merged)
        return tuple(merged)

    def reconfigure(self) -> None:
        """Ask slurmctld to re-read slurm.conf."""
        self._run("reconfigure", ["scontrol", "reconfigure"])

    def show_config(self) -> dict[str, str]:
        """The configuration slurmctld runs with (``scontrol show config``): every key
        after Include files and defaults, as the daemons see it."""
        return parse_show_config(self._run("show config", ["scontrol", "show", "config"]).stdout)

    def preempt_mode(self, partition: str) -> str:
        """What preemption does to a job of ``partition`` (its own PreemptMode, else the
        cluster's: ``scontrol show partition`` prints the one that applies), upper case."""
        if not _PARTITION.match(partition):
            raise ValueError(f"slurm: {partition!r} is not a partition name")
        out = self._run("show partition", ["scontrol", "show", "partition", partition, "-o"])
        try:
            return parse_partition_preempt_mode(out.stdout)
        except ValueError as exc:
            raise self._unreadable("show partition", exc) from exc

    def ping(self) -> bool:
        """Whether slurmctld answers."""
        out = self._run("ping", ["scontrol", "ping"], check=False)
        return "UP" in out.stdout


def from_config(cfg: object) -> SlurmAdapter:
    """Build the adapter from a loaded :class:`~slurm_resilience.config.Config`."""
    from slurm_resilience.config.schema import Config

    assert isinstance(cfg, Config)
    s = cfg.slurm
    return SlurmAdapter(timeout=s.timeout_s, reason_prefix=s.reason_prefix,
                        reason_owners_last=s.reason_owners == "last", bin_dir=s.bin_dir,
                        slurm_conf=s.conf, observe=cfg.mode == "observe")
