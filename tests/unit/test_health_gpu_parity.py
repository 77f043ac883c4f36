"""The GPU checks added for parity with NHC, aznhc, GCM, DCGM and NVRx: each fires on
the NVML stand-in (scenario → collector → check), the way real NVML would answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import REAL_FIXTURES

from slurm_resilience.config.health import GpuCheckSection
from slurm_resilience.fakes import nvml as fake
from slurm_resilience.fakes import nvml_captures
from slurm_resilience.health.checks import gpu, gpu_fabric
from slurm_resilience.health.collectors import nvml as collector
from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot
from slurm_resilience.health.findings import Finding, Severity


def collect(tmp_path: Path, scenario: dict[str, Any], modules: str = "") -> NvmlSnapshot:
    fake.write_scenario(str(tmp_path / "n1.json"), scenario)
    return collector.collect("fake", str(tmp_path), "n1", modules)


def judge(snap: NvmlSnapshot, cfg: GpuCheckSection | None = None,
          state: dict[str, Any] | None = None, now: float = 1000.0, kind: str = "healthcheck"
          ) -> tuple[list[Finding], dict[str, Any]]:
    r = gpu.check(snap, cfg or GpuCheckSection(), state or {}, now=now, kind=kind)
    return r.findings, r.state


def fails(findings: list[Finding]) -> list[str]:
    return [f.message for f in findings if f.severity is Severity.FAIL]


def test_default_scenario_passes_and_travels_as_json(tmp_path: Path) -> None:
    """A healthy 8-GPU node passes every new check, and its snapshot survives the JSON
    hop from the collector child unchanged."""
    snap = collect(tmp_path, fake.default_scenario())
    assert NvmlSnapshot.from_json(snap.to_json()) == snap
    assert not fails(judge(snap, kind="prolog")[0])
    g = snap.gpus[0]
    assert g.recovery_action == 0 and g.memory_info_version == 2
    assert g.memory_reserved_bytes == fake.H100_RESERVED and g.sram_ecc is not None


def test_recovery_action_fails_and_unsupported_is_said(tmp_path: Path) -> None:
    """A recovery action other than NONE fails; a driver without the field says
    "not supported" instead of passing or failing silently."""
    scen = fake.default_scenario(2)
    scen["gpus"][1]["recovery_action"] = fake.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    assert fails(judge(collect(tmp_path, scen))[0]) == [
        "gpu1 NVML recovery action DRAIN_AND_RESET (expected NONE)"]
    assert not fails(judge(collect(tmp_path, scen), GpuCheckSection(recovery_action=False))[0])
    for g in scen["gpus"]:
        g["recovery_action"] = None  # an older driver: nvmlReturn NOT_SUPPORTED
    findings, _ = judge(collect(tmp_path, scen))
    assert not fails(findings)
    support = [f.message for f in findings if f.subject == "support"]
    assert support and "recovery_action" in support[0] and "not supported" in support[0]


def test_nvlink_error_counters_fail_on_their_rise(tmp_path: Path) -> None:
    """NVLink replay/recovery/CRC totals fail on the rise between runs, not on history."""
    scen = fake.default_scenario(2)
    scen["gpus"][0]["nvlink_errors"]["replay"] = 5000  # old history: a baseline
    _, state = judge(collect(tmp_path, scen), now=0)
    scen["gpus"][0]["nvlink_errors"]["replay"] = 5050
    scen["gpus"][0]["nvlink_errors"]["recovery"] = 2
    findings, state = judge(collect(tmp_path, scen), state=state, now=600)
    assert fails(findings) == ["gpu0 NVLink recovery errors +2 (expected <=0)"]
    scen["gpus"][0]["nvlink_errors"]["replay"] = 5500
    findings, _ = judge(collect(tmp_path, scen), state=state, now=1200)
    assert fails(findings) == ["gpu0 NVLink replay errors +450 (expected <=100)"]


def test_nvlink_crc_flit_and_data_limits_fire(tmp_path: Path) -> None:
    """The CRC flit and CRC data totals (NVML_FI_DEV_NVLINK_CRC_*_ERROR_COUNT_TOTAL) fail
    on a rise past their own limits: exactly the limit passes, one more fails, each names
    its counter; a site's lower limit in the config is the one applied; a total that goes
    down (driver reload) is a new baseline, not a failure."""
    scen = fake.default_scenario(2)
    scen["gpus"][0]["nvlink_errors"]["crc_flit"] = 7000  # history before the first run
    scen["gpus"][1]["nvlink_errors"]["crc_data"] = 300
    _, state = judge(collect(tmp_path, scen), now=0)
    scen["gpus"][0]["nvlink_errors"]["crc_flit"] = 7100  # +100: at the default limit
    scen["gpus"][1]["nvlink_errors"]["crc_data"] = 400
    findings, state = judge(collect(tmp_path, scen), state=state, now=600)
    assert not fails(findings)
    scen["gpus"][0]["nvlink_errors"]["crc_flit"] = 7201  # +101
    scen["gpus"][1]["nvlink_errors"]["crc_data"] = 650  # +250
    findings, state = judge(collect(tmp_path, scen), state=state, now=1200)
    assert fails(findings) == ["gpu0 NVLink crc_flit errors +101 (expected <=100)",
                               "gpu1 NVLink crc_data errors +250 (expected <=100)"]
    site = GpuCheckSection(max_nvlink_error_delta={"crc_flit": 100, "crc_data": 10,
                                                   "replay": 100, "recovery": 0})
    scen["gpus"][1]["nvlink_errors"]["crc_data"] = 661  # +11
    findings, state = judge(collect(tmp_path, scen), cfg=site, state=state, now=1800)
    assert fails(findings) == ["gpu1 NVLink crc_data errors +11 (expected <=10)"]
    scen["gpus"][0]["nvlink_errors"]["crc_flit"] = 3  # reset by a driver reload
    findings, _ = judge(collect(tmp_path, scen), state=state, now=2400)
    assert not fails(findings)


def test_pcie_replays_fail_as_a_rate(tmp_path: Path) -> None:
    """PCIe replays since reset are history (a real healthy H100 capture shows 120); a
    rise faster than max_pcie_replays_per_min fails."""
    scen = fake.default_scenario(1)
    scen["gpus"][0]["pcie_replay"] = 120
    _, state = judge(collect(tmp_path, scen), now=0)
    scen["gpus"][0]["pcie_replay"] = 150  # +30 in 10 min: under 8/min
    findings, state = judge(collect(tmp_path, scen), state=state, now=600)
    assert not fails(findings)
    scen["gpus"][0]["pcie_replay"] = 1150
    findings, _ = judge(collect(tmp_path, scen), state=state, now=1200)
    assert fails(findings) == ["gpu0 PCIe replays +1000 in 10min (expected <=80)"]


def test_sram_uncorrectable_threshold_and_correctable_rate(tmp_path: Path) -> None:
    """Any SRAM UE fails (aznhc), the threshold-exceeded flag fails, and a high
    correctable rate warns."""
    scen = fake.default_scenario(3)
    scen["gpus"][0]["sram_ecc"]["aggregate_unc_secded"] = 1
    scen["gpus"][1]["sram_ecc"]["threshold_exceeded"] = True
    findings, state = judge(collect(tmp_path, scen), now=0)
    assert fails(findings) == ["gpu0 1 SRAM uncorrectable errors (expected <=0)",
                               "gpu1 SRAM error threshold exceeded (expected not; replace the GPU)"]
    scen["gpus"][2]["sram_ecc"]["aggregate_cor"] = 500
    findings, _ = judge(collect(tmp_path, scen), state=state, now=3600)
    assert [f.message for f in findings if f.severity is Severity.WARN] == [
        "gpu2 SRAM correctable 500/h (expected <=100/h)"]


def test_fabric_v3_health(tmp_path: Path) -> None:
    """GB200: an UNHEALTHY summary with degraded bandwidth in the mask fails, naming it."""
    scen = fake.default_scenario(4)
    mask = (fake.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
            << fake.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW)
    scen["gpus"][2]["fabric"].update(
        health_mask=mask, health_summary=fake.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY)
    assert fails(judge(collect(tmp_path, scen))[0]) == [
        "gpu2 fabric health UNHEALTHY: degraded bandwidth (expected HEALTHY)"]
    assert not fails(judge(collect(tmp_path, scen), GpuCheckSection(fabric_health=False))[0])
    gfm = (fake.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_DISCONNECTED
           << fake.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE)
    assert gpu_fabric.mask_faults(gfm) == ["fabric manager: disconnected"]


def test_leftover_memory_uses_v2_and_a_per_model_allowance(tmp_path: Path) -> None:
    """Reserved memory is not a leftover (v1 counted it); GB200 gets its own allowance;
    a driver without v2 falls back to v1 and says so."""
    scen = fake.default_scenario(2)
    scen["gpus"][0]["memory"]["reserved"] = 2 << 30  # v1 would read 2 GiB used
    assert not fails(judge(collect(tmp_path, scen), kind="prolog")[0])
    scen["gpus"][0]["memory"]["v2"] = False
    assert fails(judge(collect(tmp_path, scen), kind="prolog")[0]) == [
        "gpu0 2.0GiB memory in use (NVML v1: includes reserved) (expected <1.0GiB)"]
    scen = fake.default_scenario(1)
    scen["gpus"][0].update(name="NVIDIA GB200")
    scen["gpus"][0]["memory"]["used"] = 3 << 30
    assert not fails(judge(collect(tmp_path, scen), kind="prolog")[0])
    scen["gpus"][0]["name"] = "NVIDIA H100 80GB HBM3"
    assert fails(judge(collect(tmp_path, scen), kind="prolog")[0])


def test_consistency_across_gpus(tmp_path: Path) -> None:
    """Persistence mode off fails; a VBIOS unlike its peers warns (fails when asked); a
    driver other than expected fails; nvidia_peermem missing fails when required."""
    scen = fake.default_scenario(4)
    scen["gpus"][1]["persistence_mode"] = False
    scen["gpus"][3]["vbios"] = "96.00.99.00.01"
    findings, _ = judge(collect(tmp_path, scen))
    assert fails(findings) == ["gpu1 persistence mode off (expected on)"]
    assert [f.message for f in findings if f.severity is Severity.WARN] == [
        "gpu3 96.00.99.00.01 VBIOS differs from NVIDIA H100 80GB HBM3 peers "
        "(expected 96.00.74.00.01)"]
    cfg = GpuCheckSection(uniform_vbios="fail", expected_driver="570.",
                          require_persistence_mode=False, peermem="required")
    modules = tmp_path / "modules"
    modules.write_text("nvidia_uvm 4 0 - Live 0x0\nnvidia 1 0 - Live 0x0\n")
    assert sorted(fails(judge(collect(tmp_path, scen, str(modules)), cfg)[0])) == [
        "driver 565.57.01 (expected 570.*)",
        "gpu3 96.00.99.00.01 VBIOS differs from NVIDIA H100 80GB HBM3 peers "
        "(expected 96.00.74.00.01)",
        "nvidia_peermem not loaded (expected loaded)"]
    modules.write_text("nvidia_peermem 16384 0 - Live 0x0\n")
    cfg = GpuCheckSection(peermem="required")
    scen = fake.default_scenario(2)
    assert not fails(judge(collect(tmp_path, scen, str(modules)), cfg)[0])


def test_sku_without_the_fields_reads_not_supported(tmp_path: Path) -> None:
    """An A100/V100-era GPU without SRAM status, NVLink counters or recovery action:
    those fields are None and named unsupported, and nothing fails for it."""
    scen = fake.default_scenario(1)
    scen["gpus"][0].update(sram_ecc=None, nvlink_errors=None, recovery_action=None,
                           pcie_replay=None, nvlinks=0, fabric=None)
    snap = collect(tmp_path, scen)
    g = snap.gpus[0]
    assert g.sram_ecc is None and g.nvlink_errors is None and g.recovery_action is None
    assert {"sram_ecc", "recovery_action", "nvlink_replay", "pcie_replay"} <= set(g.unsupported)
    assert not fails(judge(snap)[0])


def _aer(root: Path, bdf: str, cor: int, nonfatal: int, fatal: int) -> None:
    """sysfs aer_dev_* files in the kernel's format (sysfs-bus-pci-devices-aer_stats)."""
    d = root / bdf
    d.mkdir(parents=True, exist_ok=True)
    (d / "aer_dev_correctable").write_text(
        f"RxErr {cor}\nBadTLP 0\nBadDLLP 0\nRollover 0\nTimeout 0\nNonFatalErr 0\n"
        f"CorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR {cor}\n")
    (d / "aer_dev_nonfatal").write_text(
        f"Undefined 0\nDLP 0\nCmpltTO {nonfatal}\nUnsupReq 0\nTOTAL_ERR_NONFATAL {nonfatal}\n")
    (d / "aer_dev_fatal").write_text(
        f"Undefined 0\nDLP {fatal}\nSDES 0\nTLP 0\nMalfTLP 0\nTOTAL_ERR_FATAL {fatal}\n")


