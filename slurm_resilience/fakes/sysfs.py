"""A fake ``/sys/class/infiniband`` tree in the kernel's format.

Same layout and file contents as a real capture from an H100 node with CX7 HCAs
(``<hca>/{hca_type,fw_ver,board_id}``, ``<hca>/ports/<n>/{state,phys_state,rate,
link_layer}``, ``ports/<n>/counters/*``): ``4: ACTIVE``, ``5: LinkUp``,
``400 Gb/sec (4X NDR)``. Real sysfs entries under the class directory are
symlinks into ``/sys/devices``; here they are plain directories. Values end
with a newline, as sysfs attributes do.
"""

from __future__ import annotations

import os

# counters/ files of an mlx5 port, as in the real capture.
COUNTERS = (
    "VL15_dropped", "excessive_buffer_overrun_errors", "link_downed", "link_error_recovery",
    "local_link_integrity_errors", "multicast_rcv_packets", "multicast_xmit_packets",
    "port_rcv_constraint_errors", "port_rcv_data", "port_rcv_errors", "port_rcv_packets",
    "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors", "port_xmit_data", "port_xmit_discards", "port_xmit_packets",
    "port_xmit_wait", "symbol_error", "unicast_rcv_packets", "unicast_xmit_packets",
)
STATES = {"DOWN": "1: DOWN", "INIT": "2: INIT", "ARMED": "3: ARMED", "ACTIVE": "4: ACTIVE"}
PHYS_STATES = {"Sleep": "1: Sleep", "Polling": "2: Polling", "Disabled": "3: Disabled",
               "LinkUp": "5: LinkUp", "LinkErrorRecovery": "6: LinkErrorRecovery"}
RATE_NDR = "400 Gb/sec (4X NDR)"
# An NDR link that trained on 2 of its 4 lanes (the kernel prints width and speed).
RATE_NDR_2X = "200 Gb/sec (2X NDR)"
RATE_DOWN = "40 Gb/sec (4X QDR)"  # what a down mlx5 port reports, as in the ibstat captures


def _write(path: str, value: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(value + "\n")
    os.replace(tmp, path)


def add_hca(root: str, hca: str, *, ports: int = 1, rate: str = RATE_NDR,
            hca_type: str = "MT4129", fw_ver: str = "28.41.1000",
            board_id: str = "MT_0000000838") -> None:
    """One ConnectX-7 HCA with its ports ACTIVE/LinkUp and zeroed counters."""
    base = os.path.join(root, hca)
    _write(os.path.join(base, "hca_type"), hca_type)
    _write(os.path.join(base, "fw_ver"), fw_ver)
    _write(os.path.join(base, "board_id"), board_id)
    for port in range(1, ports + 1):
        set_port(root, hca, port, state="ACTIVE", phys_state="LinkUp", rate=rate)
        _write(os.path.join(base, "ports", str(port), "link_layer"), "InfiniBand")
        for name in COUNTERS:
            _write(os.path.join(base, "ports", str(port), "counters", name), "0")


def set_port(root: str, hca: str, port: int, *, state: str, phys_state: str,
             rate: str | None = None) -> None:
    pdir = os.path.join(root, hca, "ports", str(port))
    _write(os.path.join(pdir, "state"), STATES[state])
    _write(os.path.join(pdir, "phys_state"), PHYS_STATES[phys_state])
    if rate is not None:
        _write(os.path.join(pdir, "rate"), rate)


def port_down(root: str, hca: str, port: int) -> None:
    """The cable pulled: DOWN/Disabled, as ``ibstat`` shows a dead CX7 port."""
    set_port(root, hca, port, state="DOWN", phys_state="Disabled", rate=RATE_DOWN)


def add_to_counter(root: str, hca: str, port: int, name: str, delta: int) -> int:
    path = os.path.join(root, hca, "ports", str(port), "counters", name)
    with open(path, encoding="ascii") as fh:
        value = int(fh.read().strip() or 0) + delta
    _write(path, str(value))
    return value


def build(root: str, hcas: int = 8, *, rate: str = RATE_NDR) -> list[str]:
    """``mlx5_0`` .. ``mlx5_{hcas-1}``, all healthy."""
    names = [f"mlx5_{i}" for i in range(hcas)]
    for name in names:
        add_hca(root, name, rate=rate)
    return names


# ibstat prints the rate alone; sysfs adds width and generation.
_RATE_NAMES = {400: "4X NDR", 200: "4X HDR", 100: "4X EDR", 56: "4X FDR", 40: "4X QDR",
               25: "1X EDR", 20: "4X DDR", 10: "4X SDR"}
_IBSTAT_STATE = {"Active": "ACTIVE", "Down": "DOWN", "Initializing": "INIT", "Armed": "ARMED"}


def build_from_ibstat(root: str, text: str) -> list[str]:
    """A tree reproducing what a real ``ibstat`` capture shows (CAs, ports, states, rates,
    link layers); returns the CA names. How the stand-in is checked against reality."""
    names: list[str] = []
    hca = ""
    port = 0
    fields: dict[str, str] = {}

    def flush() -> None:
        if hca and port:
            rate = int(float(fields.get("Rate", "0")))
            set_port(root, hca, port, state=_IBSTAT_STATE.get(fields.get("State", ""), "DOWN"),
                     phys_state=fields.get("Physical state", "Disabled"),
                     rate=f"{rate} Gb/sec ({_RATE_NAMES.get(rate, '4X')})")
            pdir = os.path.join(root, hca, "ports", str(port))
            _write(os.path.join(pdir, "link_layer"), fields.get("Link layer", "InfiniBand"))
            for name in COUNTERS:
                _write(os.path.join(pdir, "counters", name), "0")

    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("CA '"):
            flush()
            hca, port, fields = line.split("'")[1], 0, {}
            names.append(hca)
        elif stripped.startswith("Port ") and stripped.endswith(":"):
            flush()
            port, fields = int(stripped[5:-1]), {}
        elif ":" in stripped and hca:
            key, _, value = stripped.partition(":")
            if not port and key == "CA type":
                _write(os.path.join(root, hca, "hca_type"), value.strip())
            elif not port and key == "Firmware version":
                _write(os.path.join(root, hca, "fw_ver"), value.strip())
            else:
                fields[key] = value.strip()
    flush()
    return names


# -- PCIe AER statistics: /sys/bus/pci/devices/<bdf>/aer_dev_{correctable,nonfatal,fatal} -----

# The kernel's names (drivers/pci/pcie/aer.c, aer_correctable_error_string and
# aer_uncorrectable_error_string), printed ``NAME COUNT`` a line and then the total
# (Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats).
AER_CORRECTABLE = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr",
                   "CorrIntErr", "HeaderOF")
