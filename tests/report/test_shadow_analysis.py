"""Shadow sampling, exact match and divergence, speed ratio and its bootstrap CI, post-hoc shadow runs."""

from __future__ import annotations

import json

import pytest
from report_fixtures import finished_job

from racer_batch.report.aggregate import OVERALL
from racer_batch.report.build import build_report, render_md
from racer_batch.report.load import load_output
from racer_batch.report.shadow import Pair, analyze, bootstrap_ci, first_divergence, speed_ratio
from racer_batch.report.shadow_run import run_posthoc_shadow
from racer_batch.service.results.shadow import baseline_first, read_shadow, shadow_selected


# ---- sampling
def test_shadow_sample_is_deterministic_nested_and_about_the_fraction():
    ids = [f"row-{i}" for i in range(20_000)]
    a = {i for i in ids if shadow_selected(7, i, 0.05)}
    assert a == {i for i in reversed(ids) if shadow_selected(7, i, 0.05)}  # order does not matter
    assert 0.045 < len(a) / len(ids) < 0.055
    assert a <= {i for i in ids if shadow_selected(7, i, 0.10)}  # a larger fraction keeps the smaller sample
    assert a != {i for i in ids if shadow_selected(8, i, 0.05)}  # the seed changes the sample
    assert not any(shadow_selected(7, i, 0.0) for i in ids[:100]) and all(shadow_selected(7, i, 1.0) for i in ids[:100])
    firsts = [baseline_first(7, i) for i in ids[:2000]]
    assert 0.45 < sum(firsts) / 2000 < 0.55


# ---- divergence and ratios on hand-written pairs
def test_first_divergence():
    assert first_divergence(["same"], ["same"]) is None
    assert first_divergence(["abcdef"], ["abcXef"]) == (0, 3)
    assert first_divergence(["x", "yz"], ["x", "yQ"]) == (1, 1)
    assert first_divergence(["ab"], ["abc"]) == (0, 2)
    assert first_divergence(["a"], ["a", "b"]) == (1, 0)


def _pair(mm, mt, bm, bt, *, ms=1, bs=1, texts=("t",), btexts=None, greedy=True, rid="r", route="a"):
    return Pair(id=rid, route=route, method_ms=mm, method_tokens=mt, method_steps=ms, baseline_ms=bm,
                baseline_tokens=bt, baseline_steps=bs, method_texts=tuple(texts),
                baseline_texts=tuple(btexts or texts), greedy=greedy)


def test_speed_ratio_is_token_weighted():
    # method: 2000 ms for 150 tokens; baseline: 5000 ms for 150 tokens -> (5000/150) / (2000/150) = 2.5
    pairs = [_pair(1000, 100, 2000, 100), _pair(1000, 50, 3000, 50)]
    assert speed_ratio(pairs) == pytest.approx(2.5)
    # not the mean of per-row ratios (2.0 and 3.0 -> 2.5 here by chance; make them differ):
    pairs = [_pair(1000, 100, 2000, 100), _pair(100, 10, 1000, 10)]
    assert speed_ratio(pairs) == pytest.approx((3000 / 110) / (1100 / 110))  # 2.727..., the mean would be 6.0
    assert speed_ratio([]) is None


def test_bootstrap_ci():
    same = [_pair(1000, 100, 2000, 100) for _ in range(5)]
    assert bootstrap_ci(same, n_boot=200) == pytest.approx((2.0, 2.0))  # no spread, no interval
    assert bootstrap_ci(same[:1]) is None  # one row: no interval
    two = [_pair(1000, 100, 2000, 100), _pair(1000, 100, 4000, 100)]
    # the resamples of two rows are {a,a} -> 2.0, {a,b} -> 3.0, {b,b} -> 4.0 (probabilities 1/4, 1/2, 1/4)
    lo, hi = bootstrap_ci(two, n_boot=4000, level=0.9)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(4.0)
    lo50, hi50 = bootstrap_ci(two, n_boot=4000, level=0.4)  # the middle 40% is all 3.0
    assert lo50 == pytest.approx(3.0) and hi50 == pytest.approx(3.0)
    assert bootstrap_ci(two, n_boot=300, seed=5) == bootstrap_ci(two, n_boot=300, seed=5)  # seeded


def _rec(row_idx, side, route, *, text, ms, tok, steps, temp=0.0, finish="eos", run="job", status="ok"):
    turns = list(text) if isinstance(text, tuple) else [text]
    return {"run": run, "job_id": "j", "id": f"r{row_idx}", "row_idx": row_idx, "route": route, "side": side,
            "method": "racer" if side == "method" else "ar", "status": status, "text": turns[-1], "turn_texts": turns,
            "output_tokens": tok, "steps": steps, "prefill_ms": 0.0, "decode_ms": ms, "temperature": temp,
            "finish_reason": finish}


