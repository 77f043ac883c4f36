"""The doctor's checks: pure functions of :class:`~.facts.Facts`, each returning the
problems it found, each stating what is wrong and how to fix it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from slurm_resilience.doctor.facts import PLUGIN, Facts

# scontrol prints PrologEpilogTimeout=65534 (Slurm's INFINITE16 - 1) for "wait forever".
UNLIMITED_S = 65534
HOOK_FOR_KEY = {"Prolog": "prolog", "Epilog": "epilog", "HealthCheckProgram": "healthcheck"}


@dataclass(frozen=True)
class Problem:
    check: str
    what: str
    fix: str


Check = Callable[[Facts], list[Problem]]


def _seconds(text: str) -> int | None:
    m = re.match(r"\s*(\d+)", text)
    return int(m.group(1)) if m else None


def _items(text: str) -> set[str]:
    return {w.strip().lower() for w in text.split(",") if w.strip()}


def slurm_conf(f: Facts) -> list[Problem]:
    if f.slurm is not None:
        return []
    return [Problem("slurm_conf", f"couldn't read Slurm's configuration: {f.slurm_error}",
                    "start slurmctld (or fix SLURM_CONF), then `scontrol show config` must "
                    "answer; the slurm.conf checks need it")]


def health_check_interval(f: Facts) -> list[Problem]:
    if f.slurm is None:
        return []
    value = f.slurm.get("HealthCheckInterval", "")
    if (_seconds(value) or 0) > 0:
        return []
    return [Problem("health_check_interval",
                    f"HealthCheckInterval is {value or 'unset'} (0 disables the health check: "
                    "faults between jobs go unseen and drained nodes never return)",
                    "set HealthCheckInterval=300 in slurm.conf, then `scontrol reconfigure`")]


def hook_programs(f: Facts) -> list[Problem]:
    """Prolog, Epilog and HealthCheckProgram each name our wrapper (beside site ones)."""
    if f.slurm is None:
        return []
    out = []
    for key, hook in HOOK_FOR_KEY.items():
        progs = f.programs.get(key, ())
        ours = [p for p in progs if p.ours]
        listed = ", ".join(p.path for p in progs) or "nothing"
        missing = [p.path for p in progs if not p.exists]
        if not ours and not missing:  # a missing one may be ours: said below
            out.append(Problem(key.lower(), f"{key} names {listed}, not slurm-resilience's "
                               f"{hook} hook",
                               f"add {f.prefix}/hooks/{hook} to {key}= in slurm.conf (beside "
                               "any site program; see the README), then `scontrol "
                               "reconfigure`"))
        if missing:
            out.append(Problem(key.lower(), f"{key} names {', '.join(missing)}, which does "
                               "not exist on this node (slurmd fails the job, or the check)",
                               "install it on this node (`slurm-resilience install node`) or "
                               f"remove it from {key}="))
    return out


def prolog_epilog_timeout(f: Facts) -> list[Problem]:
    """Slurm must let our watchdog act first: past PrologEpilogTimeout slurmd kills the hook
    and drains the node with its own reason, which nothing resumes."""
    if f.slurm is None:
        return []
    value = f.slurm.get("PrologEpilogTimeout", "")
    limit = _seconds(value)
    if limit is None or limit >= UNLIMITED_S:
        return []
    h = f.hooks
    need = max(h.prolog_timeout_s, h.epilog_timeout_s) + h.watchdog_grace_s
    if limit > need:
        return []
    return [Problem("prolog_epilog_timeout",
                    f"PrologEpilogTimeout is {limit}s, not above the hooks' limit plus grace "
                    f"({need:g}s: hooks.prolog_timeout_s {h.prolog_timeout_s:g}, "
                    f"epilog_timeout_s {h.epilog_timeout_s:g}, watchdog_grace_s "
                    f"{h.watchdog_grace_s:g}); slurmd would kill a slow hook and drain the "
                    "node with its own reason",
                    f"set PrologEpilogTimeout={int(need) + 10} or more in slurm.conf, or lower "
                    "the hooks' limits in the configuration")]


def prolog_flags(f: Facts) -> list[Problem]:
    if f.slurm is None or "alloc" in _items(f.slurm.get("PrologFlags", "")):
        return []
    return [Problem("prolog_flags",
                    f"PrologFlags is {f.slurm.get('PrologFlags') or 'empty'}, without Alloc: "
                    "the prolog runs at a job's first step, after the job started",
                    "add Alloc to PrologFlags= in slurm.conf (keep the site's other flags, "
                    "e.g. Contain), then restart slurmctld and slurmd")]


def nohold_on_prolog_fail(f: Facts) -> list[Problem]:
    if f.slurm is None or "nohold_on_prolog_fail" in _items(
            f.slurm.get("SchedulerParameters", "")):
        return []
    return [Problem("nohold_on_prolog_fail",
                    "SchedulerParameters lacks nohold_on_prolog_fail: a job whose prolog "
                    "drained a sick node is held instead of requeued onto healthy ones",
                    "add nohold_on_prolog_fail to SchedulerParameters= in slurm.conf (keep "
                    "the site's other options), then `scontrol reconfigure`")]


def plugstack(f: Facts) -> list[Problem]:
    if f.plugstack_plugins is None:
        return [Problem("plugstack", f"couldn't read plugstack.conf: {f.plugstack_error}",
                        "`slurm-resilience install spank` builds the plugin and lists it")]
    if any(p.rsplit("/", 1)[-1] == PLUGIN for p in f.plugstack_plugins):
        return []
    return [Problem("plugstack", f"{f.plugstack} does not list {PLUGIN}: sbatch/srun have "
                    "no --ckpt-uri/--hang options and jobs can't opt in",
                    "`slurm-resilience install spank` (adds `optional .../"
                    f"{PLUGIN}` to {f.plugstack})")]


def munge(f: Facts) -> list[Problem]:
    if f.munge.ok:
        return []
    return [Problem("munge", f"munge can't make and decode a credential: {f.munge.detail}",
                    "start munged (`systemctl start munge`) with the cluster's "
                    "/etc/munge/munge.key")]


def agent(f: Facts) -> list[Problem]:
    if f.agent.ok:
        return []
    return [Problem("agent", f"the node agent does not answer: {f.agent.detail}",
                    "`systemctl enable --now slurm-resilience-agent`; its log says why it "
                    "stopped (`journalctl -u slurm-resilience-agent`)")]


def hook_server(f: Facts) -> list[Problem]:
    if f.hook_server.ok:
        return []
    return [Problem("hook_server", f"no hook server answers: {f.hook_server.detail} (hooks "
                    "still run, each in its own process, several times slower)",
                    "`systemctl enable --now slurm-resilience-hooks`")]


def config(f: Facts) -> list[Problem]:
    if f.config.ok:
        return []
    return [Problem("config", f.config.detail,
                    "fix the file (`slurm-resilience config check` shows the error)")]


def s3(f: Facts) -> list[Problem]:
    if f.s3 is None or f.s3.ok:
        return []
    return [Problem("s3", f"S3 not reachable: {f.s3.detail}",
                    "check checkpoint.s3_endpoint, the credentials file and the network "
                    "from this node; checkpoints stay local until it answers")]


# One line per check, in the order they are reported.
CHECKS: tuple[Check, ...] = (
    config, slurm_conf, health_check_interval, hook_programs, prolog_epilog_timeout,
    prolog_flags, nohold_on_prolog_fail, plugstack, munge, agent, hook_server, s3,
)


def run(f: Facts) -> list[Problem]:
    return [p for check in CHECKS for p in check(f)]
