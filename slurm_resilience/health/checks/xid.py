"""Xid checks: a fatal Xid fails its GPU until the GPU is repaired; each event counts once.

The state keeps every event seen, keyed by boot id and kmsg sequence number (or
line hash), so re-reading the kernel log never counts an event twice and an event
survives the ring buffer wrapping. Non-fatal events leave after ``window_s``.

A fatal Xid lasts until the repair NVIDIA's action asks for (``fatal_until: repair``,
the default; :class:`xid_catalog.Ending`): a new boot ends everything; a GPU reset (NVML
seeing a lost GPU again, or an operator's record in the ledger,
:mod:`slurm_resilience.health.xid_repairs`) ends what needs a reset; a passing
diagnostic only what a diagnostic can clear. The newest Xid 154 of a GPU and NVML's
recovery action for it make its endings stricter, never weaker (a reboot the driver
asks for is never ended by a reset). ``fatal_until: window`` keeps the old rule, the
event expires after ``window_s``.

Xids NVIDIA sends to a diagnostic when they repeat on one GPU (13, 31) are reported
once they come in ``repeat_bursts`` bursts, with ``diagnose`` in the finding's data
(the epilog's ``diag.after_failure`` runs it); a passing diagnostic ends the request.

Lines without a usable time are dated when first seen. Their keys are remembered
in ``retired`` after they leave (window or repair), across boots too: the same old
line read again is the same event, never a new one.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slurm_resilience.config.health import XidCheckSection
from slurm_resilience.config.paths import node_path
from slurm_resilience.health import xid_catalog, xid_decode, xid_repairs
from slurm_resilience.health.checks.spec import CheckSpec, Collect, Judged, RunFacts
from slurm_resilience.health.collectors.kernlog_time import BootOf
from slurm_resilience.health.collectors.xid import KernelLogSnapshot
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown, warn
from slurm_resilience.health.xid_catalog import Ending
from slurm_resilience.health.xid_repairs import DIAG, RESET, Repair, kind_of, pci_key

if TYPE_CHECKING:
    from slurm_resilience.config import Config
    from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot

NAME = "xid"
MAX_EVENTS = 2000
MAX_RETIRED = 4000

__all__ = ["MAX_EVENTS", "MAX_RETIRED", "NAME", "KnownEvent", "XidState", "check", "pci_key",
           "record_repair", "recovery_by_pci"]
# Which repair kinds meet which ending (a new boot clears the state: it meets all).
_MEETS = {RESET: Ending.RESET, DIAG: Ending.DIAG}


@dataclass
class KnownEvent:
    """An event as the state keeps it; ``time`` is when it was first seen if undated."""

    xid: int
    pci: str
    text: str
    time: float
    dated: bool = True


@dataclass
class XidState:
    """What the check keeps between runs (saved as JSON)."""

    boot_id: str = ""
    events: dict[str, KnownEvent] = field(default_factory=dict)
    retired: dict[str, float] = field(default_factory=dict)  # key -> when it left
    # "<kind>:<pci>" -> the latest repair of that kind
    repaired: dict[str, Repair] = field(default_factory=dict)
    lost: dict[str, float] = field(default_factory=dict)  # pci -> first seen lost by NVML

    def to_json(self) -> dict[str, Any]:
        return {
            "boot_id": self.boot_id,
            "events": {k: vars(v) for k, v in self.events.items()},
            "retired": dict(self.retired),
            "repaired": {k: vars(v) for k, v in self.repaired.items()},
            "lost": dict(self.lost),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> XidState:
        """The saved state. A garbled entry raises ValueError: the gate then sets the file
        aside with a log event and judges this run without history (never silently)."""
        state = cls(boot_id=str(data.get("boot_id", "")))
        try:
            for key, ev in _mapping(data, "events").items():
                state.events[str(key)] = KnownEvent(
                    int(ev["xid"]), str(ev["pci"]), str(ev.get("text", "")),
                    float(ev["time"]), bool(ev.get("dated", True)))
            for rep in _mapping(data, "repaired").values():
                evidence = str(rep["evidence"])
                record_repair(state, Repair(str(rep["pci"]), float(rep["time"]), evidence,
                                            kind_of(rep.get("kind"), evidence)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"garbled Xid state entry: {exc!r}") from None
        for part, into in (("retired", state.retired), ("lost", state.lost)):
            for key, when in _mapping(data, part).items():
                if not isinstance(when, int | float) or isinstance(when, bool):
                    raise ValueError(f"{part}[{key!r}] is not a time: {when!r}")
                into[str(key)] = float(when)
        return state


def _mapping(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} is a {type(value).__name__}, not an object")
    return value


def record_repair(state: XidState, repair: Repair) -> None:
    """Note that a GPU was repaired; its fatal Xids logged up to then that this kind of
    repair meets end."""
    pci = pci_key(repair.pci)
    kind = kind_of(repair.kind, repair.evidence)
    prev = state.repaired.get(f"{kind}:{pci}")
    if prev is None or repair.time >= prev.time:
        state.repaired[f"{kind}:{pci}"] = Repair(pci, repair.time, repair.evidence, kind)


def recovery_by_pci(gpus: Sequence[Any]) -> dict[str, int]:
    """NVML's recovery action per GPU (PCI address → value), for GPUs that report one."""
    return {pci_key(g.pci_bus_id): int(g.recovery_action) for g in gpus
            if g.pci_bus_id and g.recovery_action is not None}


