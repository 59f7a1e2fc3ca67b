"""capacity.measure_cost_curve: sizes timed round-robin, and a spike at one size cannot make a smaller tree look
dearer than a larger one (the tuner would then never pick it)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from racer_batch.engine.capacity import measure_cost_curve


class _ClockRunner:
    """A runner whose verify costs ``base + per_row * T`` ms, except ``spike_ms`` on calls of size ``spike_at``
    while ``spike_calls`` lasts (a burst of load from another process)."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, *, spike_at: int, spike_calls: int, spike_ms: float) -> None:
        self.bundle = SimpleNamespace(vocab_size=50, context_length=4096)
        self.calls: list[int] = []
        self.spike_at, self.spike_calls, self.spike_ms = spike_at, spike_calls, spike_ms

    def new_cache(self, n: int):
        return SimpleNamespace(length=0)

    def prefill(self, ids, *, cache, topk):
        cache.length = len(ids)

    def verify_tree(self, tree, *, cache):
        t = tree.size
        self.calls.append(t)
        ms = 1.0 + 0.2 * t
        if t == self.spike_at and self.spike_calls > 0:
            self.spike_calls -= 1
            ms = self.spike_ms
        time.sleep(ms / 1000.0)
        return torch.zeros(t, 50)

    def keep_rows(self, cache, *, committed_len, nodes):
        cache.length = committed_len + len(nodes)

    def release(self, cache):
        pass


def test_sizes_are_timed_round_robin_and_a_spike_does_not_survive():
    # a burst that covers 3 of the 5 timed samples of size 16: the median alone would keep it
    runner = _ClockRunner(spike_at=16, spike_calls=4, spike_ms=60.0)
    curve = measure_cost_curve(runner, [4, 8, 16, 24], context_tokens=32, repeats=5)
    assert runner.calls[:5] == [1, 4, 8, 16, 24] and runner.calls[5:10] == [1, 4, 8, 16, 24]
    sizes = sorted(curve)
    assert sizes == [1, 4, 8, 16, 24]
    assert all(curve[a] <= curve[b] for a, b in zip(sizes, sizes[1:])), curve
    assert curve[16] <= curve[24] < 30.0  # the spike (60 ms) is gone: 16 rows cost at most what 24 do


def test_an_honest_curve_is_kept():
    runner = _ClockRunner(spike_at=-1, spike_calls=0, spike_ms=0.0)
    curve = measure_cost_curve(runner, [8, 32], context_tokens=16, repeats=3)
    assert curve[1] < curve[8] < curve[32]  # 1.2, 2.6, 7.4 ms plus sleep overhead: strictly rising
