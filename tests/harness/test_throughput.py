"""benchmarks/throughput.py: tokens/s of one actor with B streams, on the tiny model."""

from __future__ import annotations

import json

import pytest

from benchmarks import common
from benchmarks import throughput as throughput_module
from tests.helpers import tiny_bundle


@pytest.fixture(scope="module")
def throughput():
    return throughput_module


def test_throughput_bench_smoke_on_a_tiny_model(throughput, tmp_path):
    """--smoke on a tiny model: both files written, every contender measured, zero mismatches."""
    import torch

    prompts = ["abcabcabd hello world, hello", "the cat sat on the mat. the cat " * 5, "xyz q", "0123012301 0123"]
    rc = throughput.main(["--smoke", "--prompts", "3", "--threads", str(torch.get_num_threads()),
                          "--racer-capacities", "auto,8", "--out", str(tmp_path)],
                         bundle=tiny_bundle(seed=1, head_scale=60.0), prompts=prompts)
    assert rc == 0
    (jpath,) = tmp_path.glob("throughput-*.json")
    d = json.loads(jpath.read_text())
    assert d["lossless"]["mismatches"] == 0 and d["lossless"]["compared"] == 3 * 10
    # 3 rows x (ar@B2 vs ar@B1; each other setting at B1 vs ar@B1, at B2 vs its B1 and vs ar@B1)
    assert d["settings"]["streams"] == [1, 2] and d["settings"]["rounds_done"] == 1
    assert d["settings"]["max_new_tokens"] == 16 and d["settings"]["prompts"] == 3
    rows = {r["contender"]: r for r in d["rows"]}
    assert set(rows) == {f"{s}@B{b}" for s in ("ar", "pld", "racer-auto", "racer-c8") for b in (1, 2)}
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["mismatches"] == 0 and r["output_tokens"] > 0
        assert r["ratio_to_b1"] == (1.0 if r["streams"] == 1 else r["ratio_to_b1"])
    assert rows["ar@B1"]["ratio_to_ar_b1"] == 1.0 and rows["ar@B1"]["mat"] == 1.0
    assert rows["ar@B2"]["streams_per_forward"] > 1.0 and rows["ar@B1"]["streams_per_forward"] == 1.0
    # racer's rows end at different steps, so the third prompt joins while another stream is in flight at
    # B=2: its prefill stalls that stream; alone (B=1) nothing waits
    assert d["runs"]["racer-c8@B2"][0]["stall_ms"] > 0 and rows["racer-c8@B2"]["stall_share"] > 0
    assert all(r["stall_share"] == 0 for r in rows.values() if r["streams"] == 1)
    assert rows["racer-auto@B2"]["tuner_capacity"] in d["engines"]["racer-auto"]["auto_candidates"]
    assert rows["racer-c8@B1"]["tuner_capacity"] is None
    # the rows are the product's records of one job: the run's MAT is their Tally's, the summary's its median
    assert d["run_id"] == "throughput-" + d["stamp"] and d["machine"]["cpu"] and d["machine"]["torch_threads"] >= 1
    for label, (one,) in d["runs"].items():
        assert one["mat"] == round(one["output_tokens"] / one["row_steps"], 3) == rows[label]["mat"]
    md = jpath.with_suffix(".md").read_text()
    assert "Reproduce: `python -m benchmarks.throughput --smoke" in md and "**Lossless: 0 mismatches**" in md
    assert f"Machine: {common.machine_line(d['machine'])}, torch " in md
    assert "| racer-c8 | 8 | 2 |" in md and "- mismatches: " in md
    # decode only: the prefills' time left out, so at least the whole-run rate
    for r in rows.values():
        assert r["decode_tokens_per_s"] >= r["tokens_per_s"] and r["decode_ratio_to_b1"] is not None
    run = d["runs"]["racer-c8@B2"][0]
    want = run["output_tokens"] / (run["wall_s"] - run["prefill_ms"] / 1000.0)
    assert rows["racer-c8@B2"]["decode_tokens_per_s"] == pytest.approx(want, rel=0.02)  # the JSON rounds to us
    # --resummarize: a file written before the decode columns gets them from its runs, nothing else changes
    old = json.loads(jpath.read_text())
    for r in old["rows"]:
        del r["decode_tokens_per_s"], r["decode_ratio_to_b1"]
    jpath.write_text(json.dumps(old))
    assert "decode x B=1" in md and throughput.main(["--resummarize", str(jpath)]) == 0
    again = json.loads(jpath.read_text())
    assert again["runs"] == d["runs"] and again["lossless"] == d["lossless"]
    assert [r["contender"] for r in again["rows"]] == [r["contender"] for r in d["rows"]]
    for a, b in zip(again["rows"], d["rows"]):  # recomputed from the JSON's rounded runs
        assert set(a) == set(b) and a["mismatches"] == b["mismatches"] == 0 and a["tokens_per_s"] == b["tokens_per_s"]
        assert a["decode_tokens_per_s"] == pytest.approx(b["decode_tokens_per_s"], rel=0.02)
    assert "recomputed" in jpath.with_suffix(".md").read_text()
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a throughput"):
        throughput.resummarize(tmp_path / "x.json")


