"""Process settings for long CPU runs: glibc's malloc keeps the memory a step frees, for the next.

A training step frees and allocates the same tens of megabytes every step: activations, their
gradients, dropout noise. glibc's malloc hands large freed blocks back to the system (a block above
its mmap threshold is unmapped; free memory at the top of the heap above the trim threshold is
trimmed), so the next step writes into fresh pages that the kernel must fault in and zero: tens of
megabytes of page faults in every step of the ``train`` model (benchmarks/README.md).

:func:`keep_freed_memory` sets both thresholds once: the mmap threshold to its largest value
(32 MiB on 64-bit systems), the trim threshold to 2 GiB. This is what ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` in the environment do, and what jemalloc or tcmalloc do by design
(the tuning guides for PyTorch on CPUs preload one of them). The process's resident size then stays
near its peak between steps instead of shrinking and growing back.

It changes the whole process, so the library never calls it on import: the ``attnlab train`` and
``attnlab bench`` commands call it, as a program that owns its process may.

:func:`release_freed_memory` does the opposite, once: it hands the heap's free pages back to the
system (``malloc_trim``). :func:`attnlab.run.loaded.open_run` calls it after loading a run, whose
tokenizer parse (a pretrained vocabulary and its merges) frees some 15 MB of short-lived blocks
that sit between live ones, where no threshold returns them; ``attnlab generate`` would otherwise
carry them through its whole run (benchmarks/README.md). It changes no setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["keep_freed_memory", "map_allocations_from", "release_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks up to this size come from the heap (glibc's largest allowed value on 64-bit systems)."""

TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the top of the heap is returned to the system only above this (2 GiB)."""


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse. Returns whether it took both settings
    (False where the C library is not glibc, which has no such thresholds)."""
    return _mallopt((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def map_allocations_from(size: int) -> bool:
    """Ask glibc's malloc to map every block of ``size`` bytes or more on its own, so that freeing
    it returns it to the system at once (what a measurement of peak memory wants; the opposite of
    :func:`keep_freed_memory`). Returns whether it took the setting (False off glibc)."""
    return _mallopt((_M_MMAP_THRESHOLD, size))


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt`` for each (parameter, value) in turn; whether every one took."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


def release_freed_memory() -> bool:
    """Return the free pages of glibc's heap to the system (``malloc_trim(0)``). Returns whether
    it ran (False where the C library is not glibc)."""
    if not _glibc():
        return False
    trim = ctypes.CDLL(None).malloc_trim  # the process's own C library: no search for it
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def _glibc() -> bool:
    """Whether this process runs on glibc (``confstr``: no read of the interpreter's binary)."""
    try:
        return platform.system() == "Linux" and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):
        return False
