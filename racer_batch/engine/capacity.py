"""Choosing the draft capacity from measured cost (docs/method.md sections 5 and 8).

speedup ~= MAT * t(1) / (t(T) + t_draft + t_update). At start-up ``measure_cost_curve`` times one
verification forward over T tree tokens with a warm KV cache for each candidate capacity. During decoding
``CapacityTuner`` records, for every step, how many draft tokens would have been accepted had the tree
been cut at each smaller capacity (drafters create nodes best-first, so a tree of capacity c is the first
c nodes of a larger one), and picks the capacity with the most expected tokens per second. A size is seen
only on the steps that used it or a larger one (the warm-up, one size up on exploration steps), so the
expected accepted length of each size is the smallest size's mean over every step plus, size by size, the
mean gain over the next smaller size on the steps that saw both (paired): sizes seen on different steps are
never compared through different texts.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..drafters.base import Draft
from .tree import flatten_tree

log = logging.getLogger(__name__)


COST_CONTEXT = 256  # cached tokens before the measured verify forwards (measure_cost_curve's default)
# a second context for method auto's step split (Engine.measure_step_cost): near the long prompts of RAG and
# summarization rows, without growing the KV buffer of a short-prompt job far past what its rows need
LONG_COST_CONTEXT = 1024


def cost_at_context(cost_ms: dict[int, float], rows: int, context: float,
                    long: Optional[tuple[int, dict[int, float]]] = None) -> float:
    """Verify ms of a forward over ``rows`` tree rows after ``context`` cached tokens: ``cost_at`` of the curve
    measured after ``COST_CONTEXT`` tokens, moved along the straight line to the curve measured after ``long[0]``
    tokens (``long[1]``; the attention's cost grows linearly with the context), never below half the short
    curve's figure. Without ``long``: ``cost_at(cost_ms, rows)``.

    >>> cost_at_context({4: 10.0}, 4, 640, (1024, {4: 14.0}))  # half-way from 256 to 1024 tokens
    12.0
    """
    short = cost_at(cost_ms, rows)
    if long is None:
        return short
    c2, curve2 = long
    slope = (cost_at(curve2, rows) - short) / max(c2 - COST_CONTEXT, 1)
    return max(short + slope * (float(context) - COST_CONTEXT), 0.5 * short)


def context_scale(step_cost: Optional[dict[int, float]], long: Optional[tuple[int, dict[int, float]]], streams: int,
                  context: float) -> float:
    """What a step of ``streams`` one-token rows costs after ``COST_CONTEXT`` cached tokens over one after
    ``context`` (the engine's measured curves, ``cost_at_context``;
    ``Engine.context_scale`` reads its own); 1.0 without a long curve.

    A route's rows differ in prompt length (summarization: 190-1,300 tokens), so one row's tokens per second
    differs from another's by up to ~1.3x whatever the method; a candidate whose first rows had short prompts
    looked fast (benchmarks/warm-auto-20261206-043624.md). Scaling each row's actor time to one context compares
    candidates as if on the same rows; the reported figures stay unscaled.

    >>> round(context_scale({4: 10.0}, (1024, {4: 14.0}), 4, 640), 3)  # 10 ms at 256 tokens, 12 at 640
    0.833
    """
    if not step_cost or long is None:
        return 1.0
    b = max(1, int(streams))
    here = cost_at_context(step_cost, b, float(context), long)
    return cost_at_context(step_cost, b, COST_CONTEXT, long) / here if here > 0 else 1.0


@torch.inference_mode()
def measure_cost_curve(runner: Any, capacities: list[int], *, context_tokens: int = COST_CONTEXT,
                       repeats: int = 5) -> dict[int, float]:
    """Median milliseconds of one verify forward over T tree tokens after ``context_tokens`` cached ones, on
    the runner the engine actually uses (eager or static, padding and compiled steps included), up to and
    including the argmax copied back to the CPU.

    The sizes are timed round-robin (every round times each size once), so a burst of load from another
    process lands on one sample of several sizes instead of every sample of one size; then the curve is made
    non-decreasing from the top (a forward over fewer rows never costs more than one over more rows: T's
    figure is at most that of any larger size), which removes a spike that outlived the median.

    Returns {T: ms} for T in ``capacities`` and T = 1.
    """
    vocab = runner.bundle.vocab_size
    gen = torch.Generator().manual_seed(0)
    sizes = sorted(set([1, *capacities]))
    # a short-context model: keep prefix + the largest tree inside the context
    context_tokens = max(1, min(context_tokens, runner.bundle.context_length - sizes[-1] - 1))
    cache = runner.new_cache(context_tokens + sizes[-1])
    prompt = torch.randint(0, vocab, (context_tokens,), generator=gen).tolist()
    try:
        runner.prefill(prompt, cache=cache, topk=0)
        trees = {
            t: flatten_tree(Draft.chain(torch.randint(0, vocab, (t,), generator=gen).tolist()),
                            committed_len=context_tokens, device=runner.device, dtype=runner.dtype)
            for t in sizes
        }
        times: dict[int, list[float]] = {t: [] for t in sizes}
        for r in range(repeats + 1):
            for t in sizes:
                t0 = time.perf_counter()
                logits = runner.verify_tree(trees[t], cache=cache)
                logits.argmax(-1).cpu()
                if r > 0:  # the first round warms every size up
                    times[t].append((time.perf_counter() - t0) * 1000.0)
                runner.keep_rows(cache, committed_len=context_tokens, nodes=[])
        out = {t: statistics.median(times[t]) for t in sizes}
    finally:
        runner.release(cache)
    for i in range(len(sizes) - 2, -1, -1):
        out[sizes[i]] = min(out[sizes[i]], out[sizes[i + 1]])
    return out


def cost_at(cost_ms: dict[int, float], rows: int) -> float:
    """Verify ms of a forward over ``rows`` tree rows from a measured curve ``{rows: ms}``: the measured size at
    or above it, else a straight line through the two largest sizes (linear in rows once compute-bound)."""
    sizes = sorted(cost_ms)
    for t in sizes:
        if t >= rows:
            return cost_ms[t]
    if len(sizes) == 1:
        return cost_ms[sizes[0]] * rows / sizes[0]
    a, b = sizes[-2], sizes[-1]
    slope = (cost_ms[b] - cost_ms[a]) / (b - a)
    return cost_ms[b] + max(slope, 0.0) * (rows - b)


class CapacityTuner:
    """Picks the capacity that maximises expected tokens per second from observed acceptance.

    Args:
        cost_ms: {capacity: verify ms} from ``measure_cost_curve`` (must contain every candidate).
        candidates: capacities to choose from.
        warmup_steps: steps at the warm-up capacity before the first choice.
        explore_every: every n-th step uses the next larger candidate than the chosen one.
        warmup_cost_ratio: the warm-up capacity is the largest candidate whose verify costs at most this many
            times a one-token forward (``cost_ms[1]``, else the cheapest candidate). On a flat cost curve (a GPU)
            that is the largest candidate; on our CPU kernels, where t(64) is ~7x t(1), it is 12, so the
            warm-up does not spend 16 steps at 7x the price. Larger candidates are still reached afterwards:
            each exploration step tries one size up, which makes the next size observable.
        switch_margin: the chosen capacity changes only when another one's expected tokens/s beats it by more
            than this fraction. Without it two near-equal sizes took turns every step (seen on a Zen 4: 84.57
            vs 84.47 tokens/s, 4 -> 6 -> 4 ...), each switch a log line and a different tree size.
    """

    def __init__(self, cost_ms: dict[int, float], candidates: list[int], *, warmup_steps: int = 16,
                 explore_every: int = 8, warmup_cost_ratio: float = 2.0, switch_margin: float = 0.02) -> None:
        self.cost_ms = dict(cost_ms)
        self.candidates = sorted(candidates)
        base = self.cost_ms.get(1, min(self.cost_ms[c] for c in self.candidates))
        affordable = [c for c in self.candidates if self.cost_ms[c] <= warmup_cost_ratio * base]
        self.warmup_cap = affordable[-1] if affordable else self.candidates[0]
        self.warmup_cost_ratio = warmup_cost_ratio
        self.warmup_steps = warmup_steps
        self.explore_every = explore_every
        # per candidate: accepted drafts beyond those of the next smaller candidate, summed over the steps
        # that saw it (a step sees every candidate up to the capacity it used), and the count of those steps
        self.sum_gain = np.zeros(len(self.candidates))
        self.n_obs = np.zeros(len(self.candidates))
        self.overhead_ms = 0.0
        self.steps = 0
        self.switch_margin = switch_margin
        self.current = self.warmup_cap
        self._current_at: dict[int, int] = {}  # streams (> 1) -> the capacity chosen for that many streams

    def cost(self, rows: int) -> float:
        """Verify ms of a forward over ``rows`` tree rows (``cost_at`` of the measured curve)."""
        return cost_at(self.cost_ms, rows)

    def warmup_capacity(self, streams: int = 1) -> int:
        """The largest candidate whose batch of ``streams`` trees costs at most ``warmup_cost_ratio`` times
        ``streams`` one-token rows (``warmup_cap`` at one stream)."""
        if streams <= 1:
            return self.warmup_cap
        base = self.cost(streams)
        fits = [c for c in self.candidates if self.cost(streams * c) <= self.warmup_cost_ratio * base]
        return fits[-1] if fits else self.candidates[0]

    def capacity(self, streams: int = 1) -> int:
        """Capacity for the next step when ``streams`` streams are verified in one forward: the warm-up size
        during warm-up; afterwards the chosen one, except every ``explore_every``-th step, which tries the
        next larger candidate so its estimate stays fresh (a step at the largest capacity would cost
        t(max)/t(current) times a normal one: 4x on a CPU at 64 vs 8)."""
        if self.steps < self.warmup_steps:
            return self.warmup_capacity(streams)
        best = self.current if streams <= 1 else self._settled(streams)
        if self.explore_every and self.steps % self.explore_every == 0:
            i = self.candidates.index(best)
            return self.candidates[min(i + 1, len(self.candidates) - 1)]
        return best

    def observe(self, *, used_capacity: int, accepted_creation_idx: list[int], overhead_ms: float) -> None:
        """Record one step: the creation-order indices of the accepted draft nodes (root excluded)."""
        self.observe_batch(used_capacity=used_capacity,
                           accepted_creation_idx=np.asarray(accepted_creation_idx, dtype=np.int64),
                           streams=1, overhead_ms=overhead_ms)

    def observe_batch(self, *, used_capacity: int, accepted_creation_idx: np.ndarray, streams: int,
                      overhead_ms: float) -> None:
        """Record one batched step of ``streams`` trees at once: the same counts as ``streams`` calls of
        ``observe`` (one per tree), from the creation-order indices of every tree's accepted draft nodes
        together (``[A]``: only how many fall below each candidate matters, summed over the trees), then one
        choice."""
        if streams < 1:
            return
        # a tree's accepted nodes below capacity c are a prefix of its path (parents are created first), so
        # counting the indices below c over all trees gives the summed accepted lengths at capacity c
        idx = np.asarray(accepted_creation_idx)
        first = self.steps == 0
        self.steps += streams
        if first:
            self.overhead_ms = overhead_ms
            streams_after = streams - 1
        else:
            streams_after = streams
        self.overhead_ms += (overhead_ms - self.overhead_ms) * (1.0 - 0.95 ** streams_after)
        prev = 0
        for i, cap in enumerate(self.candidates):
            if cap > used_capacity:
                break
            acc = int(np.count_nonzero(idx < cap))
            self.sum_gain[i] += acc - prev
            prev = acc
            self.n_obs[i] += streams
        if self.steps >= self.warmup_steps:
            best = self._keep_or_switch(self.current, self.expected_rates())
            if best != self.current:
                log.info("capacity auto: %d -> %d (expected tokens/s %s)", self.current, best, self.expected_rates())
                self.current = best

    def expected_rates(self, streams: int = 1) -> dict[int, float]:
        """{capacity: expected emitted tokens per second of all ``streams`` streams together} from the
        observations so far: ``streams x MAT(c) / (t(streams x c) + streams x overhead)``, the per-stream
        drafting and acceptance work being serial between the batched forwards. MAT(c) is 1 + the smallest
        size's mean accepted length + the paired mean gains of each size over the next smaller one up to c
        (see the module docstring); it never falls as c grows."""
        rates = {}
        mat = 1.0
        for i, cap in enumerate(self.candidates):
            if self.n_obs[i] == 0:  # no step saw this size, so none saw a larger one
                break
            mat += self.sum_gain[i] / self.n_obs[i]
            rates[cap] = round(1000.0 * streams * mat / (self.cost(streams * cap) + streams * self.overhead_ms), 2)
        return rates

    def _keep_or_switch(self, current: int, rates: dict[int, float]) -> int:
        """The capacity with the most expected tokens/s in ``rates``, unless ``current`` is within
        ``switch_margin`` of it (then ``current``)."""
        if not rates:
            return current
        best = max(rates, key=rates.get)
        if current in rates and rates[best] <= rates[current] * (1.0 + self.switch_margin):
            return current
        return best

    def _settled(self, streams: int) -> int:
        """The capacity for ``streams`` streams per forward, kept between steps like ``current``."""
        rates = self.expected_rates(streams)
        if not rates:
            return self.warmup_capacity(streams)
        now = self._keep_or_switch(self._current_at.get(streams, -1), rates)
        self._current_at[streams] = now
        return now

    def choose(self, streams: int = 1) -> int:
        rates = self.expected_rates(streams)
        return max(rates, key=rates.get) if rates else self.warmup_capacity(streams)

    def best_streams(self, choices: Sequence[int]) -> tuple[int, int, float]:
        """(streams, capacity, expected tokens/s) with the most expected tokens per second among ``choices``
        of the number of streams in one forward, each at its best capacity (``streams_per_actor: auto``)."""
        best = (choices[0], self.choose(choices[0]), -1.0)
        for b in choices:
            c = self.choose(b)
            rate = self.expected_rates(b).get(c, 0.0)
            if rate > best[2]:
                best = (b, c, rate)
        return best