def test_throughput_bench_counts_mismatches_and_ratios(throughput):
    S = throughput.Setting
    settings = [S("ar", "ar", 1), S("racer-c8", "racer", 8)]
    good = [[1, 2, 3], [4, 5]]
    outputs = {"ar@B1": good, "ar@B4": good, "racer-c8@B1": good, "racer-c8@B4": [[1, 2, 3], [4, 6]]}
    bad, compared = throughput.compare_round(outputs, settings, [1, 4])
    # racer-c8@B4 row 1 differs from both its B=1 output and ar's
    assert [(x["contender"], x["reference"], x["row"], x["position"]) for x in bad] == [
        ("racer-c8@B4", "racer-c8@B1", 1, 1), ("racer-c8@B4", "ar@B1", 1, 1)]
    assert compared == 2 * (1 + 1 + 2)  # ar@B4, racer-c8@B1 vs ar, racer-c8@B4 vs both; 2 rows each
    _, partial = throughput.compare_round({"racer-c8@B1": good, "racer-c8@B4": good}, settings, [1, 4])
    assert partial == 2  # ar not run yet: only racer-c8@B4 vs its B=1
    assert throughput.per_round_ratios({"a": [4.0, 3.0], "b": [2.0, 1.0]}, "a", "b") == [2.0, 3.0]
    order = throughput.settings_of(["pld", "racer"], ["auto", 4])
    assert [s.label for s in order] == ["pld", "racer-auto", "racer-c4"] and order[0].capacity == 11
    with pytest.raises(ValueError):
        throughput.settings_of(["nope"], [4])
    import doctest

    res = doctest.testmod(throughput)
    assert res.attempted > 0 and res.failed == 0


def test_throughput_bench_prompts_alternate_short_and_long(throughput):
    """The prompts ``main`` decodes by default: ``common.spec_bench_prompts``, with their item ids as row ids."""
    items = common.spec_bench_prompts(12)
    assert len(items) == 12 and len({it.item_id for it in items}) == 12
    assert items == common.spec_bench_prompts(12)  # deterministic
    prompts, ids, source = throughput.bench_prompts(12, None)
    assert ids == [it.item_id for it in items] and len(prompts) == 12 and source.startswith("Spec-Bench")
    assert throughput.bench_prompts(2, ["a", "b", "c"])[:2] == (["a", "b"], ["prompt-0", "prompt-1"])
    first = [len(it.turns[0]) for it in items[:6]]
    assert len({it.group for it in items[:6]}) == 6  # one per category before any repeats
    assert first[1] > first[0] and first[1] > first[2]  # short, long, short, ...


def test_throughput_bench_writes_partial_results_after_every_contender(throughput):
    S = throughput.Setting
    snaps = []
    d = throughput.run(tiny_bundle(seed=1, head_scale=60.0), ["abcabcabd", "hello world, hello"],
                       settings=[S("ar", "ar", 1), S("racer-c8", "racer", 8)], bs=[1, 2], max_new_tokens=8,
                       rounds=1, on_round=snaps.append)
    assert [s["settings"]["contenders_in_partial_round"] for s in snaps] == [1, 2, 3, 0]
    assert [s["settings"]["rounds_done"] for s in snaps] == [0, 0, 0, 1] and snaps[-1] is d
    assert [len(s["rows"]) for s in snaps] == [1, 2, 3, 4]
    assert [s["lossless"]["compared"] for s in snaps] == [0, 2, 4, 8] and d["lossless"]["mismatches"] == 0
    assert "**partial" in throughput.render_md(snaps[1]) and "**partial" not in throughput.render_md(d)


