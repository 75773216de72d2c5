"""Giving the heap's freed memory back to the system, now and then (glibc only).

glibc keeps memory that tensors of changing sizes freed (the catch-up's chunks, the memory
update's candidate passes) in its arenas instead of returning it, so a worker catching up grows
its resident memory for minutes without leaking anything. `malloc_trim` returns it; the worker
calls `HeapTrimmer.maybe_trim` between steps (a clock comparison, and a trim every `every_s`,
ASER_HEAP_TRIM_EVERY_S).

>>> trimmer = HeapTrimmer(every_s=0.0)
>>> trimmer.maybe_trim() == trimmer.available
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

TRIM_EVERY_S = 30.0


class HeapTrimmer:
    def __init__(self, every_s: float = TRIM_EVERY_S):
        self.every_s = every_s
        self._trim = _malloc_trim()
        self._next = time.monotonic() + every_s

    @property
    def available(self) -> bool:
        """Whether this C library has `malloc_trim` (glibc); elsewhere trimming does nothing."""
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if `every_s` has passed since the last time; returns whether it trimmed."""
        now = time.monotonic()
        if self._trim is None or now < self._next:
            return False
        self._next = now + self.every_s
        self._trim(0)
        return True


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