def _strictness(state: XidState, recovery: Mapping[str, int]) -> dict[str, tuple[Ending, str]]:
    """Per GPU, the ending the driver now asks for: its newest Xid 154, and NVML's
    recovery action, whichever is stricter, with what said so."""
    out: dict[str, tuple[Ending, str]] = {}
    newest: dict[str, KnownEvent] = {}
    for kev in state.events.values():
        if kev.xid == 154 and (kev.pci not in newest or kev.time >= newest[kev.pci].time):
            newest[kev.pci] = kev
    for pci, kev in newest.items():
        decoded = xid_decode.decode_154(kev.text)
        ending = xid_catalog.judge(154, kev.text, frozenset({154})).ending
        out[pci] = (ending, f"Xid 154: {decoded.basis}")
    for raw, value in recovery.items():
        pci = pci_key(raw)
        name, act = xid_decode.recovery_action(value)
        ending = {xid_decode.RESTART_BM: Ending.BOOT, xid_decode.RESET_GPU: Ending.RESET}.get(
            act, Ending.NONE)
        if ending > out.get(pci, (Ending.NONE, ""))[0]:
            out[pci] = (ending, f"NVML recovery action {name}")
    return out


@dataclass(frozen=True)
class _Fate:
    """One event judged now: what it needs, and the repair that ended it, if any."""

    ending: Ending
    action: str
    basis: str
    repair: Repair | None


def _fate(kev: KnownEvent, state: XidState, fatal: frozenset[int],
          strict: Mapping[str, tuple[Ending, str]]) -> _Fate:
    j = xid_catalog.judge(kev.xid, kev.text, fatal)
    ending, basis = j.ending, j.basis
    if ending:
        stricter, why = strict.get(kev.pci, (Ending.NONE, ""))
        if stricter > ending:
            ending, basis = stricter, why
    for kind, meets in _MEETS.items():
        rep = state.repaired.get(f"{kind}:{kev.pci}")
        if ending and meets >= ending and rep is not None and kev.time <= rep.time:
            return _Fate(ending, j.action, basis, rep)
    return _Fate(ending, j.action, basis, None)


def _clock(t: float, now: float) -> str:
    fmt = "%H:%M:%S" if now - t < 86400 else "%m-%d %H:%M:%S"
    return time.strftime(fmt, time.localtime(t))


def _retire(state: XidState, key: str, ev: KnownEvent, now: float) -> None:
    if not ev.dated:  # a dated event ages out again by its own time when read again
        state.retired[key] = now


def _note_gpus_seen(state: XidState, gpus_ok: Mapping[str, bool] | None, now: float) -> None:
    """A GPU NVML saw lost or missing that now answers again was reset."""
    if gpus_ok is None:
        return
    for raw, healthy in gpus_ok.items():
        pci = pci_key(raw)
        if not healthy:
            state.lost.setdefault(pci, now)
        elif pci in state.lost:
            del state.lost[pci]
            record_repair(state, Repair(pci, now, "GPU back on the bus (reset)", RESET))