def test_throughput_bench_rows_are_the_products_records(throughput):
    """A contender's run is the product's records: one RowRecord per prompt (its id and index, the contender as
    route, the benchmark run as job), whose Tally gives the tokens, target forwards and MAT the module reports;
    the batch-level counts are the engine's BatchStats."""
    from racer_batch.engine import Engine
    from racer_batch.engine.batch import BatchStats
    from racer_batch.engine.engine import encode_prompt
    from racer_batch.service.results.record import RowOrigin, RowRecord
    from racer_batch.service.results.tally import Tally

    bundle = tiny_bundle(seed=1, head_scale=60.0)
    s = throughput.Setting("racer-c8", "racer", 8)
    engine = Engine(bundle, s.config(), streams=2)
    prompt_ids = [encode_prompt(bundle.tokenizer, p) for p in ["abcabcabd hello world, hello",
                                                                "the cat sat on the mat. the cat " * 3, "xyz q"]]
    origin = RowOrigin(id="", row_idx=0, route="racer-c8@B2", job_id="throughput-x", model=bundle.name,
                       method="racer")
    records, tokens, stats, extra = throughput.decode_all(engine, prompt_ids, streams=2, max_new_tokens=12,
                                                          origin=origin, ids=["p0", "p1", "p2"])
    assert all(type(r) is RowRecord for r in records) and type(stats) is BatchStats
    assert [(r.id, r.row_idx, r.shard, r.route, r.job_id, r.status, r.method, r.model) for r in records] == [
        (f"p{i}", i, None, "racer-c8@B2", "throughput-x", "ok", "racer", bundle.name) for i in range(3)]
    assert [r.output_tokens for r in records] == [len(t) for t in tokens] and all(tokens)
    assert all(r.prefill_ms > 0 and r.steps >= 1 and r.device_ms for r in records)  # B = 2: shares of forwards
    tally = Tally()
    for r in records:
        tally.observe_row(r)
    # every row's target forwards: its prefill and one per batched step it was in
    assert tally.steps == stats.prefills + stats.streams and stats.prefills == 3
    summary = throughput.run_summary(records, stats, extra)
    assert (summary["output_tokens"], summary["row_steps"], summary["mat"]) == (tally.output_tokens, tally.steps,
                                                                                tally.mat)
    assert (summary["forwards"], summary["stream_steps"], summary["prefill_ms"]) == (stats.steps, stats.streams,
                                                                                     stats.prefill_ms)
    assert summary["row_capacities"] == {"8": 3} and summary["tuner_choice"] is None
    (row,) = throughput.summarize({"racer-c8@B2": [summary]}, [s], [2])
    assert row["mat"] == round(tally.mat, 3) and row["output_tokens"] == tally.output_tokens
    assert throughput.rounded(summary)["mat"] == round(tally.mat, 3)


def test_throughput_bench_isas_side_by_side(throughput, tmp_path):
    """--isas runs every setting once per instruction set of our kernels: the first keeps the plain labels,
    outputs are identical across them (the AVX-512 code is bit-identical to the AVX2 code), and the machine's
    default set is back in force afterwards only through the next contender's own choice."""
    import torch

    from racer_batch.engine.kernels import cpu_ops

    S = throughput.Setting
    both = throughput.with_isas([S("ar", "ar", 1), S("racer-c8", "racer", 8)], ["avx512", "avx2"])
    assert [(s.label, s.isa) for s in both] == [("ar", "avx512"), ("racer-c8", "avx512"), ("ar-avx2", "avx2"),
                                               ("racer-c8-avx2", "avx2")]
    assert throughput.with_isas([S("ar", "ar", 1)], []) == [S("ar", "ar", 1)]
    ops = cpu_ops()
    if ops is None:
        with pytest.raises(SystemExit, match="not available"):
            throughput._use_isa("avx2")
        return
    old = ops.isa()
    try:
        isas = "avx512,avx2" if old == "avx512" else "avx2"
        rc = throughput.main(["--smoke", "--prompts", "2", "--methods", "ar,racer", "--racer-capacities", "8",
                              "--threads", str(torch.get_num_threads()), "--isas", isas, "--out", str(tmp_path)],
                             bundle=tiny_bundle(seed=1, head_scale=60.0), prompts=["abcabcabd hello", "xyz q xyz"])
        assert rc == 0
        (jpath,) = tmp_path.glob("throughput-*.json")
        d = json.loads(jpath.read_text())
        labels = {r["contender"] for r in d["rows"]}
        want = {"ar", "racer-c8"} | ({"ar-avx2", "racer-c8-avx2"} if old == "avx512" else set())
        assert labels == {f"{s}@B{b}" for s in want for b in (1, 2)}
        assert d["lossless"]["mismatches"] == 0
        with pytest.raises(SystemExit):
            throughput.main(["--smoke", "--isas", "sse", "--out", str(tmp_path)], bundle=tiny_bundle(seed=1),
                            prompts=["a b"])
    finally:
        ops.set_isa(old)

