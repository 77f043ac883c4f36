"""CRC32C primitives for checkpoint files (hardware-accelerated through google-crc32c)."""

from __future__ import annotations

import os
from typing import Any

import google_crc32c

_CHUNK = 8 * 1024 * 1024


def crc_hex(value: int) -> str:
    return f"{value:08x}"


def _load_native() -> Any:
    """The crc32c library google-crc32c ships, called through ctypes for writable buffers.

    The extension module only accepts read-only buffers (``bytes``); torch.save hands
    us writable memoryviews of tensor storage, and copying them would double the cost.
    """
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(google_crc32c.__file__)),
                                  "google_crc32c.libs", "libcrc32c*.so*"))
    if not libs:
        return None
    try:
        lib = ctypes.CDLL(libs[0])
        fn = lib.crc32c_extend
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_NATIVE_EXTEND = _load_native()


def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """Extend a CRC32C with ``data`` without copying it."""
    if isinstance(data, bytes):
        return int(google_crc32c.extend(crc, data))
    view = memoryview(data).cast("B")
    if _NATIVE_EXTEND is not None and view.contiguous and len(view):
        import ctypes

        if view.readonly:  # a read-only mapping of a file: numpy tells its address
            import numpy as np

            return int(_NATIVE_EXTEND(crc, np.frombuffer(view, np.uint8).ctypes.data,
                                      len(view)))
        buf = (ctypes.c_char * len(view)).from_buffer(view)
        return int(_NATIVE_EXTEND(crc, ctypes.addressof(buf), len(view)))
    return int(google_crc32c.extend(crc, bytes(view)))


class Crc32c:
    """Streaming CRC32C (hardware-accelerated through google-crc32c's C library)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.value = crc32c_extend(self.value, data)

    def hexdigest(self) -> str:
        return crc_hex(self.value)


def file_crc32c(fd_or_path: int | str | os.PathLike[str]) -> tuple[int, str]:
    """(size, crc32c hex) of a file, read in large chunks."""
    crc = Crc32c()
    size = 0
    own = not isinstance(fd_or_path, int)
    fd = os.open(fd_or_path, os.O_RDONLY | os.O_NOFOLLOW) if own else int(fd_or_path)  # type: ignore[arg-type]
    try:
        offset = 0
        while True:
            chunk = os.pread(fd, _CHUNK, offset)
            if not chunk:
                break
            crc.update(chunk)
            size += len(chunk)
            offset += len(chunk)
    finally:
        if own:
            os.close(fd)
    return size, crc.hexdigest()