def check(snap: KernelLogSnapshot, cfg: XidCheckSection, prev: XidState, *,
          now: float, gpu_by_pci: Mapping[str, int] | None = None,
          job_start: float | None = None, repairs: Sequence[Repair] = (),
          gpus_ok: Mapping[str, bool] | None = None,
          recovery: Mapping[str, int] | None = None) -> CheckResult[XidState]:
    """Judge the Xids of ``snap``.

    ``job_start`` (epilog): non-fatal Xids raised since then are reported as warnings.
    ``repairs``: repair evidence from the ledger. ``gpus_ok``: NVML's view now, PCI
    address → present and not lost (a known GPU missing from NVML maps to False).
    ``recovery``: NVML's recovery action per PCI address (:func:`recovery_by_pci`).
    """
    if snap.error:
        return CheckResult([unknown(NAME, "kernel-log", f"xid: {snap.error}")], prev)
    state = copy.deepcopy(prev)  # the caller's record stays as it was read
    if state.boot_id != snap.boot_id:
        # A reboot resets every GPU. Undated lines seen before it were logged before it:
        # their keys are kept, so reading them again after the reboot raises nothing.
        retired = dict(state.retired)
        retired.update({k: now for k, ev in state.events.items() if not ev.dated})
        state = XidState(boot_id=snap.boot_id, retired=retired)
    for rep in repairs:
        record_repair(state, rep)
    _note_gpus_seen(state, gpus_ok, now)

    fatal = xid_catalog.fatal_set(cfg.fatal, cfg.extra_fatal, cfg.not_fatal)
    known = set(state.events)
    for ev in snap.events:
        if ev.boot is BootOf.EARLIER or ev.key in state.events or ev.key in state.retired:
            continue
        state.events[ev.key] = KnownEvent(ev.xid, ev.pci, ev.text[:200],
                                          ev.time if ev.time is not None else now,
                                          ev.time is not None)
    strict = _strictness(state, recovery or {})
    horizon = now - cfg.window_s
    repaired_events: list[tuple[KnownEvent, Repair]] = []
    fates: dict[str, _Fate] = {}
    for key, kev in list(state.events.items()):
        fate = _fate(kev, state, fatal, strict)
        if fate.repair is not None:
            if key in known:  # new and already repaired: read again after its repair
                repaired_events.append((kev, fate.repair))
            del state.events[key]
            _retire(state, key, kev, now)
        elif kev.time < horizon and not (fate.ending and cfg.fatal_until == "repair"):
            del state.events[key]
            _retire(state, key, kev, now)
        else:
            fates[key] = fate
    if len(state.events) > MAX_EVENTS:
        # An Xid storm: keep the fatal events, then the newest; the state stays small.
        kept = sorted(state.events.items(), key=lambda kv: (
            bool(fates[kv[0]].ending), kv[1].time))
        for key, kev in kept[:-MAX_EVENTS]:
            _retire(state, key, kev, now)
        state.events = dict(kept[-MAX_EVENTS:])
    if len(state.retired) > MAX_RETIRED:
        state.retired = dict(sorted(state.retired.items(), key=lambda kv: kv[1])[-MAX_RETIRED:])

    findings = _findings(state, fates, snap, now, gpu_by_pci or {}, job_start, cfg)
    findings.extend(_repair_findings(repaired_events, gpu_by_pci or {}, now))
    if not findings:
        findings.append(ok(NAME, "kernel-log", f"no Xid in the last {cfg.window_s}s"))
    return CheckResult(findings, state)


def _subject(pci: str, by_gpu: Mapping[str, int]) -> tuple[str, int | None]:
    gpu = by_gpu.get(pci)
    return (f"gpu{gpu}" if gpu is not None else f"PCI:{pci}"), gpu


def _bursts(times: list[float], gap_s: float) -> int:
    """Separate occurrences: events closer than ``gap_s`` to the previous one are one."""
    count, last = 0, None
    for t in sorted(times):
        if last is None or t - last >= gap_s:
            count += 1
        last = t
    return count


def _findings(state: XidState, fates: Mapping[str, _Fate], snap: KernelLogSnapshot,
              now: float, gpu_by_pci: Mapping[str, int], job_start: float | None,
              cfg: XidCheckSection) -> list[Finding]:
    by_gpu = {pci_key(k): v for k, v in gpu_by_pci.items()}
    groups: dict[tuple[str, int, Ending], list[tuple[KnownEvent, _Fate]]] = {}
    for key, kev in state.events.items():
        fate = fates[key]
        groups.setdefault((kev.pci, kev.xid, fate.ending), []).append((kev, fate))
    findings: list[Finding] = []
    for (pci, xid, ending), items in sorted(groups.items(), key=lambda kv: -max(
            e.time for e, _ in kv[1])):
        evs = [e for e, _ in items]
        last = max(e.time for e in evs)
        subject, gpu = _subject(pci, by_gpu)
        times = f" x{len(evs)}" if len(evs) > 1 else ""
        message = f"{subject} XID {xid} ({xid_catalog.meaning(xid)}){times} {_clock(last, now)}"
        newest_ev, newest = max(items, key=lambda item: item[0].time)
        data: dict[str, Any] = {
            "xid": xid, "pci": pci, "gpu": gpu, "count": len(evs), "time": last,
            "text": newest_ev.text, "dated": newest_ev.dated, "action": newest.action}
        if newest.basis:
            data["basis"] = newest.basis
        entry = xid_catalog.ENTRIES.get(xid)
        if ending:
            if cfg.fatal_until == "repair":
                data["clears_on"] = {Ending.BOOT: "a new boot",
                                     Ending.RESET: "a GPU reset or a new boot",
                                     Ending.DIAG: "a passing diagnostic, a reset or a new boot",
                                     }[ending]
            findings.append(fail(NAME, subject, f"{message}, {ending.need}", **data))
            continue
        repeat = _repeat(entry, evs, state, pci, cfg)
        if repeat:
            data.update(diagnose=entry.diag_on_repeat if entry else "", bursts=repeat)
            findings.append(warn(NAME, subject, f"{message}, repeated in {repeat} bursts: "
                                                f"run {data['diagnose']}", **data))
        elif job_start is not None and last >= job_start:
            findings.append(warn(NAME, subject, message + " during the job", **data))
        else:
            findings.append(ok(NAME, subject, message + " (not fatal)", **data))
    if snap.unparsed:
        sample = " | ".join(snap.unparsed_sample)
        findings.append(warn(
            NAME, "kernel-log", f"{snap.unparsed} kernel-log line(s) name an Xid in no known "
                                f"format: {sample}"[:300],
            unparsed=snap.unparsed, sample=list(snap.unparsed_sample)))
    return findings


