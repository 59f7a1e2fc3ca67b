"""Target distribution processing and the one-draw-per-token sampler.

Every emitted token, autoregressive or speculative, is exactly one call of ``draw`` on the processed target
distribution p of the position it follows, using one ``torch.rand`` from the row's generator. So with the
same seed, speculative sampling emits the same tokens as plain autoregressive sampling whenever the logits
agree (docs/method.md section 4: q is a point mass, draw from p and descend while a child carries the draw).
"""

from __future__ import annotations

import torch

from ..values import GenerationParams


def make_generator(seed: int) -> torch.Generator:
    """CPU generator seeded per call, so equal seeds repeat exactly whatever the device."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def processed_probs(logits: torch.Tensor, params: GenerationParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p.

    Args:
        logits: ``[V]`` or ``[N, V]`` raw logits of the target model.
    Returns:
        float32 probabilities of the same shape, on the CPU; rows sum to 1.
    """
    x = logits.detach().float().cpu() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # always keeps the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` ``[V]`` by inverse CDF with a single uniform draw."""
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    idx = int(torch.searchsorted(cdf, u, right=True))
    return min(idx, probs.shape[0] - 1)
