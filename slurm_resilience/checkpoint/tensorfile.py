"""How ``save()`` lays a state dict out on disk: raw tensor bytes plus a small skeleton.

``tensors.bin`` holds every dense tensor's bytes back to back, written straight from
the snapshot buffers (no pickling, no copy); ``state.pt`` is a ``torch.save`` of the
state dict's structure with each tensor replaced by a reference into ``tensors.bin``.
Loading reads ``tensors.bin`` once into one buffer and returns views into it, and the
skeleton loads with ``weights_only=True``, so nothing from a checkpoint is unpickled
beyond torch's allow-list.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_resilience.checkpoint.commit import CheckpointError, ChecksummingWriter, FileEntry

SKELETON = "state.pt"
DATA = "tensors.bin"
REF_KEY = "__slurm_resilience_tensor__"
FORMAT = 1
ALIGN = 64


def _raw_view(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def write_state(directory: Path, state: Any) -> list[FileEntry]:
    """Write ``state`` (tensors already host-side snapshots) as skeleton + raw data."""
    import torch

    data = ChecksummingWriter(directory / DATA)
    index: list[list[Any]] = []

    def strip(obj: Any) -> Any:
        if (isinstance(obj, torch.Tensor) and obj.layout == torch.strided
                and not obj.is_quantized and obj.device.type == "cpu" and obj.is_contiguous()):
            pad = -data.size % ALIGN  # keeps every tensor viewable with its dtype on load
            if pad:
                data.write(bytes(pad))
            index.append([data.size, str(obj.dtype).removeprefix("torch."), list(obj.shape)])
            data.write(_raw_view(obj))
            return {REF_KEY: len(index) - 1}
        if isinstance(obj, Mapping):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [strip(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    try:
        skeleton = {"format": FORMAT, "tensors": index, "state": strip(state)}
    finally:
        data_entry = data.close(fsync=True)
    meta = ChecksummingWriter(directory / SKELETON)
    try:
        torch.save(skeleton, meta)  # type: ignore[arg-type]
    finally:
        meta_entry = meta.close(fsync=True)
    return [data_entry, meta_entry]


def read_state(directory: Path, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """Load what :func:`write_state` wrote; tensors are views into one buffer."""
    import torch

    skeleton = torch.load(directory / SKELETON, map_location="cpu", weights_only=weights_only)
    if not isinstance(skeleton, dict) or skeleton.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint: load: {directory / SKELETON} is not a "
                              f"format-{FORMAT} skeleton")
    size = os.path.getsize(directory / DATA)
    blob = torch.empty(size, dtype=torch.uint8)
    with open(directory / DATA, "rb", buffering=0) as fh:
        view = _raw_view(blob)
        got = 0
        while got < size:
            n = fh.readinto(view[got:])
            if not n:
                raise CheckpointError(f"checkpoint: load: {directory / DATA} is short")
            got += n
    tensors = []
    for offset, dtype_name, shape in skeleton["tensors"]:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"checkpoint: load: unknown dtype {dtype_name!r}")
        count = 1
        for dim in shape:
            count *= int(dim)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        t = blob[int(offset):int(offset) + nbytes].view(dtype).reshape(shape)
        tensors.append(t if map_location in (None, "cpu") else t.to(map_location))

    def fill(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {REF_KEY}:
                return tensors[int(obj[REF_KEY])]
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [fill(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    return fill(skeleton["state"])