def _repeat(entry: xid_catalog.Entry | None, evs: list[KnownEvent], state: XidState, pci: str,
            cfg: XidCheckSection) -> int:
    """How many bursts of an Xid NVIDIA sends to a diagnostic when it repeats on one GPU
    came since that GPU's last diagnostic or reset; 0 below ``repeat_bursts``."""
    if entry is None or not entry.diag_on_repeat or not cfg.repeat_bursts:
        return 0
    since = max((r.time for k, r in state.repaired.items() if k.endswith(f":{pci}")),
                default=float("-inf"))
    bursts = _bursts([e.time for e in evs if e.time > since], cfg.repeat_gap_s)
    return bursts if bursts >= cfg.repeat_bursts else 0


def _repair_findings(repaired: list[tuple[KnownEvent, Repair]], gpu_by_pci: Mapping[str, int],
                     now: float) -> list[Finding]:
    by_gpu = {pci_key(k): v for k, v in gpu_by_pci.items()}
    seen: set[tuple[str, int]] = set()
    out: list[Finding] = []
    for kev, rep in repaired:
        if (kev.pci, kev.xid) in seen:
            continue
        seen.add((kev.pci, kev.xid))
        subject, gpu = _subject(kev.pci, by_gpu)
        out.append(ok(NAME, subject, f"{subject} XID {kev.xid} ended: {rep.evidence} "
                                     f"{_clock(rep.time, now)}",
                      xid=kev.xid, pci=kev.pci, gpu=gpu, repaired=rep.evidence))
    return out


def _collect(cfg: Config, node: str, active: bool) -> Collect:
    import functools

    from slurm_resilience.health.collectors import xid

    h = cfg.health
    read = functools.partial(
        xid.collect, h.xid.source, node_path(h.xid.path, node),
        node_path(h.xid.boot_id_file, node), h.xid.max_read_bytes,
        max(h.xid.window_s, h.kernel_log.window_s), h.collector_timeout_s)
    return lambda: read().to_json()


def _gpus_ok(snap: NvmlSnapshot | None, known: Mapping[str, int]) -> dict[str, bool] | None:
    """PCI address → NVML answers for that GPU and it is not lost; a GPU we knew that NVML
    no longer lists is False. None when NVML gave no list (nothing to compare)."""
    if snap is None or snap.error or snap.no_driver:
        return None
    view = {pci_key(g.pci_bus_id): not g.lost for g in snap.gpus if g.pci_bus_id}
    for bus_id in known:
        view.setdefault(pci_key(bus_id), False)
    return view


def _judge(snap: KernelLogSnapshot, state: XidState, facts: RunFacts) -> Judged[XidState]:
    extra: list[Finding] = []
    try:
        repairs, garbled = xid_repairs.load(facts.state_dir)
    except OSError as exc:
        # Without the ledger a repaired GPU stays failed: safe, and said.
        repairs, garbled = [], 0
        extra.append(warn(NAME, "repairs", f"couldn't read {xid_repairs.LEDGER}: {exc}"))
    if garbled:
        extra.append(warn(NAME, "repairs", f"{garbled} garbled line(s) in "
                                           f"{xid_repairs.LEDGER} skipped"))
    result = check(snap, facts.cfg.health.xid, state, now=facts.now,
                   gpu_by_pci=facts.gpu_by_pci,
                   job_start=facts.job_start if facts.kind == "epilog" else None,
                   repairs=repairs, gpus_ok=_gpus_ok(facts.gpu_snap, facts.gpu_by_pci),
                   recovery=recovery_by_pci(facts.gpu_snap.gpus if facts.gpu_snap else []))
    return result, extra


# A hung kernel-log read only means we couldn't look (not a stuck GPU).
SPEC = CheckSpec(NAME, lambda h: h.xid, KernelLogSnapshot.from_json, _judge, XidState, rank=0,
                 collect=_collect, hang_is_sick=False)
