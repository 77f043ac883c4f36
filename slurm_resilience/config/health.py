"""Configuration of the node health gate (``health:``): one section per check.

Every check has ``enabled`` (its kill switch), its thresholds, and
``on_unknown``: what a "could not check" result means for the node.
``fail-closed`` drains it (the check is essential and the hardware did not
answer), ``fail-open`` only reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slurm_resilience.config.loader import ByteSize, setting

Policy = Literal["fail-open", "fail-closed"]


@dataclass(frozen=True)
class GpuCheckSection:
    """GPU health through NVML."""

    enabled: bool = setting(True, help="kill switch: false skips this check everywhere")
    on_unknown: Policy = setting(
        "fail-closed", help="NVML not answering (driver not loaded, timeout) drains the node "
                            "(fail-closed) or is only reported (fail-open)")
    expected_count: int = setting(
        -1, min=-1, max=64,
        help="GPUs this node must show; -1: the gpu count in SLURM_JOB_GPUS/gres when known, "
             "else no count check; 0: this node has no GPUs (the GPU checks are skipped)")
    max_volatile_uncorrectable_ecc: int = setting(
        0, min=0, help="volatile (since driver load) uncorrectable ECC errors tolerated")
    max_aggregate_uncorrectable_ecc: int = setting(
        -1, min=-1, help="lifetime uncorrectable ECC errors tolerated; -1: not checked")
    max_ecc_corrected_per_hour: float = setting(
        10000.0, min=0,
        help="rise of the lifetime corrected ECC count (HBM and SRAM) per hour between runs "
             "that fails: degrading memory corrects more and more before it fails. No "
             "public rate figure was found; set high so only a clearly degrading GPU drains")
    max_retired_pages: int = setting(
        60, min=0, help="retired pages (single + double bit) tolerated on pre-Ampere GPUs")
    fail_on_retired_pages_pending: bool = setting(
        True, help="pages waiting for retirement (a GPU reset applies them) fail the node")
    fail_on_remap_pending: bool = setting(
        True, help="rows waiting to be remapped (a GPU reset applies them) fail the node")
    max_temperature_c: int = setting(85, min=30, max=120, help="GPU core temperature limit")
    throttle_window_s: int = setting(
        3600, min=60,
        help="HW slowdown and HW power brake are judged as a rate over this window (not one "
             "sample); HW thermal slowdown still fails on one reading")
    throttle_fail_runs: int = setting(
        3, min=1, max=1000,
        help="runs within the window that saw HW slowdown or power brake and fail the GPU; "
             "fewer are reported (warn)")
    sw_thermal_warn_runs: int = setting(
        3, min=1, max=100,
        help="consecutive runs with SW thermal slowdown before it is reported (warn)")
    check_pcie: bool = setting(True, help="PCIe generation/width below the device maximum fails")
    expected_nvlinks: int = setting(
        -1, min=-1, max=36,
        help="active NVLinks each GPU must have; -1: every link NVML reports must be active; "
             "0: no NVLink check")
    leftover_processes: bool = setting(
        True, help="prolog only: compute processes left on a GPU by a previous job fail; "
                   "only the job's GPUs (SLURM_JOB_GPUS) when set, since jobs may share a node")
    leftover_memory: ByteSize = setting(
        ByteSize(1 << 30),
        help="prolog only: GPU memory in use above this on the job's GPUs fails (NVML v2 "
             "memory info, which leaves out the driver's reserved memory)")
    leftover_memory_by_model: dict[str, int] = setting(
        default_factory=lambda: {"GH200": 4 << 30, "GB200": 4 << 30},
        help="per GPU model (a word of the NVML name), bytes allowed instead of "
             "leftover_memory: on Grace systems pages may stay mapped after a process exits")
    recovery_action: bool = setting(
        True, help="a GPU whose NVML recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) is "
                   "not NONE fails; drivers without the field are reported as not supported")
    max_nvlink_error_delta: dict[str, int] = setting(
        default_factory=lambda: {"crc_flit": 100, "crc_data": 100, "replay": 100,
                                 "recovery": 0},
        help="NVLink error totals (all links) and the rise tolerated between two runs")
    pci_sysfs_root: str = setting(
        "/sys/bus/pci/devices", help="where each GPU's PCIe AER counters are read "
                                     "(<bdf>/aer_dev_*); may hold {node}; empty: not read. "
                                     "Where sysfs has none, NVML's counters are used")
    max_pcie_aer_delta: dict[str, int] = setting(
        default_factory=lambda: {"fatal": 0, "nonfatal": 0, "correctable": 100},
        help="PCIe error totals of a GPU (correctable, nonfatal, fatal: sysfs AER, else "
             "NVML's NVML_FI_DEV_PCIE_COUNT_{CORRECTABLE_ERRORS,NON_FATAL_ERROR,FATAL_ERROR}) "
             "and the rise tolerated between two runs; {}: not checked")
    max_pcie_replays_per_min: float = setting(
        8.0, min=0, help="PCIe replay counter rise per minute between runs that fails "
                         "(DCGM's default PCIe replay rate limit)")
    max_sram_uncorrectable: int = setting(
        0, min=-1, help="lifetime (aggregate) SRAM uncorrectable errors tolerated; -1: not "
                        "checked")
    fail_on_sram_threshold: bool = setting(
        True, help="the driver's SRAM error threshold-exceeded flag fails the GPU")
    max_sram_correctable_per_hour: float = setting(
        100.0, min=0, help="SRAM correctable errors per hour between runs above which the GPU "
                           "is reported (warn)")
    fabric_health: bool = setting(
        True, help="fabric health summary and mask (NVML V3, GB200 NVL72): unhealthy, degraded "
                   "bandwidth, route or configuration faults fail")
    require_persistence_mode: bool = setting(
        True, help="every GPU must have persistence mode enabled")
    uniform_vbios: Literal["off", "warn", "fail"] = setting(
        "warn", help="GPUs of the same model running different VBIOS versions: reported "
                     "(warn), drain (fail) or not checked. warn by default: a real healthy "
                     "8xV100 capture shows two VBIOS versions on one node")
    expected_driver: str = setting(
        "", help="driver version the node must run (prefix match, e.g. '570.'); empty: any, "
                 "but all GPUs report one driver")
    peermem: Literal["off", "required"] = setting(
        "off", help="required: the nvidia_peermem module must be loaded (GPUDirect RDMA "
                    "without DMA-BUF); off: not checked (DMA-BUF needs no module)")
    modules_file: str = setting(
        "/proc/modules", help="loaded kernel modules, for the peermem check; may hold {node}")
    fabric_manager: Literal["auto", "required", "off"] = setting(
        "auto", help="NVSwitch fabric state: auto checks it where NVML reports it, "
                     "required fails when it is not reported")


@dataclass(frozen=True)
class XidCheckSection:
    """NVIDIA Xid events from the kernel log."""

    enabled: bool = setting(True, help="kill switch: false skips this check everywhere")
    on_unknown: Policy = setting("fail-open", help="kernel log unreadable: drain or only report")
    source: Literal["kmsg", "journal", "file"] = setting(
        "kmsg", help="kmsg reads /dev/kmsg; journal runs journalctl -k; file reads `path`")
    path: str = setting(
        "/dev/kmsg", help="file read when source is kmsg or file; may hold {node}. A file in "
                          "/dev/kmsg record format or dmesg/syslog text lines")
    boot_id_file: str = setting(
        "/proc/sys/kernel/random/boot_id",
        help="identifies the boot; events of an earlier boot are forgotten (a reboot resets GPUs)")
    window_s: int = setting(
        86400, min=60, help="non-fatal Xids are listed for this long; with fatal_until: window, "
                            "fatal ones fail the node for this long too")
    fatal_until: Literal["repair", "window"] = setting(
        "repair", help="repair: a fatal Xid fails its GPU until the repair NVIDIA's action "
                       "asks for (a new boot; a GPU reset or a new boot; for what a "
                       "diagnostic can clear, a passing diagnostic); window: until window_s "
                       "passed")
    repeat_bursts: int = setting(
        3, min=0, help="an Xid NVIDIA sends to a diagnostic when it repeats on one GPU (13, "
                       "31: DCGM EUD) is reported (warn, with the diagnostic named; the "
                       "epilog's diag.after_failure runs one) after this many bursts in the "
                       "window since the GPU's last diagnostic or reset; 0: never")
    repeat_gap_s: float = setting(
        60.0, min=1, help="Xid lines of one code on one GPU closer than this are one burst "
                          "(one fault prints several lines)")
    fatal: tuple[int, ...] = setting(
        default_factory=tuple,
        help="Xid codes that drain the node; empty: the built-in list (see xid_catalog.py)")
    extra_fatal: tuple[int, ...] = setting(
        default_factory=tuple, help="Xid codes added to the fatal list")
    not_fatal: tuple[int, ...] = setting(
        default_factory=tuple, help="Xid codes removed from the fatal list")
    max_read_bytes: ByteSize = setting(
        ByteSize(4 << 20), min=4096, help="most bytes of the kernel log read per run")


@dataclass(frozen=True)
class KernelLogCheckSection:
    """Host failures in the kernel log (read together with the Xids, same source)."""

    enabled: bool = setting(True, help="kill switch: false skips every host-signal check")
    on_unknown: Policy = setting("fail-open", help="kernel log unreadable: drain or only report")
    window_s: int = setting(
        86400, min=60, help="events of the current boot this recent are counted")
    nvme_io_errors: bool = setting(True, help="kill switch: NVMe I/O errors and timeouts")
    max_nvme_io_errors: int = setting(
        0, min=0, help="NVMe I/O errors tolerated per device in the window")
    readonly_remount: bool = setting(
        True, help="kill switch: a filesystem remounted read-only (EXT4) or shut down (XFS, "
                   "btrfs forced readonly) fails the node")
    soft_lockups: bool = setting(True, help="kill switch: CPU soft lockups")
    max_soft_lockups: int = setting(
        2, min=0, help="soft lockups tolerated in the window (busy VMs report a few)")
    hard_lockups: bool = setting(True, help="kill switch: any hard lockup fails the node")
    mce: bool = setting(True, help="kill switch: machine checks; any uncorrected one fails")
    max_corrected_mce: int = setting(
        100, min=0, help="corrected machine-check/EDAC events tolerated in the window")
    sxids: bool = setting(
        True, help="kill switch: NVSwitch SXids (fatal ones fail, non-fatal ones warn)")
    max_fatal_sxids: int = setting(
        0, min=0, help="fatal SXids tolerated per NVSwitch and SXid number in the current "
                       "boot (not only the window: a fatal SXid lasts until the reset)")
    pcie_aer: bool = setting(
        True, help="kill switch: PCIe AER errors the kernel logs (pcieport/device 'AER: "
                   "... error received'), judged per device like the sysfs AER counters")
    max_pcie_aer_errors: dict[str, int] = setting(
        default_factory=lambda: {"fatal": 0, "nonfatal": 0, "correctable": 100},
        help="kernel-log AER errors tolerated per device in the window by class (fatal, "
             "nonfatal: uncorrectable; correctable); the defaults of gpu.max_pcie_aer_delta; "
             "a class left out is not checked")


@dataclass(frozen=True)
class InfinibandCheckSection:
    """InfiniBand HCAs and ports from sysfs."""

    enabled: bool = setting(True, help="kill switch: false skips this check everywhere")
    on_unknown: Policy = setting("fail-closed", help="sysfs unreadable: drain or only report")
    sysfs_root: str = setting(
        "/sys/class/infiniband", help="where the HCAs are listed; may hold {node}")
    expected_hcas: tuple[str, ...] = setting(
        default_factory=tuple,
        help="HCAs that must be present, e.g. [mlx5_0, mlx5_1]; empty: every HCA found with "
             "link_layer InfiniBand (then a missing one is not noticed)")
    ports: tuple[int, ...] = setting(default_factory=lambda: (1,), help="ports checked per HCA")
    min_rate_gbps: float = setting(
        0.0, min=0, help="lowest acceptable rate, e.g. 400 for NDR; 0: not checked")
    hcas_by_gpu_model: dict[str, int] = setting(
        default_factory=lambda: {"H100": 8, "H200": 8, "A100": 8, "B200": 8, "GB200": 4},
        help="InfiniBand HCAs a node with this GPU model (a word of the NVML name; PCIe/NVL "
             "boards don't match) must show when expected_hcas is empty. Applied only where "
             "at least one InfiniBand HCA is present, so nodes on Ethernet/EFA are not failed")
    min_rate_gbps_by_gpu_model: dict[str, float] = setting(
        default_factory=lambda: {"H100": 400.0, "H200": 400.0, "A100": 200.0, "B200": 400.0,
                                 "GB200": 400.0},
        help="lowest port rate for this GPU model when min_rate_gbps is 0 (same matching and "
             "condition as hcas_by_gpu_model)")
    max_counter_delta: dict[str, int] = setting(
        default_factory=lambda: {
            "symbol_error": 100, "link_downed": 0, "link_error_recovery": 10,
            "port_rcv_errors": 100, "excessive_buffer_overrun_errors": 10,
        },
        help="error counters (counters/<name>) and the rise tolerated between two runs; "
             "link_downed counts link flaps")


@dataclass(frozen=True)
class NvmeCheckSection:
    """The local NVMe / checkpoint staging disk."""

    enabled: bool = setting(True, help="kill switch: false skips this check everywhere")
    on_unknown: Policy = setting("fail-open", help="probe impossible: drain or only report")
    path: str = setting(
        "", help="mount point (or directory on it) that checkpoint staging writes to; "
                 "may hold {node}; empty: no staging disk, nothing checked")
    require_mountpoint: bool = setting(
        False, help="path itself must be a mount point (catches a disk that failed to mount "
                    "and left the empty directory)")
    min_free: ByteSize = setting(ByteSize(50 << 30), help="free space below this fails")
    size_limit: ByteSize = setting(
        ByteSize(0),
        help="treat the disk as this big (0: its real size). Used by the sandbox, where "
             "every node's directory shares one filesystem")
    probe: bool = setting(True, help="write+fsync a small file and time it")
    max_probe_ms: float = setting(500.0, min=1, help="write+fsync latency limit")
    smart: bool = setting(
        True, help="read `nvme smart-log -o json` when nvme-cli is installed")
    device: str = setting("/dev/nvme0", help="device for nvme smart-log")
    max_percentage_used: int = setting(
        95, min=1, max=255, help="NVMe endurance used (percentage_used) above this fails")
    max_media_errors: int = setting(
        0, min=-1, help="NVMe media and data integrity errors (unrecovered reads/writes) "
                        "tolerated; -1: not checked")
    min_available_spare: int = setting(
        0, min=0, max=100, help="available spare (percent) below this fails; the drive's own "
                                "available_spare_threshold always applies")


@dataclass(frozen=True)
class MountsCheckSection:
    """Shared filesystems the jobs need (home, datasets, checkpoints)."""

    enabled: bool = setting(True, help="kill switch: false skips this check everywhere")
    on_unknown: Policy = setting("fail-open", help="probe impossible: drain or only report")
    paths: tuple[str, ...] = setting(
        default_factory=tuple,
        help="paths that must answer, e.g. [/home, /datasets]; each is stat'ed in its own "
             "child; empty: nothing checked")
    timeout_s: float = setting(
        2.0, min=0.1, max=60,
        help="a path that doesn't answer within this fails (a hung server); kept below "
             "health.collector_timeout_s")
    require_mountpoint: bool = setting(
        True, help="each path must itself be a mount point (an unmounted filesystem leaves "
                   "an empty directory that stat happily answers for)")


@dataclass(frozen=True)
class ServicesCheckSection:
    """systemd units the GPUs need (HealthCheckProgram and manual runs; the prolog runs
    no external command)."""

    enabled: bool = setting(True, help="kill switch: false skips this check everywhere")
    on_unknown: Policy = setting("fail-open", help="systemctl unusable: drain or only report")
    units: tuple[str, ...] = setting(
        default_factory=tuple,
        help="units that must be active, e.g. [nvidia-fabricmanager] on NVSwitch (HGX/DGX) "
             "systems, [nvidia-imex, nvidia-fabricmanager] on GB200 NVL72 trays; "
             "empty: nothing checked")


@dataclass(frozen=True)
class DiagCheckSection:
    """Active GPU diagnostics: ``dcgmi diag`` where DCGM is installed, else a small torch
    memory and bandwidth test. Never on the prolog path: ``slurm-resilience check --only
    diag`` runs them, the epilog after a GPU failure (``after_failure``), and idle nodes
    through the NCCL idle verification's node lock (``idle_interval_s``)."""

    enabled: bool = setting(True, help="kill switch: false skips active diagnostics")
    on_unknown: Policy = setting(
        "fail-open", help="no tool to run them (no dcgmi, no CUDA torch): drain or only report")
    tool: Literal["auto", "dcgmi", "torch"] = setting(
        "auto", help="auto: dcgmi when installed, else the torch test")
    level: int = setting(2, min=1, max=4, help="dcgmi diag -r level (2 ~2 min, 3 ~15 min)")
    timeout_s: float = setting(900.0, min=10, max=7200, help="hard limit of one run")
    memtest_bytes: ByteSize = setting(ByteSize(1 << 30), help="torch test: HBM block per GPU")
    memtest_iters: int = setting(10, min=1, max=1000, help="torch test: timed copies per size")
    dcgm_setting_severity: Literal["warn", "fail"] = setting(
        "warn", help="a DCGM failure that is a setting (persistence mode off, ECC off, a "
                     "CUDA environment variable, Fabric Manager not running: DCGM error 29, "
                     "55, 28, 108...) is reported naming the setting and its fix (warn) or "
                     "drains (fail); hardware and reset-requiring errors always drain")
    after_failure: bool = setting(
        False, help="the epilog runs the diagnostics when its own checks failed on a GPU "
                    "(a gpu or xid finding that drains); counted in the epilog's budget")
    after_failure_level: int = setting(2, min=1, max=4,
                                       help="dcgmi diag -r level of the epilog's run")
    after_failure_timeout_s: float = setting(
        240.0, min=10, max=3600,
        help="hard limit of the epilog's run; hooks.epilog_timeout_s must hold it")
    idle_interval_s: float = setting(
        0.0, min=0,
        help="an idle node runs the diagnostics this often, in the background under the "
             "NCCL node lock (a job arriving stops it); 0: never")
    min_hbm_gbps_by_model: dict[str, float] = setting(
        default_factory=lambda: {"H100": 2000.0, "H200": 3000.0, "A100": 1200.0,
                                 "B200": 4500.0, "GB200": 4500.0},
        help="torch test: least device-to-device copy bandwidth (GB/s, read+write) per GPU "
             "model; set at ~60% of the HBM peak (no public figure for this copy test)")
    min_host_gbps_by_model: dict[str, float] = setting(
        default_factory=lambda: {"H100": 48.0, "H200": 48.0, "A100": 20.0, "B200": 48.0,
                                 "GB200": 100.0},
        help="torch test: least host-to-device and device-to-host bandwidth (GB/s) per GPU "
             "model; H100 is aznhc's check_gpu_bw 48, the others are set conservatively")