def test_pcie_aer_counters_fail_on_their_rise(tmp_path: Path) -> None:
    """A GPU's AER fatal/nonfatal totals rising between runs fail; sysfs is preferred to
    NVML's counters where both answer; a device with neither is named unsupported."""
    scen = fake.default_scenario(2)
    scen["gpus"][1]["pcie_counters"] = None  # nor NVML_FI_DEV_PCIE_COUNT_* either
    pci = tmp_path / "pci"
    _aer(pci, "0000:18:00.0", 5, 0, 0)  # gpu0 (bus 18); gpu1 (2a) has no AER files
    fake.write_scenario(str(tmp_path / "n1.json"), scen)
    snap = collector.collect("fake", str(tmp_path), "n1", "", str(pci))
    assert snap.gpus[0].pcie_aer == {"correctable": 5, "nonfatal": 0, "fatal": 0}
    assert snap.gpus[0].pcie_aer_source == "sysfs"  # NVML's 0s are not taken
    assert snap.gpus[1].pcie_aer is None and "pcie_aer" in snap.gpus[1].unsupported
    _, state = judge(snap, now=0)
    _aer(pci, "0000:18:00.0", 50, 1, 0)
    snap = collector.collect("fake", str(tmp_path), "n1", "", str(pci))
    assert fails(judge(snap, state=state, now=60)[0]) == [
        "gpu0 PCIe AER nonfatal +1 (expected <=0)"]
    for kept in state["gpus"].values():  # state from before NVML was a source: sysfs
        assert kept["counters"].pop("pcie_aer_source") in ("sysfs", None)
    assert fails(judge(snap, state=state, now=60)[0]) == [
        "gpu0 PCIe AER nonfatal +1 (expected <=0)"]


