"""The agent's hang watcher: reads every job's heartbeat slots on this node, and on a hang
captures evidence, blames, drains and requeues (on the batch host only, once per run).

Gather (slots, records) → pure judge → incident thread: evidence → rendezvous
→ blame → decision → action → report. The tick itself only reads small files;
everything slow runs in one thread per incident.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience import config
from slurm_resilience.agent.service import AgentContext, Handler, Peer, RequestError
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.heartbeat import blame as B
from slurm_resilience.heartbeat import detect, evidence, exchange, incident, jobrecord, safefs
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.heartbeat import requeue as R
from slurm_resilience.heartbeat import slot as S
from slurm_resilience.heartbeat.steps import remove_tree
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import ForeignDrain, SlurmError

log = get_logger("heartbeat")

MAX_SLOTS = 4096
# Per-job markers and tuned timeouts outlive requeues; after this long the job is long gone.
STATE_RETENTION_S = 14 * 86400
CLEANUP_EVERY_S = 3600.0


@dataclass
class JobView:
    """The latest reading of one job on this node."""

    record: jobrecord.JobRecord
    slots: list[S.SlotView]
    verdict: detect.JobVerdict
    errors: list[str] = field(default_factory=list)
    read_at: float = 0.0


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


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
        raise RequestError(f"{what} must be a job id (digits), got {value!r}")
    return int(value)


class HangWatcher:
    """The ``heartbeat`` agent service."""

    name = "heartbeat"

    def __init__(self, cfg: Config, node: str, adapter: SlurmAdapter):
        self.cfg = cfg
        self.hb = cfg.heartbeat
        self.node = node
        self.adapter = adapter
        self.interval_s = self.hb.interval_s
        self.records_dir = P.records_dir(cfg.node.run_dir, node)
        self.state_dir = os.path.join(node_path(cfg.node.state_dir, node), "heartbeat")
        self.incident_dir = (node_path(self.hb.incident_dir, node) if self.hb.incident_dir
                             else os.path.join(node_path(cfg.node.state_dir, node), "incidents"))
        self.jobs: dict[int, JobView] = {}
        self.handled: set[tuple[int, int]] = set()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.tuned: dict[int, float] = {}
        self.config_path, _ = config.resolve_path()
        self.next_cleanup = 0.0
        self.config_mtime = self._mtime()
        # hang-net: without a shared rendezvous_dir (checked per incident, so a reload can
        # switch), agents exchange pieces over the network; the listener runs from the start.
        try:
            self.exchange = exchange.from_config(self.hb.exchange, node, adapter.node_addresses)
        except OSError as exc:
            log.error("exchange: start: couldn't listen; other nodes' observations won't "
                      "reach this agent", port=self.hb.exchange.port_of(node), error=str(exc))
            self.exchange = exchange.from_config(self.hb.exchange, node,
                                                 adapter.node_addresses, listen=False)

    # -- live settings ---------------------------------------------------------------------------

    def _mtime(self) -> float:
        try:
            return os.stat(self.config_path).st_mtime
        except OSError:
            return 0.0

    def reload(self) -> None:
        """Pick up a changed ``heartbeat`` section (e.g. observe → act) without a restart."""
        mtime = self._mtime()
        if mtime == self.config_mtime:
            return
        self.config_mtime = mtime
        try:
            fresh = config.load(self.config_path)
        except config.ConfigError as exc:
            log.error("couldn't reload config; keeping the previous heartbeat settings",
                      error=str(exc))
            return
        if fresh.heartbeat != self.hb:
            log.info("heartbeat settings reloaded", mode=fresh.heartbeat.mode)
        self.cfg = fresh
        self.hb = fresh.heartbeat
        self.interval_s = self.hb.interval_s

    # -- gather and judge ------------------------------------------------------------------------

    def tick(self) -> None:
        self.reload()
        if self.hb.mode == "off":
            return
        records, errors = jobrecord.read_all(self.records_dir)
        for err in errors:
            log.warning("couldn't read job record", error=err)
        seen = set()
        for rec in records:
            seen.add(rec.job_id)
            self.watch(rec)
        with self.lock:
            for job_id in set(self.jobs) - seen:
                del self.jobs[job_id]
                self.tuned.pop(job_id, None)
            self.threads = [t for t in self.threads if t.is_alive()]
        if not self.hb.rendezvous_dir:
            for job_id, run, sender in self.exchange.announced():
                view = self.jobs.get(job_id)
                if view is not None and sender != self.node:
                    self.start_incident(view, trigger=f"hang seen on {sender}", restart=run,
                                        remote=True)
        if time.monotonic() >= self.next_cleanup:
            self.next_cleanup = time.monotonic() + CLEANUP_EVERY_S
            self.cleanup(time.time() - STATE_RETENTION_S)

    def _cleanup_rendezvous(self, older_than: float) -> int:
        root = node_path(self.hb.rendezvous_dir, self.node)
        try:
            fd = safefs.open_dir(root)
        except FileNotFoundError:
            return 0
        removed = 0
        try:
            for name in os.listdir(fd):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if name.startswith("job-") and st.st_mtime < older_than:
                    removed += remove_tree(fd, name)
        finally:
            os.close(fd)
        return removed

    def cleanup(self, older_than: float) -> int:
        """Remove act markers and tuned timeouts last written before ``older_than``."""
        removed = 0
        if self.hb.rendezvous_dir:
            removed += self._cleanup_rendezvous(older_than)
        removed += self.exchange.cleanup(older_than)
        for directory, match in ((os.path.join(self.state_dir, "acted"), lambda n: True),
                                 (self.state_dir, lambda n: n.startswith("tune-"))):
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            for name in names:
                path = os.path.join(directory, name)
                try:
                    st = os.lstat(path)
                    if match(name) and stat.S_ISREG(st.st_mode) and st.st_mtime < older_than:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed

    def watch(self, rec: jobrecord.JobRecord, now: float | None = None) -> JobView:
        slots, errors = read_slots(self.cfg.node.run_dir, self.node, rec)
        for err in errors:
            log.warning("refused heartbeat slot", job_id=rec.job_id, error=err)
        alive = {v.rank: evidence.same_process(v.pid, v.pid_start, rec.uid) for v in slots}
        tuned = self._tuned(rec.job_id) if self.hb.auto_tune else None
        verdict = detect.judge(rec.job_id, slots, time.monotonic() if now is None else now,
                               self.hb, alive=alive, tuned=tuned)
        if verdict.tuned_timeout_s is not None and verdict.tuned_timeout_s != tuned:
            self._save_tuned(rec.job_id, verdict.tuned_timeout_s)
        view = JobView(rec, slots, verdict, errors, time.time())
        with self.lock:
            previous = self.jobs.get(rec.job_id)
            self.jobs[rec.job_id] = view
        changed = previous is None or previous.verdict.stragglers != verdict.stragglers
        if changed and verdict.stragglers:
            log.warning("straggler ranks", job_id=rec.job_id, ranks=list(verdict.stragglers))
        if verdict.mode != "off" and verdict.hung:
            self.start_incident(view, trigger="timeout")
        elif verdict.mode != "off" and self.hb.rendezvous_dir:
            self._check_remote(view)
        return view

    def _check_remote(self, view: JobView) -> None:
        """A hang another node's agent published for this job's current run: the batch host
        must act even when its own ranks still progress (or it runs none of them)."""
        job_dir = os.path.join(node_path(self.hb.rendezvous_dir, self.node),
                               f"job-{view.record.job_id}")
        if view.slots:
            runs = [max(v.restart_count for v in view.slots)]
        else:
            try:
                runs = [max(int(n[4:]) for n in os.listdir(job_dir)
                            if n.startswith("run-") and n[4:].isdigit())]
            except (FileNotFoundError, ValueError):
                return
        run_dir = os.path.join(job_dir, f"run-{runs[0]}")
        try:
            names = os.listdir(run_dir)
        except FileNotFoundError:
            return
        others = []
        for name in names:
            if not name.endswith(".json") or name[:-5] == self.node:
                continue
            try:
                # Only observations made while this run was on this node: a requeued job's
                # new nodes must not act on what the previous run left behind.
                if os.stat(os.path.join(run_dir, name)).st_mtime >= view.record.started:
                    others.append(name[:-5])
            except FileNotFoundError:
                continue
        if others:
            self.start_incident(view, trigger=f"hang seen on {', '.join(sorted(others))}",
                                restart=runs[0], remote=True)

    def start_incident(self, view: JobView, trigger: str, restart: int | None = None,
                       remote: bool = False) -> bool:
        if restart is None:
            restart = max((v.restart_count for v in view.slots), default=0)
        key = (view.record.job_id, restart)
        with self.lock:
            if key in self.handled:
                return False
            self.handled.add(key)
        thread = threading.Thread(target=self._incident_safely,
                                  args=(view, trigger, restart if remote else None),
                                  name=f"hang-{key[0]}", daemon=True)
        with self.lock:
            self.threads.append(thread)
        thread.start()
        return True

    # -- auto-tune persistence -------------------------------------------------------------------

    def _tune_file(self, job_id: int) -> str:
        return os.path.join(self.state_dir, f"tune-{int(job_id)}.json")

    def _tuned(self, job_id: int) -> float | None:
        if job_id in self.tuned:
            return self.tuned[job_id]
        try:
            with open(self._tune_file(job_id), encoding="utf-8") as fh:
                value = float(json.load(fh)["timeout_s"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("couldn't read tuned timeout", job_id=job_id, error=str(exc))
            return None
        self.tuned[job_id] = value
        return value

    def _save_tuned(self, job_id: int, value: float) -> None:
        self.tuned[job_id] = value
        fd = safefs.makedirs_root(self.state_dir)
        try:
            safefs.replace_file(fd, f"tune-{job_id}.json",
                                json.dumps({"timeout_s": value}).encode())
        finally:
            os.close(fd)

    # -- the incident ----------------------------------------------------------------------------

    def _incident_safely(self, view: JobView, trigger: str, run: int | None) -> None:
        try:
            self.incident(view, trigger, run)
        except Exception:
            log.exception("hang incident handling failed", job_id=view.record.job_id)

    def _local_piece(self, view: JobView, trigger: str) -> dict[str, Any]:
        """Evidence and observations of this node's ranks."""
        rec = view.record
        stalled = [v for v in view.slots
                   if next(r for r in view.verdict.ranks if r.rank == v.rank).state
                   not in ("done", "dead")]
        files_dir = os.path.join(self.incident_dir, "files")
        save_fd: int | None = None
        try:
            save_fd = safefs.makedirs_root(files_dir)
        except OSError as exc:
            log.warning("couldn't create incident file directory", path=files_dir,
                        error=str(exc))
        try:
            ranks_ev = evidence.capture_ranks(
                stalled, rec.uid, py_spy=evidence.find_py_spy(self.hb.py_spy),
                timeout=self.hb.evidence_timeout_s, save_dir_fd=save_fd)
        finally:
            if save_fd is not None:
                os.close(save_fd)
        xids = evidence.xids_since(self.cfg, self.node, rec.started)
        health = evidence.health_snapshot(self.cfg, self.node)
        stacks = {e.rank: e.stack for e in ranks_ev}
        states = {r.rank: r for r in view.verdict.ranks}
        obs = [B.RankObservation(v.rank, self.node, v.step, v.wall(v.last_progress),
                                 B.in_collective(stacks.get(v.rank, "")), v.ewma_dt)
               for v in stalled]
        ranks = [{**states[v.rank].__dict__, "node": self.node, "pid": v.pid,
                  "ckpt_step": v.ckpt_step, "mean_step_s": round(v.ewma_dt, 4),
                  "max_step_s": round(v.max_dt, 4),
                  "last_progress_at": v.wall(v.last_progress)} for v in view.slots]
        return {
            "node": self.node, "trigger": trigger, "at": time.time(),
            "ranks": ranks, "observations": [o.__dict__ for o in obs],
            "ckpt_step": max((v.ckpt_step for v in view.slots), default=-1),
            "stragglers": list(view.verdict.stragglers),
            "findings": evidence.node_findings(xids, health),
            "evidence": {"ranks": [e.to_json() for e in ranks_ev], "xids": xids,
                         "health": health},
        }

    def _rendezvous(self, job_id: int, restarts: int) -> str | None:
        if not self.hb.rendezvous_dir:
            return None
        return os.path.join(node_path(self.hb.rendezvous_dir, self.node),
                            f"job-{int(job_id)}", f"run-{int(restarts)}")

    def _publish(self, directory: str, piece: dict[str, Any]) -> None:
        fd = safefs.makedirs_root(directory)
        try:
            safefs.replace_file(fd, f"{self.node}.json", json.dumps(piece, default=str).encode())
        finally:
            os.close(fd)

    def _piece_bytes(self, piece: dict[str, Any]) -> bytes:
        """The piece for the network; stacks are left out when it would be too large."""
        data = json.dumps(piece, default=str).encode()
        if len(data) > self.hb.exchange.max_piece_bytes:
            slim = {**piece, "evidence": {"omitted": f"{len(data)} bytes: kept in this node's "
                                                    "incident report"}}
            data = json.dumps(slim, default=str).encode()
        return data

    def _gather(self, directory: str, nodes: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Other nodes' pieces, waiting up to rendezvous_wait_s for all of them."""
        deadline = time.monotonic() + self.hb.rendezvous_wait_s
        pieces: dict[str, dict[str, Any]] = {}
        while True:
            for node in nodes:
                if node in pieces or node == self.node:
                    continue
                try:
                    fd = safefs.open_dir(directory)
                    try:
                        data = safefs.read_owned_file(fd, f"{node}.json", os.geteuid(),
                                                      max_bytes=64 << 20)
                    finally:
                        os.close(fd)
                    pieces[node] = json.loads(data)
                except FileNotFoundError:
                    continue
                except (OSError, ValueError) as exc:
                    log.warning("couldn't read rendezvous piece", node=node, error=str(exc))
            if all(n in pieces for n in nodes if n != self.node):
                return pieces
            if time.monotonic() > deadline:
                return pieces
            time.sleep(0.2)

    def incident(self, view: JobView, trigger: str, run: int | None = None) -> dict[str, Any]:
        """Handle one hang; ``run`` is the job's Restarts value another node's observations
        were made in (None when this node's own ranks timed out)."""
        rec = view.record
        detected = time.time()
        log.warning("hang detected", job_id=rec.job_id, trigger=trigger,
                    ranks=[r.rank for r in view.verdict.hung], mode=view.verdict.mode)
        piece = self._local_piece(view, trigger)
        evidence_done = time.time()
        report: dict[str, Any] = {
            "job_id": rec.job_id, "user": rec.user, "uid": rec.uid, "node": self.node,
            "restart": max((v.restart_count for v in view.slots), default=0),
            "mode": view.verdict.mode, "trigger": trigger, "detected_at": detected,
            "ranks": list(piece["ranks"]), "evidence": {self.node: piece["evidence"]},
            "actions": [], "timings": {"evidence_s": round(evidence_done - detected, 3)},
        }
        try:
            job = self.adapter.show_job(rec.job_id)
        except SlurmError as exc:
            report["decision"] = {"action": "none", "reason": f"couldn't read job: {exc}"}
            self._finish(report, None)
            return report
        if run is not None and run != job.restarts:
            log.info("ignored hang observations of an earlier run", job_id=rec.job_id, run=run,
                     current=job.restarts)
            return report
        report["restart"] = job.restarts
        rdv = self._rendezvous(rec.job_id, job.restarts)
        if rdv is not None:
            try:
                self._publish(rdv, piece)
            except OSError as exc:
                log.warning("couldn't publish hang observations", path=rdv, error=str(exc))
        elif job.batch_host and job.batch_host != self.node:
            self.exchange.publish(rec.job_id, job.restarts, job.batch_host,
                                  job.nodes or rec.nodes, self._piece_bytes(piece))
        if job.batch_host != self.node:
            report["decision"] = {"action": "report",
                                  "reason": f"batch host {job.batch_host} decides and acts"}
            self._finish(report, None)
            return report
        pieces = {self.node: piece}
        if rdv is not None:
            pieces.update(self._gather(rdv, job.nodes or rec.nodes))
        else:
            got = self.exchange.gather(rec.job_id, job.restarts, job.nodes or rec.nodes,
                                       time.monotonic() + self.hb.rendezvous_wait_s)
            for node, data in got.items():
                try:
                    pieces[node] = json.loads(data)
                except ValueError as exc:
                    log.warning("couldn't read a piece", node=node, error=str(exc))
        missing = [n for n in (job.nodes or rec.nodes) if n not in pieces]
        for node, other in pieces.items():
            if node != self.node:
                report["ranks"] += other.get("ranks", [])
                report["evidence"][node] = other.get("evidence", {})
        report["ranks"].sort(key=lambda r: r["rank"])
        obs = []
        for node, p in pieces.items():
            for o in p.get("observations", []):
                try:
                    obs.append(B.RankObservation(**o))
                except TypeError as exc:
                    log.warning("couldn't use an observation", node=node, error=str(exc))
        blamed = B.blame(rec.job_id, obs, {n: p.get("findings", []) for n, p in pieces.items()})
        if trigger.startswith("reported") and blamed.drains and blamed.rule != "health":
            # A job reporting its own stall may requeue itself, but not drain a node on its word.
            blamed = dataclasses.replace(blamed, drains=(), explanation=(
                blamed.explanation + "; reported by the job itself: no drain without health "
                                     "findings"))
        explanation = blamed.explanation
        if missing:
            explanation += f" (no observations from {', '.join(missing)})"
        report["blame"] = {"drains": [list(d) for d in blamed.drains], "ranks": list(blamed.ranks),
                           "rule": blamed.rule, "explanation": explanation}
        ckpt = max(int(p.get("ckpt_step", -1)) for p in pieces.values())
        decision = R.decide(rec.job_id, restarts=job.restarts, admin_comment=job.admin_comment,
                            ckpt_step=ckpt, mode=view.verdict.mode, cfg=self.hb)
        report["decision"] = {"action": decision.action, "reason": decision.reason,
                              "ledger": decision.ledger.token(), "ckpt_step": ckpt}
        if decision.action in ("requeue", "hold") and self._claim(rec.job_id, job.restarts):
            self._act(report, blamed, decision, job.admin_comment)
        elif decision.action in ("requeue", "hold"):
            report["decision"]["action"] = "skip"
            report["decision"]["reason"] = "another handler already acted on this run"
        self._finish(report, job.std_out)
        return report

    def _claim(self, job_id: int, restarts: int) -> bool:
        """Atomically claim acting on this run of the job (O_EXCL marker, survives restarts)."""
        fd = safefs.makedirs_root(os.path.join(self.state_dir, "acted"))
        try:
            safefs.write_new(fd, f"{int(job_id)}-{int(restarts)}", str(time.time()).encode())
            return True
        except FileExistsError:
            return False
        finally:
            os.close(fd)

    def _act(self, report: dict[str, Any], blamed: B.Blame, decision: R.Decision,
             admin_comment: str) -> None:
        job_id = report["job_id"]
        actions: list[str] = report["actions"]
        if self.hb.drain:
            for node, reason in blamed.drains:
                try:
                    actions.append(f"drained {node}: {self.adapter.drain(node, reason)}")
                except ForeignDrain as exc:
                    actions.append(f"left {node} alone: {exc.slurm_message}")
                except SlurmError as exc:
                    actions.append(f"couldn't drain {node}: {exc}")
        elif blamed.drains:
            actions.append("draining is off (heartbeat.drain: false): no node drained")
        if not blamed.drains:
            actions.append("no node drained: " + report["blame"]["explanation"])
        comment = R.merge_comment(admin_comment, decision.ledger, decision.reason)
        try:
            if decision.action == "requeue":
                self.adapter.set_admin_comment(job_id, comment)
                self.adapter.requeue(job_id)
                actions.append(f"requeued job {job_id}")
            else:
                self.adapter.requeue_hold(job_id, comment)
                actions.append(f"requeued and held job {job_id}: {decision.reason}")
            report["timings"]["action_at"] = time.time()
        except SlurmError as exc:
            actions.append(f"couldn't {decision.action} job {job_id}: {exc}")

    def _finish(self, report: dict[str, Any], std_out: str | None) -> None:
        """Timings, then the report into the agent's directory, the job's and the log."""
        first = min((r["last_progress_at"] for r in report["ranks"] if r["state"] == "hung"),
                    default=None)
        if first is not None:
            report["timings"]["hang_started_at"] = first
            report["timings"]["detect_after_s"] = round(report["detected_at"] - first, 3)
            if "action_at" in report["timings"]:
                report["timings"]["action_after_s"] = round(
                    report["timings"]["action_at"] - first, 3)
        try:
            report["files"] = [incident.write_agent_copy(self.incident_dir, report)]
        except OSError as exc:
            log.error("couldn't write incident report", path=self.incident_dir, error=str(exc))
            report["files"] = []
        if std_out:
            rec_uid, rec_gid = report["uid"], self._gid(report["job_id"])
            try:
                report["files"].append(incident.write_job_copy(std_out, rec_uid, rec_gid, report))
            except OSError as exc:
                log.warning("couldn't write report to the job's output directory",
                            job_id=report["job_id"], std_out=std_out, error=str(exc))
        log.warning("hang incident", job_id=report["job_id"], mode=report["mode"],
                    decision=report.get("decision"), blame=report.get("blame", {}).get(
                        "explanation"), actions=report["actions"], files=report["files"],
                    timings=report["timings"])

    def _gid(self, job_id: int) -> int:
        with self.lock:
            view = self.jobs.get(job_id)
        return view.record.gid if view else -1

    # -- socket requests -------------------------------------------------------------------------

    def _owned(self, request: dict[str, Any], peer: Peer) -> JobView:
        job_id = _int(request.get("job_id"), "job_id")
        with self.lock:
            view = self.jobs.get(job_id)
        if view is None:
            raise RequestError(f"job {job_id} is not watched on {self.node}")
        if peer.uid not in (0, view.record.uid):
            raise RequestError(f"job {job_id} belongs to uid {view.record.uid}, not to uid "
                               f"{peer.uid}: refused")
        return view

    def handle_status(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """Jobs watched on this node: root sees all, a user only their own."""
        with self.lock:
            views = list(self.jobs.values())
        jobs = []
        for v in views:
            if peer.uid not in (0, v.record.uid):
                continue
            jobs.append({"job_id": v.record.job_id, "user": v.record.user,
                         "mode": v.verdict.mode, "stragglers": list(v.verdict.stragglers),
                         "tuned_timeout_s": v.verdict.tuned_timeout_s,
                         "ranks": [r.__dict__ for r in v.verdict.ranks], "errors": v.errors})
        return {"ok": True, "node": self.node, "mode": self.hb.mode, "jobs": jobs}

    def handle_report(self, request: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """A job's own process reports a stall it detected itself: handled like a timeout."""
        view = self._owned(request, peer)
        started = self.start_incident(view, trigger=f"reported by uid {peer.uid} pid {peer.pid}")
        return {"ok": True, "job_id": view.record.job_id, "started": started}

    def handlers(self) -> dict[str, Handler]:
        return {"hang.status": self.handle_status, "hang.report": self.handle_report}

    def close(self) -> None:
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(timeout=self.hb.evidence_timeout_s)
        self.exchange.close()


def factory(ctx: AgentContext) -> HangWatcher | None:
    """The agent's ``heartbeat`` service (mode off only idles, so a reload can turn it on)."""
    return HangWatcher(ctx.cfg, ctx.node, ctx.adapter)
