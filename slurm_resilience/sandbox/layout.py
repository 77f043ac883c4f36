"""Where everything of one sandbox lives: paths, node names, ports, leaf switches.

A sandbox is fully described by its state directory, its node and leaf counts
and its port base, so several can run side by side (tests start their own).
Everything here is pure: no file is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The repository root: the parent of the package directory.
REPO = Path(__file__).resolve().parents[2]
DEFAULT_STATE_DIR = REPO / ".sandbox"
DEFAULT_PORT_BASE = 17000
# Ports used: slurmctld = base, slurmd = base+1 … base+N, node agents' exchange listeners =
# base+AGENT_OFFSET+1 … base+AGENT_OFFSET+N, their metrics endpoints =
# base+METRICS_OFFSET+1 … base+METRICS_OFFSET+N, S3 endpoint = base+S3_OFFSET.
S3_OFFSET = 99
AGENT_OFFSET = 50
METRICS_OFFSET = 74
MAX_NODES = min(S3_OFFSET - METRICS_OFFSET - 1, METRICS_OFFSET - AGENT_OFFSET)
# Block mode: leaf i is the NVLink domain with clique id CLIQUE_BASE + i (the real GB200
# capture's clique 0x7ffe for the first).
CLIQUE_BASE = 0x7FFE
BUCKET = "ckpt"


@dataclass(frozen=True)
class Layout:
    """The shape and location of one sandbox."""

    state_dir: Path = DEFAULT_STATE_DIR
    nodes: int = 4
    leaves: int = 2
    port_base: int = DEFAULT_PORT_BASE
    repo: Path = REPO
    # slurm.conf keys replaced or added, e.g. (("Prolog", "/tmp/fail.sh"),), for experiments.
    slurm_overrides: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"sandbox: nodes={self.nodes} must be between 1 and {MAX_NODES}")
        if not 1 <= self.leaves <= self.nodes:
            raise ValueError(f"sandbox: leaves={self.leaves} must be between 1 and "
                             f"nodes={self.nodes}")
        if not 1024 <= self.port_base <= 65535 - S3_OFFSET:
            raise ValueError(f"sandbox: port_base={self.port_base} must be between 1024 and "
                             f"{65535 - S3_OFFSET}")
        object.__setattr__(self, "state_dir", Path(self.state_dir).absolute())
        object.__setattr__(self, "slurm_overrides",
                           tuple((str(k), str(v)) for k, v in self.slurm_overrides))

    # -- names and ports -------------------------------------------------------------------

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def leaf_names(self) -> list[str]:
        return [f"leaf{i:02d}" for i in range(1, self.leaves + 1)]

    def leaf_of(self) -> dict[str, str]:
        """Node → leaf switch: consecutive nodes share a leaf, split as evenly as possible."""
        out: dict[str, str] = {}
        for i, node in enumerate(self.node_names):
            out[node] = self.leaf_names[i * self.leaves // self.nodes]
        return out

    @property
    def block_topology(self) -> bool:
        """TopologyPlugin=topology/block: each leaf is an NVLink domain (an NVL72 rack)."""
        return dict(self.slurm_overrides).get("TopologyPlugin") == "topology/block"

    def clique_of(self) -> dict[str, int]:
        """Node → the clique id of its NVLink domain (block mode: one per leaf)."""
        return {node: CLIQUE_BASE + self.leaf_names.index(leaf)
                for node, leaf in self.leaf_of().items()}

    @property
    def cluster_name(self) -> str:
        # Distinct per port base, so two sandboxes never share slurmctld state by accident.
        return f"sr{self.port_base}"

    @property
    def ctld_port(self) -> int:
        return self.port_base

    def slurmd_port(self, index: int) -> int:
        """Port of the 1-based ``index``-th node."""
        return self.port_base + index

    def agent_port(self, index: int) -> int:
        """Exchange port of the 1-based ``index``-th node's agent (all agents share 127.0.0.1)."""
        return self.port_base + AGENT_OFFSET + index

    def metrics_port(self, index: int) -> int:
        """Port of the 1-based ``index``-th node's agent's /metrics (on 127.0.0.1)."""
        return self.port_base + METRICS_OFFSET + index

    def metrics_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.metrics_port(index)}/metrics"

    @property
    def s3_port(self) -> int:
        return self.port_base + S3_OFFSET

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    # -- paths -------------------------------------------------------------------------------

    @property
    def etc(self) -> Path:
        return self.state_dir / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def topology_conf(self) -> Path:
        return self.etc / "topology.conf"

    @property
    def resilience_conf(self) -> Path:
        return self.etc / "slurm-resilience.yaml"

    @property
    def s3_keys_file(self) -> Path:
        return self.etc / "s3-keys"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def munge_dir(self) -> Path:
        return self.state_dir / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket.2"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def ctld_state_dir(self) -> Path:
        return self.state_dir / "ctld"

    @property
    def s3_dir(self) -> Path:
        return self.state_dir / "s3"

    @property
    def nodes_dir(self) -> Path:
        return self.state_dir / "nodes"

    def node_dir(self, node: str) -> Path:
        return self.nodes_dir / node

    def pid_file(self, daemon: str) -> Path:
        """Pid file of one daemon, e.g. ``slurmctld``, ``slurmd-node1``, ``munged``."""
        return self.run_dir / f"{daemon}.pid"

    @property
    def healthcheck_wrapper(self) -> Path:
        return self.etc / "healthcheck"

    def hook(self, name: str) -> Path:
        return self.repo / "hooks" / name
