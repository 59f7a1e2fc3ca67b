"""The static runner's KV cache: one preallocated tensor with a slot per stream, its growth, keeping the
accepted rows after a verify, and the check that it fits in the device's memory.

Layout: ``kv [layers, 2, slots, kv_heads, max_len, head_dim]`` (2 = keys, values). A row owns one slot
(``SlotCache``); its committed prefix lives in positions ``[0, length)``; a verify writes the tree's keys and
values after it and ``keep_rows`` / ``keep_rows_batch`` move the accepted path's rows down in place.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

MAX_SLOTS = 256  # KV-cache slots one runner holds at most (streams in flight)


def lazy_zeros(shape: Sequence[int], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A zero tensor whose CPU pages become resident only when written: ``calloc`` (through numpy) gives a large
    block as fresh zero pages from the kernel, where ``torch.zeros`` writes every byte, and the block is advised
    ``MADV_NOHUGEPAGE`` (numpy advises huge pages for large arrays: one 2 MB page would make ~4 of SmolLM2's
    442 KB per-slot runs resident at the first write into one). A KV cache with room for more streams than a
    worker runs then costs only the slots it uses (SmolLM2: 24 MB per slot at its 528-position start; an actor
    reserving 6 slots and running 1 kept all 6 resident). Other devices: ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    n = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(n, dtype=np.uint8)
    _no_huge_pages(raw.ctypes.data, n)
    return torch.from_numpy(raw).view(dtype).view(tuple(shape))


def _no_huge_pages(addr: int, n: int) -> None:
    """``madvise(MADV_NOHUGEPAGE)`` over the whole pages of ``[addr, addr + n)``; nothing where it cannot."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = (addr + page - 1) // page * page
    end = (addr + n) // page * page
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), getattr(mmap, "MADV_NOHUGEPAGE", 15))
    except (OSError, AttributeError):
        pass


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``, every arena); True where it
    ran (~10 µs when there is nothing to give back).

    The warm-up, the cost curve and each prompt forward allocate and free tens of MB of activations; glibc keeps
    freed pages mapped, so a worker's resident memory would stay at that peak (SmolLM2 as stored: ~40 MB more,
    measured with benchmarks/memory.py). Called by the engine after its warm-up and by the static runner after
    each CPU prefill. No-op elsewhere (not Linux, or a C library without ``malloc_trim``).
    """
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` from the process's own symbols, looked up once (no library search: find_library
    would run ldconfig; a ``ctypes.CDLL`` made per call costs ~0.1 ms, a class per instance); None where absent."""
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory the KV cache may still take on ``device``: CUDA ``torch.cuda.mem_get_info``'s free bytes; on
    the CPU ``MemAvailable`` of /proc/meminfo; None where neither can be read (no check then)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class SlotCache:
    """A row's handle on one slot of the static KV cache: ``length`` committed rows in ``[0, length)``."""

    def __init__(self, pool: "KVCache", slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self.length = 0
        self.released = False

    def release(self) -> None:
        """Give the slot back (idempotent: a second call does nothing)."""
        if not self.released:
            self.released = True
            self.pool.free_slots.append(self.slot)
            self.pool.live.pop(self.slot, None)


class KVCache:
    """The slots of the static KV cache, sized on demand.

    Args:
        shape: ``(layers, kv_heads, head_dim)``.
        dtype, device: of the cache.
        context_length: the model's context; a slot never grows past it plus ``pad``.
        pad: tree rows a verify may write past a committed prefix (the runner's largest tree bucket; the runner
            raises it with its buckets).
        slots, max_slots: slots at start; the most ``take`` grows to.
        start_len: positions per slot at start.
        kernels: our CPU kernels (``torch.ops.racer``) or None: ``keep_rows_batch`` moves rows with their
            ``keep_rows_`` (one call, plain row copies) where set and the cache is on the CPU, else with torch
            indexing (a gather and a scatter).

    Raises:
        ValueError: the start allocation does not fit in the device's memory (``check_fits``).
    """

    def __init__(self, shape: tuple[int, int, int], *, dtype: torch.dtype, device: torch.device,
                 context_length: int, pad: int, slots: int, max_slots: int, start_len: int,
                 kernels: Any = None) -> None:
        self.n_layers, self.n_kv, self.head_dim = shape
        self.dtype, self.device = dtype, device
        self.kernels = kernels if device.type == "cpu" else None
        self.context_length = int(context_length)
        self.pad = int(pad)
        self.slots = int(slots)
        self.max_slots = int(max_slots)
        self.free_slots = list(range(self.slots))[::-1]
        self.live: dict[int, SlotCache] = {}  # slot -> the row's handle, while taken
        self.max_len = 0
        self.kv = torch.empty(0, dtype=dtype, device=device)
        self._view: Optional[np.ndarray] = None  # host_view's array and the tensor it views
        self._view_of: Optional[torch.Tensor] = None
        self.grow(start_len)

    # ---- size and memory
    def fresh(self) -> bool:
        """On the CPU with no slot taken, replace the buffer by untouched zeros (``lazy_zeros``): the pages a
        warm-up or cost curve wrote in every slot stop counting in the process's memory until a row writes them
        again. True when it did."""
        if self.device.type != "cpu" or self.live or not self.max_len:
            return False
        self.kv = lazy_zeros(tuple(self.kv.shape), self.dtype, self.device)
        return True

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one slot takes: layers x 2 x kv_heads x head_dim x dtype bytes."""
        return self.n_layers * 2 * self.n_kv * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_token * self.max_len

    @property
    def bound(self) -> int:
        """The most positions a slot grows to: the context plus one largest tree of padding."""
        return self.context_length + self.pad

    def check_fits(self, slots: int, positions: int) -> None:
        """Raise ``ValueError`` when a cache of ``slots`` x ``positions`` does not fit in the memory the device
        has free now (``available_bytes``; the old buffer is still held while a larger one is filled, so
        the new one must fit beside it).

        Raises:
            ValueError: naming the bytes needed and available and the settings that lower them.
        """
        need = slots * positions * self.bytes_per_token
        have = available_bytes(self.device)
        if have is None or need <= have:
            return
        raise ValueError(
            f"the static KV cache needs {need:,} bytes ({need / 2**30:.2f} GiB: {slots} streams x {positions:,} "
            f"positions x {self.bytes_per_token:,} bytes) but {self.device.type} memory has {have:,} bytes "
            f"({have / 2**30:.2f} GiB) available; lower resources.streams_per_actor (rows decoded at once) or the "
            f"context a row needs (prompt + max_new_tokens)")

    def warn_if_bound_does_not_fit(self) -> None:
        """Log how far the slots can grow when their growth bound (context + largest tree) does not fit."""
        have = available_bytes(self.device)
        need = self.slots * self.bound * self.bytes_per_token
        if have is not None and need > have:
            fit = have // (self.slots * self.bytes_per_token)
            log.warning("static KV cache: %d streams at the full context (%d positions each) would need %.2f GiB, "
                        "%.2f GiB available: rows that need more than ~%d positions each will be refused",
                        self.slots, self.bound, need / 2**30, have / 2**30, fit)

    # ---- slots
    @torch.inference_mode()
    def grow(self, need: int) -> bool:
        """Make every slot hold at least ``need`` positions (at least doubling, never past ``bound``), copying
        what is cached; True when the buffer was reallocated.

        Raises:
            ValueError: the larger buffer does not fit in memory (``check_fits``).
        """
        need = min(int(need), self.bound)
        if need <= self.max_len:
            return False
        new_len = max(need, min(2 * self.max_len, self.bound))
        self.check_fits(self.slots, new_len)
        kv = lazy_zeros((self.n_layers, 2, self.slots, self.n_kv, new_len, self.head_dim), self.dtype, self.device)
        if self.max_len:
            kv[:, :, :, :, : self.max_len].copy_(self.kv)
        self.kv, self.max_len = kv, new_len
        log.debug("static KV cache: %d slots x %d positions (%.1f MB per slot)", self.slots, new_len,
                  self.bytes_per_slot / 1e6)
        return True

    @torch.inference_mode()
    def reserve(self, n: int) -> bool:
        """Hold at least ``n`` slots, copying what is cached; True when the buffer was reallocated.

        Raises:
            ValueError: more than ``max_slots``, or the cache does not fit in memory (``check_fits``).
        """
        n = int(n)
        if n <= self.slots:
            return False
        if n > self.max_slots:
            raise ValueError(f"{n} KV-cache slots asked for, this runner holds at most {self.max_slots}")
        self.check_fits(n, self.max_len)
        kv = lazy_zeros((self.n_layers, 2, n, self.n_kv, self.max_len, self.head_dim), self.dtype, self.device)
        kv[:, :, : self.slots].copy_(self.kv)
        self.kv = kv
        self.free_slots = list(range(n - 1, self.slots - 1, -1)) + self.free_slots
        self.slots = n
        log.debug("static KV cache: %d slots x %d positions", n, self.max_len)
        self.warn_if_bound_does_not_fit()
        return True

    def take(self) -> SlotCache:
        """The lowest free slot (streams stay in ``[0, B)``, the range the captured batch steps cover), one
        more slot added when every slot is taken.

        Raises:
            RuntimeError: ``max_slots`` slots are taken (rows that never released theirs).
        """
        if not self.free_slots:
            if self.slots >= self.max_slots:
                raise RuntimeError(f"all {self.slots} KV-cache slots are in use")
            self.reserve(self.slots + 1)
        slot = min(self.free_slots)
        self.free_slots.remove(slot)
        cache = SlotCache(self, slot)
        self.live[slot] = cache
        return cache

    def length_of(self, slot: int) -> int:
        """Committed rows of ``slot`` (0 when free)."""
        cache = self.live.get(slot)
        return cache.length if cache is not None else 0

    @torch.inference_mode()
    def save_rows(self, slots: Sequence[int], starts: Sequence[int], n: int) -> Optional[tuple[torch.Tensor, ...]]:
        """A copy of positions ``[starts[i], starts[i] + n)`` of each of ``slots`` (all layers, keys and values),
        for ``restore_rows``; None for no slots."""
        if not len(slots):
            return None
        slot = torch.tensor(np.repeat(np.asarray(slots, dtype=np.int64), n), device=self.device)
        pos = torch.tensor((np.asarray(starts, dtype=np.int64)[:, None] + np.arange(n)).reshape(-1), device=self.device)
        return slot, pos, self.kv[:, :, slot, :, pos]

    @torch.inference_mode()
    def restore_rows(self, saved: Optional[tuple[torch.Tensor, ...]]) -> None:
        """Write back what ``save_rows`` copied."""
        if saved is not None:
            slot, pos, values = saved
            self.kv[:, :, slot, :, pos] = values

    # ---- keeping the accepted rows
    def host_view(self) -> Optional[np.ndarray]:
        """The cache's memory as a numpy array ``[L, 2, S, H, P, D']`` (float32 as it is; any other dtype as bytes,
        ``D' = D x`` its size), for the native commit that keeps the accepted rows in the same call
        (``drafters.native.commit_greedy_batch``'s ``kv``); None off the CPU. Made once per buffer (``grow``,
        ``reserve`` and ``fresh`` replace it)."""
        if self.device.type != "cpu":
            return None
        if self._view_of is not self.kv:
            self._view = (self.kv if self.kv.dtype == torch.float32 else self.kv.view(torch.uint8)).numpy()
            self._view_of = self.kv
        return self._view

    @torch.inference_mode()
    def keep_rows(self, cache: SlotCache, *, committed_len: int, nodes: Sequence[int]) -> None:
        """Keep the accepted tree ``nodes`` (local indices, root first, ascending): row ``committed_len +
        nodes[i]`` moves to ``committed_len + i`` in place; the cache then holds ``committed_len + len(nodes)``."""
        nodes = np.asarray(nodes, dtype=np.int64)
        self.keep_rows_batch([cache], np.array([committed_len]), nodes, np.array([0, nodes.shape[0]]))

    def keep_rows_batch(self, caches: Sequence[SlotCache], starts: np.ndarray, paths: np.ndarray,
                        cu_paths: np.ndarray, *, moved: Optional[np.ndarray] = None) -> None:
        """``keep_rows`` of every stream in one call: stream ``b`` keeps ``paths[cu_paths[b] : cu_paths[b + 1]]``
        after its ``starts[b]`` committed rows. Every moved row of every stream (node ``!= i``) goes in one gather
        and one scatter over all layers, keys and values; the gather reads every source before any row is
        written, as ascending copies one by one would (a source ``node >= i`` is never an earlier destination).

        ``moved``: those rows already listed, ``[M, 3]`` int64 (stream, source node, destination index along
        its path; ``drafters.native.Commit.moved``), so they are not derived from ``paths`` here."""
        if len(paths) == len(caches):  # every stream kept its root alone (AR, or no draft node accepted)
            for cache, start in zip(caches, np.asarray(starts).tolist()):
                cache.length = start + 1
            return
        starts = np.asarray(starts, dtype=np.int64)
        cu = np.asarray(cu_paths, dtype=np.int64)
        if moved is None:
            paths = np.asarray(paths, dtype=np.int64)
            lengths = np.diff(cu)
            idx = np.arange(paths.shape[0], dtype=np.int64) - np.repeat(cu[:-1], lengths)  # i along each path
            keep = paths != idx
            moved = np.stack([np.repeat(np.arange(len(caches)), lengths)[keep], paths[keep], idx[keep]], 1)
        if len(moved):
            stream = moved[:, 0]
            base = starts[stream]
            slot = torch.from_numpy(np.fromiter((caches[s].slot for s in stream.tolist()), np.int64, len(stream)))
            src = torch.from_numpy(base + moved[:, 1])
            dst = torch.from_numpy(base + moved[:, 2])
            if self.device.type != "cpu":  # a no-op .to() still costs ~1 us each on the CPU
                slot, src, dst = slot.to(self.device), src.to(self.device), dst.to(self.device)
            self._move_rows(slot, src, dst)
        cu_l = cu.tolist()  # plain ints: np.diff costs ~5 us per call, more after a cold forward
        for i, (cache, start) in enumerate(zip(caches, starts.tolist())):
            cache.length = start + cu_l[i + 1] - cu_l[i]

    @torch.inference_mode()
    def _move_rows(self, slot: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row ``src[i]`` of slot ``slot[i]`` to row ``dst[i]``, every layer, keys and values (``[M]`` int64 each).
        Only this part runs under inference mode (the cache is an inference tensor): a step that moves no row
        does not pay for entering it."""
        if self.kernels is not None:
            self.kernels.keep_rows_(self.kv, slot, src, dst)
        else:
            self.kv[:, :, slot, :, dst] = self.kv[:, :, slot, :, src]
