"""CUDA graphs of the static runner's padded verify step, one per ``(B_pad, N_pad)`` bucket.

A graph replays ``decode`` + the output layer (engine/decoder.py, on torch ops) over static input buffers:
token ids, positions and KV write positions ``[B_pad * N_pad]`` and the additive mask ``[B_pad, 1, N_pad,
max_len]``, the streams in slots ``[0, B_pad)``, attention over each whole slot (no shape depends on a
committed length). A step copies its inputs into the buffers and replays; the graphs share one memory pool.
They read the KV cache and the buffers they were captured with, so the runner drops them (``clear``) when the
cache is reallocated (more slots, longer slots) or the largest tree bucket grows; they are captured again on
first use.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .decoder import Rows


class CudaGraphs:
    """The captured ``(B_pad, N_pad)`` steps of one runner and their static input buffers.

    Args:
        device: the CUDA device.
        dtype: the mask's dtype (the model's).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool: Any = None
        self.buf: dict[str, torch.Tensor] = {}
        self.warmup_s: dict[int, float] = {}  # tree bucket -> seconds of capture

    def clear(self) -> None:
        """Drop every graph and buffer (the KV cache or the largest bucket changed)."""
        self.graphs.clear()
        self.buf = {}

    def _buffers(self, rows: int, max_len: int) -> dict[str, torch.Tensor]:
        if not self.buf:
            dev = self.device
            self.buf = {"ids": torch.zeros(rows, dtype=torch.long, device=dev),
                        "pos": torch.zeros(rows, dtype=torch.long, device=dev),
                        "write": torch.zeros(rows, dtype=torch.long, device=dev),
                        "mask": torch.zeros(rows * max_len, dtype=self.dtype, device=dev)}
        return self.buf

    def run(self, b_pad: int, n_pad: int, inputs: dict[str, torch.Tensor], *, capacity_rows: int, max_len: int,
            step: Callable[[Rows], torch.Tensor]) -> torch.Tensor:
        """Logits ``[b_pad * n_pad, V]`` of the padded batch ``inputs`` (CPU tensors ``ids``, ``pos``, ``write``
        ``[b_pad * n_pad]`` and ``mask [b_pad * n_pad, max_len]``): copied into the static buffers (sized for
        ``capacity_rows`` rows), then the graph of ``(b_pad, n_pad)`` replayed, captured from ``step`` first
        when there is none. The logits live in the graphs' pool: valid until the next replay."""
        buf = self._buffers(capacity_rows, max_len)
        rows = b_pad * n_pad
        for name in ("ids", "pos", "write"):
            buf[name][:rows].copy_(inputs[name])
        buf["mask"][: rows * max_len].copy_(inputs["mask"].reshape(-1))
        got = self.graphs.get((b_pad, n_pad))
        if got is None:
            got = self.graphs[(b_pad, n_pad)] = self._capture(b_pad, n_pad, max_len, step)
        got[0].replay()
        return got[1]

    def static_rows(self, b_pad: int, n_pad: int, max_len: int) -> Rows:
        """The decoder input of ``(b_pad, n_pad)`` over the static buffers: slots ``[0, b_pad)``, attention over
        each whole slot."""
        rows = b_pad * n_pad
        buf = self.buf
        return Rows(ids=buf["ids"][:rows], pos=buf["pos"][:rows], seg=torch.empty((0, 3), dtype=torch.long),
                    mask=buf["mask"][: rows * max_len].view(b_pad, 1, n_pad, max_len), span=max_len,
                    write=buf["write"][:rows].view(b_pad, n_pad), slot0=0)

    def _capture(self, b_pad: int, n_pad: int, max_len: int,
                 step: Callable[[Rows], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """(graph, its output) of ``step`` over ``static_rows``; the seconds are added to ``warmup_s[n_pad]``."""
        t0 = time.perf_counter()
        static = self.static_rows(b_pad, n_pad, max_len)
        got = self._record(lambda: step(static))
        self.warmup_s[n_pad] = self.warmup_s.get(n_pad, 0.0) + time.perf_counter() - t0
        return got

    def _record(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """(CUDA graph, its output) of ``fn()`` in the shared memory pool: two warm-up runs on a side stream
        first, as capture requires (each the same step on the same inputs: the KV rows it writes are the ones
        the replay writes)."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph, out