@dataclass(frozen=True)
class GdrCheckSection:
    """GPUDirect RDMA loopback bandwidth per HCA with perftest's ``ib_write_bw`` (server
    and client on this host, ``--use_cuda`` when GPUs exist). Active: only ``check --only
    gdr`` and the idle diagnostics run it; never a hook."""

    enabled: bool = setting(True, help="kill switch: false never runs ib_write_bw")
    on_unknown: Policy = setting(
        "fail-open", help="ib_write_bw not installed, or a test that did not finish: drain "
                          "or only report")
    args: list[str] = setting(
        default_factory=lambda: ["-s", "8388608", "-n", "5000", "-F"],
        help="ib_write_bw arguments besides -d, -p, --report_gbits and --use_cuda")
    port: int = setting(18515, min=1024, max=65000,
                        help="TCP port of the first HCA's loopback pair (then +1 per HCA)")
    timeout_s: float = setting(60.0, min=5, max=600, help="hard limit per HCA")
    max_hcas: int = setting(16, min=1, max=64,
                            help="HCAs tested at most (the run's limit is timeout_s each)")
    gpu_by_hca: dict[str, int] = setting(
        default_factory=dict,
        help="the GPU whose memory each HCA's test uses (the one nearest it); unlisted HCAs "
             "take GPUs in order (mlx5_0 -> 0 ...)")
    min_gbps_by_link_rate: dict[str, float] = setting(
        default_factory=lambda: {"800": 720.0, "400": 360.0, "200": 180.0, "100": 90.0},
        help="least BW average (Gb/s) by the port's link rate; NDR 360 is aznhc's lower "
             "figure (it ships 380/360), the others the same 90% of line rate")


