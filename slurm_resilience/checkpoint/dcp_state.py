"""State dicts on their way into DCP: checked up front, then snapshotted into reused buffers.

``check_state`` walks a state dict the way DCP flattens it (nested mappings and lists
of tensors, keys joined by '.') and refuses, with the key and the type, anything DCP
would crash on, save wrongly, or save under a name another key also gets.
``Snapshot`` copies the tensors (a DTensor's local shard) into host buffers that are
reused from one save to the next, so async saves hold at most one extra copy.
"""

from __future__ import annotations

import copy
import ctypes
import pickle
from collections.abc import Mapping
from typing import Any

from slurm_resilience.checkpoint.commit import CheckpointError

Path = tuple[Any, ...]
_PLAIN = (int, float, bool, str, bytes, type(None))


def _fmt(path: Path) -> str:
    return "".join(f"[{k!r}]" for k in path)


def is_dtensor(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def _tensor_problem(t: Any) -> str | None:
    """Why DCP through our writer can't save this tensor, or None."""
    import torch

    if is_dtensor(t):
        return _tensor_problem(t.to_local())
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"a tensor subclass ({type(t).__module__}.{type(t).__qualname__})"
    if t.layout != torch.strided:
        return f"a {t.layout} tensor (only dense, strided tensors are saved)"
    if t.is_quantized:
        return "a quantized tensor"
    if t.device.type == "meta":
        return "a meta tensor (it holds no data)"
    if t.is_nested:
        return "a nested tensor"
    return None


def _keep_traversing(value: Any) -> bool:
    """DCP traverses a list only when it holds tensors or mappings somewhere inside."""
    import torch

    if isinstance(value, Mapping):
        return True
    if isinstance(value, list):
        return any(_keep_traversing(v) for v in value)
    return isinstance(value, torch.Tensor)


def resolve_stateful(state: Mapping[Any, Any]) -> dict[Any, Any]:
    """Top-level Stateful values (``state_dict``/``load_state_dict``, as DCP and torchtitan
    use them) replaced by their ``state_dict()``; other values as they are."""
    return {k: v.state_dict() if _is_stateful(v) else v for k, v in state.items()}


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def check_state(state: Mapping[Any, Any], what: str = "save") -> None:
    """Raise a CheckpointError naming the key if ``state`` can't be saved exactly."""
    import torch

    if not isinstance(state, Mapping):
        raise CheckpointError(f"checkpoint: {what}: the state must be a mapping, not "
                              f"{type(state).__name__}")
    names: dict[str, Path] = {}

    def leaf(path: Path, value: Any) -> None:
        name = ".".join(str(k) for k in path)
        if name in names:
            raise CheckpointError(
                f"checkpoint: {what}: keys {_fmt(names[name])} and {_fmt(path)} would both be "
                f"stored as {name!r} (DCP joins nested keys with '.'); rename one")
        names[name] = path
        if isinstance(value, torch.Tensor):
            problem = _tensor_problem(value)
            if problem:
                raise CheckpointError(f"checkpoint: {what}: couldn't save key {_fmt(path)}: "
                                      f"{problem}")
            return
        if isinstance(value, _PLAIN):
            return
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means "can't save"
            raise CheckpointError(
                f"checkpoint: {what}: couldn't save key {_fmt(path)} of type "
                f"{type(value).__module__}.{type(value).__qualname__}: {exc}") from None

    def walk(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise CheckpointError(
                        f"checkpoint: {what}: key {k!r} under {_fmt(path) or 'the top level'} "
                        f"is a {type(k).__name__}; keys must be str or int")
                walk((*path, k), v)
        elif isinstance(value, list) and _keep_traversing(value):
            for i, v in enumerate(value):
                walk((*path, i), v)
        else:
            leaf(path, value)

    walk((), state)


def tensor_view(t: Any, what: str) -> memoryview:
    """A writable byte view of a dense, contiguous CPU tensor (no copy)."""
    import torch

    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu"
            or t.layout != torch.strided or t.is_quantized or not t.is_contiguous()):
        raise CheckpointError(f"checkpoint: {what}: not a dense contiguous CPU tensor "
                              f"({type(t).__name__}, {t.device}, {t.layout})")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    ptr = t.data_ptr()
    if not ptr:
        raise CheckpointError(f"checkpoint: {what}: tensor has no storage (data_ptr 0)")
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


class Snapshot:
    """Copies of a state dict's tensors in host buffers reused between saves.

    Memory: one buffer per tensor (a DTensor's local shard), i.e. one extra copy of
    this rank's state, kept between saves so the next snapshot faults no pages in.
    ``release()`` frees them. Buffers are keyed by the exact key path, so keys that
    print alike (0 and "0") never share one.
    """

    def __init__(self) -> None:
        self.buffers: dict[Path, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def release(self) -> None:
        self.buffers = {}

    def take(self, state: Mapping[Any, Any]) -> dict[Any, Any]:
        used: dict[Path, Any] = {}
        out = self._take((), state, used)
        self.buffers = used  # buffers of keys gone since the last save are freed
        if any(b.is_pinned() for b in used.values()):
            import torch

            torch.cuda.synchronize()
        assert isinstance(out, dict)
        return out

    def _copy(self, path: Path, t: Any, used: dict[Path, Any]) -> Any:
        import torch

        t = t.detach()
        buf = self.buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        buf.copy_(t, non_blocking=t.is_cuda)
        used[path] = buf
        return buf

    def _take(self, path: Path, obj: Any, used: dict[Path, Any]) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            from torch.distributed.tensor import DTensor

            if isinstance(obj, DTensor):
                local = self._copy(path, obj.to_local(), used)
                return DTensor.from_local(local, obj.device_mesh, obj.placements,
                                          run_check=False, shape=obj.shape,
                                          stride=obj.stride())
            return self._copy(path, obj, used)
        if isinstance(obj, Mapping):
            return {k: self._take((*path, k), v, used) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._take((*path, i), v, used) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)
