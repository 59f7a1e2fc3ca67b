"""How a job drafted over its life, for the report: MAT per shard with the saved draft state each shard started
from (cold against warm, per route; ``resources.warm_draft_state``), and with ``decoding.method: auto`` the
method each route chose and the evidence (docs/reports.md).

Both read the output rows (their ``shard``, ``route``, ``method``, ``output_tokens``, ``steps`` and actor
time) and the manifest's shard summaries (``warm_commits``, ``method_auto``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping, Optional

from racer_batch.service.results.method_auto import figures


def _busy_ms(row: Mapping[str, Any]) -> float:
    dev = row.get("device_ms")
    return float(dev) if dev is not None else float(row.get("prefill_ms") or 0.0) + float(row.get("decode_ms") or 0.0)


def _add(acc: list, row: Mapping[str, Any]) -> None:
    acc[0] += 1
    acc[1] += int(row.get("output_tokens") or 0)
    acc[2] += int(row.get("steps") or 0)
    acc[3] += _busy_ms(row)


def shard_life(rows: Iterable[Mapping[str, Any]], manifest: Mapping[str, Any], *, by: str = "route") -> dict:
    """``{"shards": [{shard, warm_commits, groups: {group: figures}}], "cold_warm": {group: {"cold": figures,
    "warm": figures}}}`` over the ok rows: a shard is *warm* when its summary says it started from a saved
    state (``warm_commits`` > 0), else *cold*; shards in order."""
    summaries = manifest.get("shards") or {}
    per: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0.0]))
    both: dict[str, dict[str, list]] = defaultdict(lambda: {"cold": [0, 0, 0, 0.0], "warm": [0, 0, 0, 0.0]})
    for r in rows:
        if r.get("status") != "ok" or r.get("shard") is None:
            continue
        shard, group = int(r["shard"]), str(r.get(by) or "")
        warm = int((summaries.get(f"{shard:05d}") or {}).get("warm_commits") or 0)
        _add(per[shard][group], r)
        _add(both[group]["warm" if warm else "cold"], r)
    shards = [{"shard": s, "warm_commits": int((summaries.get(f"{s:05d}") or {}).get("warm_commits") or 0),
               "groups": {g: figures(*acc) for g, acc in sorted(groups.items())}} for s, groups in sorted(per.items())]
    cold_warm = {g: {k: figures(*acc) for k, acc in d.items()} for g, d in sorted(both.items())}
    return {"shards": shards, "cold_warm": cold_warm}


def method_choice(rows: Iterable[Mapping[str, Any]], manifest: Mapping[str, Any], *, by: str = "route") -> dict:
    """With method auto: ``{group: {"choice": method or None, "candidates": {method: figures}}}`` from the ok
    rows (which method answered each), the choice as the manifest records it (pooled over the shards); {} for a
    job with one method."""
    if (manifest.get("spec") or {}).get("decoding", {}).get("method") != "auto":
        return {}
    acc: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0.0]))
    for r in rows:
        if r.get("status") == "ok":
            _add(acc[str(r.get(by) or "")][str(r.get("method"))], r)
    chosen = manifest.get("method_auto") or {}
    out = {}
    for g, per in sorted(acc.items()):
        pooled = (chosen.get(g) or {}).get("candidates") or {}
        cands = {}
        for m, a in sorted(per.items()):
            f = figures(*a)  # from the rows: no decode-time split, so its compared figure is the manifest's
            f["compared_tokens_per_s"] = (pooled.get(m) or {}).get("compared_tokens_per_s")
            cands[m] = f
        out[g] = {"choice": (chosen.get(g) or {}).get("choice"), "candidates": cands}
    return out


def _cell(v: Optional[float], nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def life_table(life: dict, by: str) -> tuple[list[str], list[list[str]]]:
    """One row per shard and group: MAT and tokens per device-second, beside the commits it started from."""
    head = ["shard", "started from", by, "rows", "MAT", "tokens/device-s"]
    body = []
    for s in life["shards"]:
        start = f"{s['warm_commits']} commits" if s["warm_commits"] else "cold"
        for g, f in s["groups"].items():
            body.append([str(s["shard"]), start, g, str(f["rows"]), _cell(f["mat"]), _cell(f["tokens_per_s"], 1)])
    return head, body


def cold_warm_table(life: dict, by: str) -> tuple[list[str], list[list[str]]]:
    """Per group: MAT and tokens per device-second of the shards that started cold and of those that started warm,
    and warm over cold."""
    head = [by, "cold rows", "cold MAT", "warm rows", "warm MAT", "MAT warm / cold", "cold tokens/device-s",
            "warm tokens/device-s"]
    body = []
    for g, d in life["cold_warm"].items():
        c, w = d["cold"], d["warm"]
        ratio = w["mat"] / c["mat"] if c["mat"] and w["mat"] else None
        body.append([g, str(c["rows"]), _cell(c["mat"]), str(w["rows"]), _cell(w["mat"]), _cell(ratio, 3),
                     _cell(c["tokens_per_s"], 1), _cell(w["tokens_per_s"], 1)])
    return head, body


def choice_table(choice: dict, by: str) -> tuple[list[str], list[list[str]]]:
    """Per group and candidate: rows, MAT, tokens per device-second, and the figure the choice compares (tokens
    per second of decode time at one context, from the manifest); the chosen one marked."""
    head = [by, "method", "chosen", "rows", "MAT", "tokens/device-s", "compared tokens/s"]
    body = []
    for g, d in choice.items():
        for m, f in d["candidates"].items():
            body.append([g, m, "yes" if m == d["choice"] else "", str(f["rows"]), _cell(f["mat"]),
                         _cell(f["tokens_per_s"], 1), _cell(f.get("compared_tokens_per_s"), 1)])
    return head, body
