"""Bounded resources: a short soak (benchmarks/soak.py with 1,000 rows on one Ray actor, tiny-random model)
asserts flat curves (slopes), never timings; the telemetry stream's cap is checked directly."""

from __future__ import annotations

import json

import pytest

from benchmarks import soak
from racer_batch.service.execution.queue import ROW_STREAM_MAXLEN
from racer_batch.service.results.tally import Tally

pytestmark = pytest.mark.service


def test_slope_per_1k_rows():
    samples = [{"rows_done": r, "x": 100 + r / 500} for r in (0, 500, 1000)]
    assert soak.slope_per_1k_rows(samples, "x", warmup_frac=0.0) == pytest.approx(2.0)
    assert soak.slope_per_1k_rows(samples[:2], "x") is None  # too few points


def test_soak_markdown():
    sample = {"t_s": 1.4, "rows_done": 20, "actor_rss_mb": 300.04, "automaton_nodes": 12, "draft_state_mb": 0.5,
              "row_stream_len": 20, "redis_state_kb": 3.25, "queue_len": 0}
    result = {"config": {"rows": 20, "model": "tiny-random", "max_new_tokens": 4},
              "command": "python -m benchmarks.soak",
              "machine": {"cpu": "CPU", "family": "6", "model": "1", "isa": ["avx2"], "cores": 2},
              "samples": [sample, dict(sample, automaton_nodes=None)],
              "summary": {"actor_rss_mb_max": 300.04, "automaton_nodes_max": 12, "row_stream_len_max": 20,
                          "redis_state_kb_max": 3.25,
                          "slope_per_1k_rows": {"actor_rss_mb": 1.5, "automaton_nodes": None}}}
    md = soak.render_md(result)
    assert "Reproduce: `python -m benchmarks.soak`" in md and "Machine: CPU (family 6 model 1, avx2), 2 cores." in md
    assert "| actor_rss_mb | +1.500 | 300 |" in md and "| automaton_nodes |  | 12 |" in md
    assert md.count("| 1 | 20 | 300 |") == 2  # the probed sample, then the last one


def test_short_soak_is_flat(ray_session, redis_url):
    # 1,000 rows (about 30 s): with fewer, one allocator step of ~7 MB after the warm-up (seen at 300 rows)
    # reads as a slope of 50 MB per 1,000 rows, as large as the leak the test is after
    rows, max_nodes, shard_rows = 1000, 1000, 20
    result = soak.run_soak(rows=rows, redis_url=redis_url, max_new_tokens=4, shard_rows=shard_rows,
                           max_nodes=max_nodes, sample_s=0.25)
    s = result["summary"]
    print("short soak:", json.dumps(s))
    assert s["state"] == "done" and s["ok"] == rows
    slopes = s["slope_per_1k_rows"]
    # actor memory: flat after the warm-up (model load, first allocations); a leak of even 50 KB per row
    # would show as 50 MB per 1,000 rows
    assert slopes["actor_rss_mb"] is not None and slopes["actor_rss_mb"] < 20, s
    late = [x["actor_rss_mb"] for x in result["samples"] if x["rows_done"] >= rows // 4 and x["actor_rss_mb"]]
    assert max(late) - min(late) < 16, late
    # the automaton is capped by max_nodes and sits at the cap once full
    nodes = [x["automaton_nodes"] for x in result["samples"] if x["automaton_nodes"] is not None]
    assert len(nodes) >= 3 and max(nodes) <= max_nodes and nodes[-1] >= 0.9 * max_nodes, nodes
    assert abs(slopes["automaton_nodes"] or 0) < 0.05 * max_nodes
    # Redis: one telemetry entry per row (below the cap here), a small summary per shard, no queue backlog
    assert s["row_stream_len_max"] == rows <= ROW_STREAM_MAXLEN
    assert s["redis_state_kb_max"] / s["shards"] < 2.0, s
    assert s["queue_len_max"] <= 1 and s["queue_len_end"] == 0


def test_row_stream_is_capped(queue):
    """Telemetry of a job longer than the cap: the stream is trimmed to about ROW_STREAM_MAXLEN entries."""
    progress = Tally()
    n = ROW_STREAM_MAXLEN + 2_500
    row = {"id": "x", "row_idx": 0, "shard": 0, "route": "default", "status": "ok", "output_tokens": 4}
    for i in range(n):
        queue.record_row("capped", dict(row, row_idx=i), shard=i // 100, progress=progress)
    length = queue.r.xlen(queue.k_job("capped", "rows"))
    assert ROW_STREAM_MAXLEN <= length <= ROW_STREAM_MAXLEN + 200, length  # MAXLEN ~ trims whole nodes