AER_UNCORRECTABLE = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt",
                     "UnxCmplt", "RxOF", "MalfTLP", "ECRC", "UnsupReq", "ACSViol",
                     "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
                     "PoisonTLPBlocked")
AER_FILES = {"correctable": ("aer_dev_correctable", AER_CORRECTABLE, "TOTAL_ERR_COR"),
             "nonfatal": ("aer_dev_nonfatal", AER_UNCORRECTABLE, "TOTAL_ERR_NONFATAL"),
             "fatal": ("aer_dev_fatal", AER_UNCORRECTABLE, "TOTAL_ERR_FATAL")}


def sysfs_bdf(nvml_bus_id: str) -> str:
    """``00000000:18:00.0`` (NVML) → ``0000:18:00.0`` (the sysfs device name)."""
    dom, rest = nvml_bus_id.split(":", 1)
    return f"{int(dom, 16):04x}:{rest.lower()}"


def _aer_text(names: tuple[str, ...], total_name: str, counts: dict[str, int]) -> str:
    lines = [f"{n} {counts.get(n, 0)}" for n in names]
    lines.append(f"{total_name} {sum(counts.get(n, 0) for n in names)}")
    return "\n".join(lines)


def build_aer(root: str, bdf: str) -> None:
    """One AER-capable PCIe device with every counter at 0."""
    for _, (fname, names, total) in AER_FILES.items():
        _write(os.path.join(root, bdf, fname), _aer_text(names, total, {}))


def read_aer_counts(root: str, bdf: str, kind: str) -> dict[str, int]:
    fname, names, _ = AER_FILES[kind]
    with open(os.path.join(root, bdf, fname), encoding="ascii") as fh:
        pairs = (line.split() for line in fh)
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[0] in names}


def add_aer(root: str, bdf: str, kind: str, error: str, delta: int) -> int:
    """``error`` (a kernel name of ``kind``'s table) rises by ``delta``; returns the new total."""
    fname, names, total = AER_FILES[kind]
    if error not in names:
        raise ValueError(f"AER {kind} error {error!r}; valid: {', '.join(names)}")
    counts = read_aer_counts(root, bdf, kind)
    counts[error] = counts.get(error, 0) + delta
    _write(os.path.join(root, bdf, fname), _aer_text(names, total, counts))
    return sum(counts.values())
