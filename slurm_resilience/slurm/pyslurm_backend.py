"""Optional pyslurm backend: reads nodes and jobs through libslurm, writes through the CLI.

PyPI only offers pyslurm 25.11, which does not build against Debian's Slurm 22.05;
sites with a matching pyslurm build can select ``slurm.backend: pyslurm``. Every
write (drain, resume, requeue) still goes through the CLI path, so the
ownership rules of :class:`SlurmAdapter` apply unchanged.
"""

from __future__ import annotations

from typing import Any

from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import NodeNotFound, SlurmError
from slurm_resilience.slurm.parse import NodeInfo


def _import_pyslurm() -> Any:
    try:
        import pyslurm
    except ImportError as exc:
        raise SlurmError(
            "load pyslurm",
            f"slurm.backend is 'pyslurm' but pyslurm cannot be imported ({exc}); "
            "install a pyslurm built for your Slurm version or set slurm.backend: cli",
        ) from exc
    return pyslurm


class PySlurmAdapter(SlurmAdapter):
    """:class:`SlurmAdapter` whose node reads come from pyslurm (23.02+ API)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.pyslurm = _import_pyslurm()

    def show_node(self, name: str) -> NodeInfo:
        try:
            node = self.pyslurm.Node.load(name)
        except Exception as exc:
            raise NodeNotFound("show node", str(exc)) from exc
        state = str(getattr(node, "state", "")).upper()
        parts = state.replace("+", " ").split()
        return NodeInfo(
            name=str(node.name),
            state=parts[0] if parts else "",
            flags=frozenset(parts[1:]),
            reason=str(getattr(node, "reason", "") or ""),
            reason_user=str(getattr(node, "reason_user", "") or ""),
            features=tuple(getattr(node, "available_features", ()) or ()),
            active_features=tuple(getattr(node, "active_features", ()) or ()),
            partitions=tuple(getattr(node, "partitions", ()) or ()),
            cpus=int(getattr(node, "total_cpus", 0) or 0),
            alloc_cpus=int(getattr(node, "allocated_cpus", 0) or 0),
        )
