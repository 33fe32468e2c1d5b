"""Freed memory handed back to the operating system after a device's round.

A round's training allocates a few hundred MB (activations, optimiser state, the DFC fit's features) that glibc
keeps in its heap after they are freed: an idle daemon would hold its last round's peak, and a fleet worker that
runs many devices' turns would grow by a turn's worth each time (the README gives the measurements).
"""
from __future__ import annotations

import ctypes
import gc


def release_memory() -> bool:
    """Collect reference cycles (paho's callbacks hold a device, so its crops and model wait for a full collection
    that large arrays alone never trigger), then return the heap's free pages to the OS (glibc's `malloc_trim`).
    False where the C library has no `malloc_trim` (not glibc): the collection alone still frees the arrays."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
