"""The evidence of ``decoding.method: auto`` (service/execution/auto.py) as the results read it: each shard's
summary holds, per route, what every candidate measured in that shard and the actor's choice at its end
(``method_auto``); the manifest and the report pool the shards."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

COUNTERS = ("rows", "tokens", "steps", "busy_ms", "adj_ms")


def compared_rate(tokens: float, busy_ms: float, adj_ms: float) -> float:
    """What method auto compares, unrounded: tokens per second of ``adj_ms`` (the rows' decode time scaled to one
    context), or of ``busy_ms`` where no decode time was recorded; 0.0 without time."""
    ms = adj_ms if adj_ms > 0 else busy_ms
    return 1000.0 * tokens / ms if ms > 0 else 0.0


def figures(rows: int, tokens: int, steps: int, busy_ms: float, adj_ms: float = 0.0) -> dict:
    """One candidate's counters with its MAT (tokens per target forward), tokens per second of actor time
    (``tokens_per_s``, as measured) and ``compared_tokens_per_s``: tokens per second of ``adj_ms``, the rows'
    decode time scaled to one context, which is what the choice compares (``auto.CandidateStats.rate``; the
    measured figure where ``adj_ms`` is 0, as in summaries written before it was kept)."""
    measured = round(1000.0 * tokens / busy_ms, 2) if busy_ms > 0 else 0.0
    # the ms keep 3 decimals: pool() recomputes the rates from them, and at 0.1 ms two candidates within ~0.1% of
    # each other could come out in the other order than the shard's own choice
    return {"rows": int(rows), "tokens": int(tokens), "steps": int(steps), "busy_ms": round(float(busy_ms), 3),
            "adj_ms": round(float(adj_ms), 3), "mat": round(tokens / steps, 3) if steps else None,
            "tokens_per_s": measured,
            "compared_tokens_per_s": round(compared_rate(tokens, busy_ms, adj_ms), 2)}


def pool(shards: Iterable[Optional[Mapping[str, Any]]]) -> dict:
    """``{route: {"choice": method, "candidates": {method: figures}}}`` summed over the shards' ``method_auto``
    (None or missing: a shard without method auto); a route's choice is the candidate with the most compared
    tokens per second over the whole job, from the summed counters unrounded (ties: the first listed)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for ev in shards:
        for route, entry in (ev or {}).items():
            for method, c in entry["candidates"].items():
                acc = sums.setdefault(route, {}).setdefault(method, [0, 0, 0, 0.0, 0.0])
                for i, name in enumerate(COUNTERS):
                    acc[i] += c.get(name) or 0
    out = {}
    for route, per in sorted(sums.items()):
        cands = {m: figures(*acc) for m, acc in per.items()}
        order = list(cands)
        # ranked by the unrounded rate (the figures round it to 0.01 tokens/s)
        out[route] = {"choice": max(cands, key=lambda m: (compared_rate(per[m][1], per[m][3], per[m][4]),
                                                           -order.index(m))), "candidates": cands}
    return out
