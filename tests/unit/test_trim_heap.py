"""engine.trim_heap: a worker gives freed C-heap pages back after its warm-up (issue 31, "Memory")."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from racer_batch.engine.engine import trim_heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trim_heap_gives_freed_pages_below_a_live_block_back():
    """Heap blocks freed below one still in use stay resident (free() trims only the heap's top) until
    trim_heap returns their pages."""
    import psutil

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 32 << 10, 3000  # 96 MB in blocks under glibc's mmap threshold: they come from the heap
    blocks = [libc.malloc(size) for _ in range(count)]
    pin = libc.malloc(size)  # above them: the heap's top cannot shrink past it
    for b in blocks:
        ctypes.memset(b, 1, size)
    ctypes.memset(pin, 1, size)
    for b in blocks:
        libc.free(b)
    before = psutil.Process().memory_info().rss
    try:
        assert trim_heap() is True
        after = psutil.Process().memory_info().rss
    finally:
        libc.free(pin)
    assert before - after > 50e6, (before, after)