# The module each ``health.backend`` loads (by name, with importlib): production code never
# imports the hardware stand-in; only this configuration names it. A stand-in has pynvml's
# interface plus ``use_scenario(path)`` and ``scenario_path(dir, node)``.
NVML_MODULES = {"nvml": "pynvml", "fake": "slurm_resilience.fakes.nvml"}


@dataclass(frozen=True)
class HealthSection:
    """The node health gate run by the prolog, epilog and HealthCheckProgram."""

    backend: Literal["nvml", "fake"] = setting(
        "nvml", help="nvml uses pynvml (nvidia-ml-py); fake uses the scenario-driven stand-in")
    scenario_dir: str = setting(
        "", help="fake backend: directory with one <node>.json (or .yaml) scenario per node")
    collector_timeout_s: float = setting(
        5.0, min=0.1, max=120,
        help="hard limit of each collector; a collector past it (e.g. a driver call stuck "
             "in D-state) is a finding")
    state_dir: str = setting(
        "", help="state files (Xid events, IB counters, pass streaks); may hold {node}; "
                 "empty: <node.state_dir>/health")
    resume_after_passes: int = setting(
        3, min=1, max=100,
        help="HealthCheckProgram resumes a node we drained after this many consecutive passes")
    release_held_jobs: bool = setting(
        True, help="HealthCheckProgram releases jobs held 'launch failed requeued held' on a "
                   "node we drained (for sites that cannot set nohold_on_prolog_fail)")
    fault_requeue_max: int = setting(
        3, min=0, max=100,
        help="the epilog requeues a requeueable job that ended non-zero on a node it finds "
             "faulty (away from the node) at most this many times per job; its own cap, "
             "apart from the hang requeues; 0: never")
    check_on_rank_death_s: float = setting(
        30.0, min=0, max=86400,
        help="when a job's rank on this node dies (its process gone before it finished), the "
             "agent runs the node's HealthCheckProgram at once, at most once per this many "
             "seconds, so a fault that killed it (an Xid) drains the node in seconds, not at "
             "the next HealthCheckInterval; 0: never")
    gpu: GpuCheckSection = setting(default_factory=GpuCheckSection, help="GPU checks")
    xid: XidCheckSection = setting(default_factory=XidCheckSection, help="Xid checks")
    kernel_log: KernelLogCheckSection = setting(
        default_factory=KernelLogCheckSection,
        help="host signals in the kernel log: NVMe I/O errors, read-only remounts, lockups, MCE")
    infiniband: InfinibandCheckSection = setting(
        default_factory=InfinibandCheckSection, help="InfiniBand checks")
    nvme: NvmeCheckSection = setting(default_factory=NvmeCheckSection, help="NVMe checks")
    mounts: MountsCheckSection = setting(
        default_factory=MountsCheckSection, help="shared filesystem checks")
    services: ServicesCheckSection = setting(
        default_factory=ServicesCheckSection, help="GPU service units (Fabric Manager, IMEX)")
    diag: DiagCheckSection = setting(
        default_factory=DiagCheckSection, help="active GPU diagnostics (only when asked)")
    gdr: GdrCheckSection = setting(
        default_factory=GdrCheckSection,
        help="GPUDirect RDMA loopback bandwidth per HCA (only when asked, or idle)")

    def validate(self) -> None:
        if self.backend == "fake" and not self.scenario_dir:
            raise ValueError("backend fake needs scenario_dir")
        if self.mounts.paths and self.mounts.timeout_s >= self.collector_timeout_s:
            raise ValueError("health.mounts.timeout_s must be below "
                             "health.collector_timeout_s (the mounts collector's own limit)")
        unknown_aer = set(self.kernel_log.max_pcie_aer_errors) - {"fatal", "nonfatal",
                                                                   "correctable"}
        if unknown_aer:
            raise ValueError(f"health.kernel_log.max_pcie_aer_errors: {sorted(unknown_aer)} "
                             "are none of fatal, nonfatal, correctable")
