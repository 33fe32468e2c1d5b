"""Keep the memory torch frees on the CPU in the process, for its next batch to reuse.

glibc's malloc serves each block over its mmap threshold (128 KiB, rising to at most 32 MiB) with fresh pages
from the kernel and hands them back on free, and trims freed heap over 128 KiB back too. A convolution's
activations are such blocks, so every forward pass faults all of its memory in again, page by page: on this
project's 2-core machine more CPU time went to those page faults than to the arithmetic
(`bench/results/cpu_memory.md`). PyTorch's CPU tuning guide cures the same thing by preloading jemalloc or
tcmalloc; `mallopt` (glibc's own switch, `man 3 mallopt`) does it in-process, with nothing to install:
M_MMAP_MAX 0 serves large blocks from the heap, and M_TRIM_THRESHOLD keeps up to `TRIM_BYTES` of freed heap.
The cost: a process keeps its peak memory (up to `TRIM_BYTES` more) after the peak instead of returning it.
So it is switched on where torch builds a model to compute with (`models.networks.backbone.FaceEmbedder`,
`models.networks.torch_teacher.TorchTeacher`), never in the edge daemon, which holds no torch.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
TRIM_BYTES = 1 << 30  # measured: 64 and 256 MiB kept only part of the gain for a batch of 64 faces
OFF_ENV = "FFR_REUSE_FREED_MEMORY"  # "0": leave glibc's defaults (a device that must give memory back after a peak)


@functools.cache
def reuse_freed_memory() -> bool:
    """Switch glibc's malloc to keep freed blocks for reuse (once per process); False where the C library is not
    glibc (macOS, musl), whose allocators need nothing or offer no such switch, or where $FFR_REUSE_FREED_MEMORY
    is 0."""
    if os.environ.get(OFF_ENV) == "0" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    except (OSError, AttributeError):
        return False