def test_analyze_per_route_match_divergence_mat():
    recs = [
        _rec(0, "method", "a", text="abc", ms=1000, tok=100, steps=40),
        _rec(0, "baseline", "a", text="abc", ms=2000, tok=100, steps=100),
        _rec(1, "method", "a", text=("x", "yz"), ms=1000, tok=50, steps=25),
        _rec(1, "baseline", "a", text=("x", "yQ"), ms=3000, tok=50, steps=50),
        _rec(2, "method", "b", text="s1", ms=500, tok=20, steps=10, temp=0.8, finish="eos"),
        _rec(2, "baseline", "b", text="s2", ms=1000, tok=30, steps=30, temp=0.8, finish="length"),
        _rec(3, "method", "b", text="q", ms=10, tok=1, steps=1, status="error"),  # not a usable pair
        _rec(3, "baseline", "b", text="q", ms=10, tok=1, steps=1),
        _rec(4, "method", "b", text="lonely", ms=10, tok=1, steps=1),  # no baseline record: skipped
    ]
    res = {r.route: r.to_dict(n_boot=100) for r in analyze(recs)}
    a, b, al = res["a"], res["b"], res[OVERALL]
    assert (a["sampled_rows"], a["pairs_ok"], a["greedy_pairs"]) == (2, 2, 2)
    assert a["greedy_exact_match_rate"] == 0.5
    assert a["mismatches"] == [{"id": "r1", "turn": 1, "char": 1}]
    assert a["speed_ratio"] == pytest.approx(2.5)
    assert a["mat_method"] == pytest.approx(150 / 65) and a["mat_baseline"] == pytest.approx(1.0)
    assert (b["sampled_rows"], b["pairs_ok"], b["greedy_pairs"]) == (2, 1, 0)
    assert b["greedy_exact_match_rate"] is None and b["sampled_exact_match_rate"] == 0.0
    assert b["sampling"] == {"pairs": 1, "mean_tokens_method": 20.0, "mean_tokens_baseline": 30.0,
                             "finish_method": {"eos": 1}, "finish_baseline": {"length": 1}}
    assert b["speed_ratio"] == pytest.approx((1000 / 30) / (500 / 20))
    assert al["pairs_ok"] == 3 and al["sampled_rows"] == 4


# ---- post-hoc shadow on a finished (stand-in) job, then the report
def _finished_job(tmp_path, rows, **kw):
    return finished_job(tmp_path, rows, job_id="job-p", **kw)


def test_posthoc_shadow_and_report(tmp_path):
    rows = [{"id": f"q{i}", "prompt": f"question {i} please", "route": "ra" if i % 2 else "rb"} for i in range(10)]
    spec = _finished_job(tmp_path, rows)
    job = load_output(spec.output.path)
    path, n = run_posthoc_shadow(job, baseline="ar", fraction=0.5, seed=1)
    expected = [r["id"] for r in rows if shadow_selected(1, r["id"], 0.5)]
    assert n == len(expected) and path.name == "_shadow-posthoc-ar-s1.parquet"
    sh = read_shadow(spec.output.path).to_pylist()
    assert sorted({r["id"] for r in sh}) == sorted(expected) and {r["run"] for r in sh} == {"posthoc:ar"}
    rep = build_report(load_output(spec.output.path), n_boot=100)
    overall = [s for s in rep.shadow if s["route"] == OVERALL][0]
    assert overall["greedy_exact_match_rate"] == 1.0 and overall["pairs_ok"] == n
    assert overall["job_text_matches"] == overall["job_text_compared"] == n  # the re-run reproduced the job
    assert overall["baseline"] == "ar" and overall["speed_ratio"] is not None
    assert "was not measured" not in render_md(rep)


def test_in_job_shadow_reaches_the_report(tmp_path):
    rows = [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(8)]
    spec = _finished_job(tmp_path, rows, **{"shadow.config": "pld", "shadow.fraction": 1.0})
    rep = build_report(load_output(spec.output.path), n_boot=100)
    overall = [s for s in rep.shadow if s["route"] == OVERALL][0]
    assert overall["run"] == "job" and overall["baseline"] == "pld" and overall["pairs_ok"] == 8
    assert overall["greedy_exact_match_rate"] == 1.0 and overall["job_text_matches"] is None
    js = json.loads(json.dumps(rep.to_json()))
    assert js["shadow_note"] is None
