"""The evidence of ``decoding.method: auto`` (service/execution/auto.py) as the results read it: each shard's
summary holds, per route, what every candidate measured in that shard and the actor's choice at its end
(``method_auto``); the manifest and the report pool the shards."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

COUNTERS = ("rows", "tokens", "steps", "busy_ms", "adj_ms")


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
            "compared_tokens_per_s": round(1000.0 * tokens / adj_ms, 2) if adj_ms > 0 else measured}


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
        out[route] = {"choice": max(cands, key=lambda m: (_rate(per[m]), -order.index(m))), "candidates": cands}
    return out


def _rate(acc: list) -> float:
    """Compared tokens per second of pooled counters ``[rows, tokens, steps, busy_ms, adj_ms]`` (as ``figures``,
    unrounded)."""
    ms = acc[4] if acc[4] > 0 else acc[3]
    return 1000.0 * acc[1] / ms if ms > 0 else 0.0
