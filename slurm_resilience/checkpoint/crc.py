"""CRC32C primitives for checkpoint files: ISA-L's (isal package) where installed, else
google-crc32c's, both hardware-accelerated; ``IMPLEMENTATION`` names the one in use."""

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


_ISAL_MAX = 1 << 30  # ISA-L takes an int length: longer buffers go in pieces


def _load_isal() -> Any:
    """ISA-L's CRC32C (``crc32_iscsi``), from the library the isal package builds into its
    zlib module, as ``extend(crc, address, length)``; None where it is missing or gives
    another answer than google-crc32c on a test vector (then google-crc32c is used).

    ISA-L folds with carry-less multiplies (AVX-512 VPCLMULQDQ where the CPU has it):
    2-3x google-crc32c's speed, which matters where every restored byte is checked.
    """
    import ctypes
    import glob
    import importlib.util

    spec = importlib.util.find_spec("isal")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = [p for d in spec.submodule_search_locations
            for p in glob.glob(os.path.join(d, "isal_zlib*.so"))]
    try:
        fn = ctypes.CDLL(libs[0]).crc32_iscsi if libs else None
    except (OSError, AttributeError):
        return None
    if fn is None:
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]

    def extend(crc: int, address: int, length: int) -> int:
        crc ^= 0xFFFFFFFF  # ISA-L's iSCSI CRC takes and gives the inverted register
        for at in range(0, length, _ISAL_MAX):
            crc = int(fn(address + at, min(_ISAL_MAX, length - at), crc))
        return crc ^ 0xFFFFFFFF

    probe = bytes(range(256)) * 37 + b"slurm-resilience"
    buf = ctypes.create_string_buffer(probe, len(probe))
    ok = all(extend(seed, ctypes.addressof(buf) + 3, len(probe) - 3)
             == google_crc32c.extend(seed, probe[3:]) for seed in (0, 0x1234ABCD))
    return extend if ok else None


def _pick() -> tuple[Any, str]:
    """The fastest CRC32C at hand as ``extend(crc, address, length)``, and its name."""
    isal = _load_isal()
    if isal is not None:
        return isal, "isa-l"
    native = _load_native()
    if native is not None:
        return (lambda crc, address, length: int(native(crc, address, length)),
                "google-crc32c (its C library)")
    return None, f"google-crc32c ({google_crc32c.implementation}, through copies)"


_FAST_EXTEND, IMPLEMENTATION = _pick()


def address_of(view: memoryview) -> int:
    """The address of a writable, contiguous byte view's first byte (no copy)."""
    import ctypes

    if not len(view):
        return 0
    return ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))


def crc32c_at(crc: int, address: int, length: int) -> int:
    """Extend a CRC32C with ``length`` bytes at ``address`` (memory the caller keeps alive);
    the cheapest call per block where a restore checks thousands of them."""
    if _FAST_EXTEND is not None:
        return int(_FAST_EXTEND(crc, address, length))
    import ctypes

    return int(google_crc32c.extend(crc, ctypes.string_at(address, length)))


def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """Extend a CRC32C with ``data`` without copying it."""
    if isinstance(data, bytes):
        if _FAST_EXTEND is not None and len(data) >= 4096:
            import ctypes

            address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
            return int(_FAST_EXTEND(crc, address, len(data)))  # no copy: points into data
        return int(google_crc32c.extend(crc, data))
    view = memoryview(data).cast("B")
    if _FAST_EXTEND is not None and view.contiguous and len(view):
        import ctypes

        if view.readonly:  # a read-only mapping of a file: numpy tells its address
            import numpy as np

            return int(_FAST_EXTEND(crc, np.frombuffer(view, np.uint8).ctypes.data,
                                    len(view)))
        buf = (ctypes.c_char * len(view)).from_buffer(view)
        return int(_FAST_EXTEND(crc, ctypes.addressof(buf), len(view)))
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
