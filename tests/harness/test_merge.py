"""benchmarks/merge.py: pooling racer-batch bench files token-weighted."""

from __future__ import annotations

import pytest

from benchmarks import merge as merge_module


def test_merge_bench_pools_token_weighted():
    merge = merge_module

    def run(tokens, ms, mat, hf_ms):
        row = {"rows": 2, "tokens": tokens, "mat": mat, "ms_per_token": ms, "exact_match_vs_hf_greedy": "2/2"}
        base = {"rows": 2, "tokens": tokens, "mat": 1.0, "ms_per_token": hf_ms, "exact_match_vs_hf_greedy": "2/2"}
        return {"config": {"model": "m", "capacity": 6}, "overall": {"hf_greedy": base, "racer": row}}

    rows = merge.pool([run(100, 10.0, 2.0, 40.0), run(300, 20.0, 3.0, 40.0)])
    assert rows["racer"]["tokens"] == 400 and rows["racer"]["ms_per_token"] == 17.5  # (1000 + 6000) / 400
    assert rows["racer"]["mat"] == round(400 / (50 + 100), 3)
    assert rows["racer"]["speedup_vs_hf_greedy"] == round(40.0 / 17.5, 3)
    assert rows["racer"]["exact_match_vs_hf_greedy"] == "4/4"
    with pytest.raises(SystemExit):
        merge.pool([run(1, 1.0, 1.0, 1.0), {**run(1, 1.0, 1.0, 1.0), "config": {"model": "m", "capacity": 8}}])



def test_merge_main_writes_the_pooled_files(tmp_path):
    """``python -m benchmarks.merge``: the pooled JSON and Markdown through ``common.write_results``, the tables
    through the one Markdown writer, the reproduce command recorded."""
    import json

    cfg = {"model": "m", "capacity": 6, "max_new_tokens": 8, "dtype": "float32", "torch_threads": 1,
           "host": {"cpu": "CPU X", "family": "25", "model": "1", "isa": ["avx2"], "cores": 2}}
    paths = []
    for k, (tokens, ms) in enumerate([(100, 10.0), (300, 20.0)]):
        row = {"rows": 2, "tokens": tokens, "mat": 2.0, "ms_per_token": ms, "exact_match_vs_hf_greedy": "2/2"}
        base = dict(row, mat=1.0, ms_per_token=40.0)
        path = tmp_path / f"bench-{k}.json"
        path.write_text(json.dumps({"command": f"racer-batch bench {k}", "config": cfg,
                                    "overall": {"hf_greedy": base, "racer": row}, "sets": {"s": {"racer": row}}}))
        paths.append(str(path))
    merge_module.main([*paths, "--out", str(tmp_path / "out")])
    (jpath,) = (tmp_path / "out").glob("bench-pooled-*.json")
    d = json.loads(jpath.read_text())
    assert d["overall"]["racer"]["ms_per_token"] == 17.5 and d["sources"] == paths
    assert d["command"].startswith("python -m benchmarks.merge ")
    md = jpath.with_suffix(".md").read_text()
    assert "Reproduce: `python -m benchmarks.merge " in md and "machine: CPU X (family 25 model 1, avx2)" in md
    assert "| racer | 4 | 400 | 2 | 17.5 | 2.286 |  |  | 4/4 |" in md  # md_records: floats to 3 decimals
    assert "| s | racer | 4 | 400 | 2 | 17.5 |  |  |  | 4/4 |" in md
