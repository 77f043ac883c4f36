"""``slurm-resilience status --cluster``: one view of the cluster from every node agent's
/metrics and from Slurm, not from a shared filesystem.

Gather: Slurm's node list (drains, suspects) and job list (jobs we hold), the agents'
addresses from Slurm (NodeAddr) through the adapter, and one bounded, parallel scrape of
each agent's endpoint. Decide (pure, :func:`assemble`): drained and suspect nodes with
their reasons, open incidents, held jobs, checkpoint backlog per node, the worst goodput
among running jobs, and the stragglers the agents name: nodes named by their jobs' judging
agents (each named node reports ``job_straggler_node_slowdown_ratio``; the judgement, with
its persistence, is the agents', :mod:`slurm_resilience.stragglers.nodes`), straggler ranks
and recurring straggler nodes. An agent that can't be scraped is listed as an error, never
left out.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from slurm_resilience.config import Config
from slurm_resilience.config.metrics import StragglerSection
from slurm_resilience.hang import policy
from slurm_resilience.hang import requeue as R
from slurm_resilience.metrics import observe
from slurm_resilience.slurm.parse import JobInfo, NodeInfo
from slurm_resilience.stragglers.record import MIN_USERS

P = "slurm_resilience_"
MAX_SCRAPE_BYTES = 16 << 20
SCRAPE_WORKERS = 32

Samples = list[tuple[str, dict[str, str], float]]


@dataclass
class Scrape:
    node: str
    url: str
    samples: Samples = field(default_factory=list)
    error: str = ""


def fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - http from config
        return str(resp.read(MAX_SCRAPE_BYTES).decode())


def parse(text: str) -> Samples:
    """Only our own families: a node_exporter-style endpoint with more is fine."""
    return [(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text) if fam.name.startswith(P)
            for s in fam.samples]


def scrape_all(urls: Mapping[str, str], timeout: float,
               get: Callable[[str, float], str] = fetch) -> list[Scrape]:
    def one(item: tuple[str, str]) -> Scrape:
        node, url = item
        try:
            return Scrape(node, url, parse(get(url, timeout)))
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the node is listed
            return Scrape(node, url, error=f"{type(exc).__name__}: {exc}")

    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(SCRAPE_WORKERS, len(urls))) as pool:
        return list(pool.map(one, sorted(urls.items())))


def metrics_urls(cfg: Config, addresses: Mapping[str, str]) -> dict[str, str]:
    m = cfg.metrics
    out = {}
    for node, addr in addresses.items():
        port = m.port_of(node)
        if port:
            host = f"[{addr}]" if ":" in addr else addr
            out[node] = f"http://{host}:{port}/metrics"
    return out


def _values(scrape: Scrape, name: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, v) for n, labels, v in scrape.samples if n == P + name]


@dataclass(frozen=True)
class NodeRow:
    node: str
    state: str
    reason: str
    since: str


@dataclass(frozen=True)
class OpenIncident:
    job_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class HeldJob:
    job_id: int
    user: str
    reason: str
    admin_comment: str


@dataclass(frozen=True)
class ConstrainedJob:
    """A pending job the suite requeued with nodes excluded; ``stranded`` when Slurm says
    it can never start so (BadConstraints)."""

    job_id: int
    user: str
    excluded: tuple[str, ...]
    reason: str
    stranded: bool


@dataclass(frozen=True)
class Backlog:
    node: str
    bytes: int
    steps: dict[str, int]  # job id -> steps waiting


@dataclass(frozen=True)
class Goodput:
    job_id: int
    ratio: float


@dataclass(frozen=True)
class SlowNode:
    job_id: int
    node: str
    step_time_p50_s: float
    job_median_s: float
    slowdown: float


@dataclass(frozen=True)
class StragglerRanks:
    node: str
    job_id: int
    ranks: int


@dataclass(frozen=True)
class Recurring:
    """A node slow in jobs of several users (one user's slow jobs never name a node)."""

    node: str
    jobs: int
    users: int = 0


@dataclass(frozen=True)
class Suspected:
    """A node suspected by jobs of several users (verified each time, never drained for it)."""

    node: str
    users: int


@dataclass
class ClusterView:
    drained: list[NodeRow] = field(default_factory=list)
    suspects: list[NodeRow] = field(default_factory=list)
    incidents: list[OpenIncident] = field(default_factory=list)
    held_jobs: list[HeldJob] = field(default_factory=list)
    constrained_jobs: list[ConstrainedJob] = field(default_factory=list)
    checkpoint_backlog: list[Backlog] = field(default_factory=list)
    worst_goodput: Goodput | None = None
    straggler_nodes: list[SlowNode] = field(default_factory=list)
    straggler_ranks: list[StragglerRanks] = field(default_factory=list)
    recurring_stragglers: list[Recurring] = field(default_factory=list)
    suspected_by_several: list[Suspected] = field(default_factory=list)
    # Observe mode: what the agents' nodes decided and did not do; nodes whose config fails.
    observed: list[str] = field(default_factory=list)
    config_invalid: list[str] = field(default_factory=list)
    agents_scraped: int = 0
    agents_total: int = 0
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def assemble(nodes: Sequence[NodeInfo], jobs: Sequence[JobInfo], scrapes: Sequence[Scrape],
             prefix: str, stragglers: StragglerSection) -> ClusterView:
    """The cluster view (pure)."""
    view = ClusterView(agents_scraped=sum(1 for s in scrapes if not s.error),
                       agents_total=len(scrapes))
    for n in nodes:
        if not ((n.drained or n.down) and n.reason.startswith(prefix)):
            continue
        hang = policy.parse_reason(n.reason.removeprefix(prefix).strip())
        row = NodeRow(n.name, "+".join([n.state, *sorted(n.flags)]), n.reason, n.reason_time)
        (view.suspects if hang is not None and hang.suspect else view.drained).append(row)
    for j in jobs:
        if R.parse_ledger(j.admin_comment) is not None and j.state == "PENDING" \
                and "held" in j.reason.lower():
            view.held_jobs.append(HeldJob(j.job_id, j.user, j.reason, j.admin_comment))
        if R.parse_ledger(j.admin_comment) is not None and j.state == "PENDING" \
                and j.exc_nodes:
            view.constrained_jobs.append(ConstrainedJob(
                j.job_id, j.user, j.exc_nodes, j.reason, j.reason == "BadConstraints"))
    running = {j.job_id for j in jobs if j.state == "RUNNING"}
    incidents: dict[int, list[str]] = defaultdict(list)
    goodput: dict[int, float] = {}
    for s in scrapes:
        if s.error:
            view.errors.append(f"{s.node}: couldn't read {s.url}: {s.error}")
            continue
        view.observed += [f"{s.node}: {line}" for line in observe.cluster_lines(s.samples)]
        if any(v == 0 for _, v in _values(s, "config_valid")):
            view.config_invalid.append(s.node)
        for labels, v in _values(s, "job_hang_incident_open"):
            if v:
                incidents[int(labels["job_id"])].append(s.node)
        steps = {int(lb["job_id"]): v for lb, v in _values(s, "checkpoint_upload_backlog_steps")}
        size = sum(v for _, v in _values(s, "checkpoint_upload_backlog_node_bytes"))
        if size or any(steps.values()):
            view.checkpoint_backlog.append(Backlog(s.node, int(size), {
                str(k): int(v) for k, v in sorted(steps.items()) if v}))
        for labels, v in _values(s, "job_goodput_ratio"):
            job = int(labels["job_id"])
            if job in running:
                goodput[job] = min(goodput.get(job, 1.0), v)
        for labels, v in _values(s, "job_straggler_ranks"):
            if v:
                view.straggler_ranks.append(StragglerRanks(s.node, int(labels["job_id"]),
                                                           int(v)))
        for _, v in _values(s, "node_suspicion_users"):
            if v >= 2:
                view.suspected_by_several.append(Suspected(s.node, int(v)))
        users = max((v for _, v in _values(s, "node_straggler_recent_users")), default=0)
        for _, v in _values(s, "node_straggler_recent_jobs"):
            if v and users >= MIN_USERS:
                view.recurring_stragglers.append(Recurring(s.node, int(v), int(users)))
        p50 = {int(lb["job_id"]): v for lb, v in _values(s, "job_step_time_p50_seconds")}
        for labels, v in _values(s, "job_straggler_node_slowdown_ratio"):
            job = int(labels["job_id"])
            mine = p50.get(job, 0.0)
            view.straggler_nodes.append(SlowNode(job, s.node, round(mine, 4),
                                                 round(mine / (1 + v), 4), round(v, 3)))
    view.incidents = [OpenIncident(k, tuple(sorted(v))) for k, v in sorted(incidents.items())]
    view.straggler_nodes.sort(key=lambda n: (n.job_id, n.node))
    if goodput:
        job, ratio = min(goodput.items(), key=lambda kv: kv[1])
        view.worst_goodput = Goodput(job, round(ratio, 4))
    return view


def render(view: ClusterView) -> str:
    lines = [f"cluster: {view.agents_scraped} of {view.agents_total} agents answered"]

    def section(title: str, rows: list[str]) -> None:
        lines.append(f"{title} ({len(rows)}):")
        lines.extend(f"  {r}" for r in rows)

    section("drained by slurm-resilience", [f"{d.node:<14} {d.state:<16} {d.reason}"
                                            for d in view.drained])
    section("suspects being verified", [f"{d.node:<14} {d.reason}" for d in view.suspects])
    section("suspected by several users' jobs (each verified: drained only on a failed "
            "check)", [f"{x.node:<14} jobs of {x.users} users within heartbeat.suspect_window_s"
                       f" (`slurm-resilience status --node {x.node}` there)"
                       for x in view.suspected_by_several])
    section("open hang incidents", [f"job {i.job_id} on {','.join(i.nodes)}"
                                    for i in view.incidents])
    section("jobs held by the suite", [f"job {j.job_id} ({j.user}): {j.admin_comment}"
                                       for j in view.held_jobs])
    section("jobs pending with nodes the suite excluded", [
        f"job {c.job_id} ({c.user}): excludes {','.join(c.excluded)}, pending ({c.reason})"
        + (f": it can never start so; clear with scontrol update JobId={c.job_id} "
           f"ExcNodeList=" if c.stranded else "") for c in view.constrained_jobs])
    section("checkpoint upload backlog", [f"{b.node:<14} {b.bytes:>14,d} bytes  steps by job "
                                          f"{b.steps}" for b in view.checkpoint_backlog])
    w = view.worst_goodput
    lines.append("worst goodput among running jobs: " + (
        f"job {w.job_id} {w.ratio:.1%} (slurm-resilience goodput {w.job_id})" if w
        else "no running job reports one"))
    # Per job: what one job's step times say (its owner's code can make them slow); only
    # the recurring section, from jobs of several users, names a node.
    section("jobs slower on one node than on their others (the job's own step times)", [
        f"{s.node:<14} job {s.job_id}: step {s.step_time_p50_s}s vs {s.job_median_s}s "
        f"({s.slowdown:+.0%})" for s in view.straggler_nodes])
    section("jobs with straggler ranks (the job's own step times)", [
        f"{s.node:<14} job {s.job_id}: {s.ranks} rank(s)" for s in view.straggler_ranks])
    section("recurring stragglers (slow in jobs of several users)", [
        f"{s.node:<14} named in {s.jobs} recent job(s) of {s.users} users"
        for s in view.recurring_stragglers])
    if view.observed:
        section("observe mode: decided, not carried out", view.observed)
    if view.config_invalid:
        section("configuration fails to load (gating with the last good copy; `slurm-"
                "resilience status` on the node says why)", view.config_invalid)
    for err in view.errors:
        lines.append(f"could not check: {err}")
    return "\n".join(lines) + "\n"


def collect(cfg: Config, timeout: float = 5.0) -> ClusterView:
    """Gather from Slurm and the agents, then assemble."""
    from slurm_resilience.slurm.adapter import from_config
    from slurm_resilience.slurm.errors import SlurmError

    adapter = from_config(cfg)
    errors = []
    nodes: list[NodeInfo] = []
    jobs: list[JobInfo] = []
    addresses: dict[str, str] = {}
    try:
        nodes = adapter.list_nodes()
        addresses = adapter.node_addresses([n.name for n in nodes])
    except SlurmError as exc:
        errors.append(f"nodes: {exc}")
    try:
        jobs = adapter.list_jobs()
    except SlurmError as exc:
        errors.append(f"jobs: {exc}")
    scrapes = scrape_all(metrics_urls(cfg, addresses), timeout)
    view = assemble(nodes, jobs, scrapes, cfg.slurm.reason_prefix, cfg.stragglers)
    view.errors = errors + view.errors
    return view
