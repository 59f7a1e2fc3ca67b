"""benchmarks/host.py end to end on the tiny model: head only, one round, B = 2, 8 new tokens."""

from __future__ import annotations

import json

import pytest

from benchmarks import common, host


def test_parsers():
    assert host.parse_grid("tiny-random=8,1;smollm2-135m=2") == {"tiny-random": [1, 8], "smollm2-135m": [2]}
    assert host.parse_methods("racer-c4,ar") == [("racer-c4", "racer", 4), ("ar", "ar", 1)]
    assert host.parse_tokens("tiny-random=16", ["tiny-random", "smollm2-135m"], host.DEFAULT_TOKENS) == {
        "tiny-random": 16, "smollm2-135m": host.DEFAULT_TOKENS["smollm2-135m"]}
    assert [host.prompts_for(b, 16) for b in (1, 8, 16, 32, 64)] == [10, 16, 24, 40, 72]
    for bad in ("tiny-random", "tiny-random=0", "x=a"):
        with pytest.raises(ValueError):
            host.parse_grid(bad)
    with pytest.raises(ValueError):
        host.parse_methods("racer-c0")


def test_host_smoke_on_the_tiny_model(tmp_path):
    """Each setting in its own child process on this checkout: the host time, its parts and the tokens."""
    rc = host.main(["--no-base", "--grid", "tiny-random=2", "--methods", "racer-c4,ar", "--max-new-tokens", "8",
                          "--rounds", "1", "--max-prompts", "1", "--out", str(tmp_path), "--tag", "smoke"])
    assert rc == 0
    (jpath,) = tmp_path.glob("host-*-smoke.json")
    d = json.loads(jpath.read_text())
    assert set(d["revisions"]) == {"head"} and d["settings"]["rounds_done"] == 1
    assert {(r["setting"], r["streams"]) for r in d["rows"]} == {("racer-c4", 2), ("ar", 2)}
    for raw in d["raw"]:
        run, dv = raw["run"], raw["derived"]
        assert run["output_tokens"] > 0 and run["stream_steps"] > 0 and run["prompts"] == 10
        assert dv["host_us"] > 0 and dv["tokens_per_s"] > 0
        named = {p: v for p, v in dv["parts_us"].items() if p != "other"}
        assert set(host.PARTS) <= set(named), named
        assert all(v >= 0 for v in named.values())
        # the named parts fit in the host time of their run (the tolerance: timer granularity, wrapping correction)
        assert dv["split_host_us"] > 0
        assert sum(named.values()) <= dv["split_host_us"] * 1.05 + 5.0
        assert abs(sum(dv["parts_us"].values()) - dv["split_host_us"]) < 1e-6 * max(1.0, dv["split_host_us"])
        assert run["forward_ms"].get("prefill", 0) > 0
    md = tmp_path.joinpath(jpath.name.replace(".json", ".md")).read_text()
    assert "| tiny-random | racer-c4 | 2 |" in md and f"Machine: {common.machine_line(d['machine'])}" in md
    assert d["command"].startswith("python -m benchmarks.host --no-base ")
    # every child ran on this checkout's racer_batch, in its own process
    assert {c["racer_batch"] for c in d["children"]} == {str(common.ROOT / "racer_batch")}


def test_a_two_revision_report_has_each_ratio_column():
    """The base-vs-head report (no child processes: two revisions' derived figures made up here) carries a
    head/base column for the host time, the host time less the scores and tokens/s, each the median of the
    per-round ratios."""
    def derived(host, scores, tps):
        return {"host_us": host, "host_ex_us": host - scores, "host_share": 0.1, "forward_ms_per_step": 1.0,
                "streams_per_step": 2.0, "tokens_per_s": tps, "mat": 1.2, "wrap_us": 0.0, "split_host_us": host,
                "parts_us": {"propose": 1.0, "scores": scores, "other": host - 1.0 - scores}, "split": "own",
                "headline": "own split"}

    raw = [{"model": "tiny-random", "setting": "ar", "streams": 2, "revision": rev, "round": rnd,
            "derived": derived(host, scores, tps)}
           for rnd in (0, 1)
           for rev, host, scores, tps in (("base", 200.0, 20.0, 100.0), ("head", 50.0 + rnd * 10, 10.0, 300.0))]
    rows = host.summarize(raw)
    (row,) = rows
    assert row["host_ratio"] == pytest.approx((50 / 200 + 60 / 200) / 2)
    assert row["host_ex_ratio"] == pytest.approx((40 / 180 + 50 / 180) / 2)
    assert row["tokens_ratio"] == pytest.approx(3.0)
    cols, cells = host.summary_table(rows, ["base", "head"])
    assert [c for c in cols if c.endswith("head/base")] == [
        "host µs/ss head/base", "host ex-scores µs/ss head/base", "tokens/s head/base"]
    line = dict(zip(cols, cells[0]))
    assert line["host ex-scores µs/ss head/base"] == f"{(40 / 180 + 50 / 180) / 2:.3f}"
    assert line["base host ex-scores µs/ss"] == "180.0"


def test_a_child_refuses_a_racer_batch_from_elsewhere(tmp_path):
    """A child told that its revision is in a folder ``racer_batch`` was not imported from stops before
    measuring (it would time the wrong revision)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"src": str(tmp_path), "threads": 1}))
    with pytest.raises(SystemExit, match="not from the revision's folder"):
        host.main(["--child", str(spec)])
