"""Typed records of an NVML snapshot.

The collector runs in a forked child and hands its snapshot back as JSON
(:mod:`slurm_resilience.health.childproc`): :meth:`NvmlSnapshot.to_json` and
:meth:`NvmlSnapshot.from_json` are the two ends of that pipe, so the checks only
ever see these records. ``None`` in a field means the GPU or driver does not
have it (NVML answered NOT_SUPPORTED or FUNCTION_NOT_FOUND); the names of such
fields are listed in :attr:`GpuRecord.unsupported` so a check can say so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pcie:
    gen: int | None = None
    gen_max: int | None = None
    width: int | None = None
    width_max: int | None = None
    replay: int | None = None  # NVML_FI_DEV_PCIE_REPLAY_COUNTER (link-level retries)


@dataclass
class RemapRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failed: bool


@dataclass
class Fabric:
    """nvmlGpuFabricInfo (V3 where the driver has it: health mask and summary).

    ``cluster_uuid`` and ``clique_id`` name the NVLink domain (on GB200 NVL72, the rack's
    NVLink partition): GPUs that share both share one multi-node NVLink fabric. A clique id
    alone is not unique across clusters. ``cluster_uuid`` is the 16 bytes as a UUID string.
    """

    state: int
    status: int
    health_mask: int | None = None
    health_summary: int | None = None
    cluster_uuid: str | None = None
    clique_id: int | None = None


@dataclass
class SramEcc:
    """nvmlDeviceGetSramEccErrorStatus (c_nvmlEccSramErrorStatus_v1_t)."""

    aggregate_uncorrected: int  # aggregateUncParity + aggregateUncSecDed
    aggregate_corrected: int
    volatile_corrected: int
    threshold_exceeded: bool


@dataclass
class NvlinkErrors:
    """Totals over all links and lanes (NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL)."""

    crc_flit: int | None = None
    crc_data: int | None = None
    replay: int | None = None
    recovery: int | None = None

    def items(self) -> list[tuple[str, int]]:
        return [(k, v) for k, v in dataclasses.asdict(self).items() if v is not None]


@dataclass
class GpuProcess:
    pid: int
    used_bytes: int


@dataclass
class GpuRecord:
    index: int
    lost: bool = False
    errors: dict[str, str] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)
    pci_bus_id: str | None = None
    name: str | None = None
    uuid: str | None = None
    serial: str | None = None  # the board serial an RMA names
    vbios: str | None = None
    persistence_mode: bool | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    retired_pages: int | None = None
    retired_pending: bool | None = None
    remap: RemapRows | None = None
    throttle_reasons: int | None = None
    temperature_c: int | None = None
    pcie: Pcie = field(default_factory=Pcie)
    nvlink: list[bool] | None = None
    nvlink_errors: NvlinkErrors | None = None
    processes: list[GpuProcess] | None = None
    memory_used_bytes: int | None = None
    # 2: nvmlDeviceGetMemoryInfo_v2 (reserved excluded); 1: v1 `used`, reserved included.
    memory_info_version: int | None = None
    memory_reserved_bytes: int | None = None
    fabric: Fabric | None = None
    recovery_action: int | None = None
    sram_ecc: SramEcc | None = None
    # PCIe error totals {correctable, nonfatal, fatal}: sysfs AER (aer_dev_* TOTAL_ERR_*)
    # where the kernel has it, else NVML's NVML_FI_DEV_PCIE_COUNT_{CORRECTABLE_ERRORS,
    # NON_FATAL_ERROR,FATAL_ERROR}; pcie_aer_source says which ("sysfs", "nvml").
    pcie_aer: dict[str, int] | None = None
    pcie_aer_source: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuRecord:
        def opt(key: str, kind: Any) -> Any:
            value = d.get(key)
            return None if value is None else kind(**value)

        procs = d.get("processes")
        return cls(
            index=int(d["index"]), lost=bool(d.get("lost")), errors=dict(d.get("errors", {})),
            unsupported=list(d.get("unsupported", [])), pci_bus_id=d.get("pci_bus_id"),
            name=d.get("name"), uuid=d.get("uuid"), serial=d.get("serial"), vbios=d.get("vbios"),
            persistence_mode=d.get("persistence_mode"),
            ecc_volatile_uncorrected=d.get("ecc_volatile_uncorrected"),
            ecc_aggregate_uncorrected=d.get("ecc_aggregate_uncorrected"),
            ecc_aggregate_corrected=d.get("ecc_aggregate_corrected"),
            retired_pages=d.get("retired_pages"), retired_pending=d.get("retired_pending"),
            remap=opt("remap", RemapRows), throttle_reasons=d.get("throttle_reasons"),
            temperature_c=d.get("temperature_c"), pcie=Pcie(**d.get("pcie", {})),
            nvlink=d.get("nvlink"), nvlink_errors=opt("nvlink_errors", NvlinkErrors),
            processes=None if procs is None else [GpuProcess(**p) for p in procs],
            memory_used_bytes=d.get("memory_used_bytes"),
            memory_info_version=d.get("memory_info_version"),
            memory_reserved_bytes=d.get("memory_reserved_bytes"),
            fabric=opt("fabric", Fabric), recovery_action=d.get("recovery_action"),
            sram_ecc=opt("sram_ecc", SramEcc),
            pcie_aer=None if d.get("pcie_aer") is None else dict(d["pcie_aer"]),
            pcie_aer_source=d.get("pcie_aer_source"))


@dataclass
class NvmlSnapshot:
    backend: str
    driver: str | None = None
    count: int | None = None
    gpus: list[GpuRecord] = field(default_factory=list)
    error: str | None = None
    no_driver: bool = False
    warnings: list[str] = field(default_factory=list)
    # nvidia_peermem in the loaded modules; None: not looked for or unreadable.
    peermem_loaded: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NvmlSnapshot:
        return cls(backend=str(d.get("backend", "")), driver=d.get("driver"),
                   count=d.get("count"),
                   gpus=[GpuRecord.from_json(g) for g in d.get("gpus", [])],
                   error=d.get("error"), no_driver=bool(d.get("no_driver")),
                   warnings=list(d.get("warnings", [])),
                   peermem_loaded=d.get("peermem_loaded"))
