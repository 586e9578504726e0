"""glibc's allocator, tuned for tensors (``fedlora`` and the test suite call
:func:`tune_malloc` first).

By default glibc serves an allocation above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) with a fresh ``mmap`` and returns it to the kernel on ``free``; a
training step allocates and frees activations and per-sample gradients of many MiB each,
so every step pays the kernel's page faults and zeroing again. With the thresholds at
1 GiB, freed blocks stay in the process's heap and the next step reuses them. The
arithmetic is unchanged (torch aligns its CPU tensors to 64 bytes either way); the cost is
a resident size that stays at the peak. ``benchmarks/perf/malloc.py`` measures the ratio.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: bytes: allocations below stay in the heap; free memory above it at the heap's top is
#: not returned to the kernel (an int: mallopt takes a C int)
THRESHOLD = 1 << 30
#: the environment variables glibc reads at a process's start (Ray workers, subprocesses)
ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def tune_malloc(environ=os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds to :data:`THRESHOLD` in this process
    (``mallopt``) and in the environment its children inherit; a threshold the user set
    in the environment is left as it is. Returns whether this process's allocator took
    the thresholds it was given (False off glibc)."""
    todo = [
        (k, opt) for k, opt in zip(ENV, (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)) if k not in environ
    ]
    for k, _ in todo:
        environ[k] = str(THRESHOLD)
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([mallopt(opt, THRESHOLD) == 1 for _, opt in todo])