H200 = REAL_FIXTURES / "gpu-capture" / "h200-1gpu-vm_drv580.159.04"


def h200_node(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """The real H200 VM: its NVML answers (nvml-raw.json) and a sysfs device directory
    without aer_dev_* files, as facts.json recorded it."""
    scen = nvml_captures.scenario_from_nvml_raw(json.loads((H200 / "nvml-raw.json").read_text()))
    pci = tmp_path / "pci"
    (pci / "0000:00:06.0").mkdir(parents=True)
    return scen, pci


def collect_h200(tmp_path: Path, scen: dict[str, Any], pci: Path) -> NvmlSnapshot:
    fake.write_scenario(str(tmp_path / "vm.json"), scen)
    return collector.collect("fake", str(tmp_path), "vm", "", str(pci))


def test_pcie_errors_from_nvml_fail_on_their_rise_where_sysfs_has_no_aer(
        tmp_path: Path) -> None:
    """Without sysfs AER (the H200 VM) the PCIe error totals are NVML's
    NVML_FI_DEV_PCIE_COUNT_{CORRECTABLE_ERRORS,NON_FATAL_ERROR,FATAL_ERROR}, judged by their
    rise like sysfs AER; the snapshot says which source it used."""
    scen, pci = h200_node(tmp_path)
    snap = collect_h200(tmp_path, scen, pci)
    g = snap.gpus[0]
    assert (g.pcie_aer, g.pcie_aer_source) == ({"correctable": 0, "nonfatal": 0, "fatal": 0},
                                               "nvml")
    assert "pcie_aer" not in g.unsupported
    _, state = judge(snap, now=0)
    counters = scen["gpus"][0]["pcie_counters"]
    counters["non_fatal_error"] += 1
    counters["correctable_errors"] += 101
    findings, state = judge(collect_h200(tmp_path, scen, pci), state=state, now=60)
    assert fails(findings) == [
        "gpu0 PCIe correctable errors +101 (NVML counter; expected <=100)",
        "gpu0 PCIe nonfatal errors +1 (NVML counter; expected <=0)"]
    counters["fatal_error"] += 1
    findings, _ = judge(collect_h200(tmp_path, scen, pci), state=state, now=120)
    assert fails(findings) == ["gpu0 PCIe fatal errors +1 (NVML counter; expected <=0)"]


def test_captured_pcie_counters_of_a_healthy_gpu_stay_quiet(tmp_path: Path) -> None:
    """The real H200's counters as captured (lane errors, bad TLPs, NAKs and receiver
    errors above 0 on a healthy idle GPU; correctable/non-fatal/fatal 0) pass on the first
    run and on the next; the lane/TLP/NAK counters are never judged, so their rise passes
    too. A change of source (sysfs AER appearing) is a new baseline, not a rise."""
    scen, pci = h200_node(tmp_path)
    counters = scen["gpus"][0]["pcie_counters"]
    assert counters["lane_error"] > 0 and counters["bad_tlp"] > 0
    findings, state = judge(collect_h200(tmp_path, scen, pci), now=0)
    assert not fails(findings)
    assert not [f for f in findings if f.subject == "support" and "pcie_aer" in f.message]
    findings, state = judge(collect_h200(tmp_path, scen, pci), state=state, now=60)
    assert not fails(findings)
    for name in ("lane_error", "bad_tlp", "naks_sent", "receiver_error"):
        counters[name] += 1000
    findings, state = judge(collect_h200(tmp_path, scen, pci), state=state, now=120)
    assert not fails(findings)
    _aer(pci, "0000:00:06.0", 500, 3, 1)  # sysfs AER now: other counts, no rise yet
    snap = collect_h200(tmp_path, scen, pci)
    assert snap.gpus[0].pcie_aer_source == "sysfs"
    assert not fails(judge(snap, state=state, now=180)[0])


def test_degrading_memory_fails_on_its_corrected_error_rate(tmp_path: Path) -> None:
    """A GPU whose corrected ECC count climbs fast (degrading HBM) fails, stating the rate
    against the limit; a slow climb and old history do not. The real A100 capture with
    DRAM correctables reads them."""
    scen = fake.default_scenario(2)
    scen["gpus"][1]["ecc"]["aggregate_corrected"] = 50_000  # history: a baseline only
    _, state = judge(collect(tmp_path, scen), now=0)
    scen["gpus"][1]["ecc"]["aggregate_corrected"] = 50_500  # +500 in an hour
    findings, state = judge(collect(tmp_path, scen), state=state, now=3600)
    assert not fails(findings)
    scen["gpus"][1]["ecc"]["aggregate_corrected"] = 150_500  # +100000 in 10 minutes
    findings, _ = judge(collect(tmp_path, scen), state=state, now=4200)
    assert fails(findings) == [
        "gpu1 ECC corrected 600000/h (expected <=10000/h; degrading memory)"]
    real = nvml_captures.scenario_from_nvidia_smi(
        (REAL_FIXTURES / "nvidia-smi" /
         "nvidia-smi-q_a100-sxm4-80gb-x4_drv555_remap-pending_dram-ce.txt").read_text())
    assert any(g["ecc"]["aggregate_corrected"] > 0 for g in real["gpus"])
