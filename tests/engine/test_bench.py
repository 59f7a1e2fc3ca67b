"""`racer-batch bench` pieces: method/variant parsing, capability counters, set pooling and the published table."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import racer_batch.bench as bench
from racer_batch.benchdata import BenchPrompt
from racer_batch.cli import main
from racer_batch.published import published
from tests.helpers import tiny_bundle


def _plain(turns, answers, system_prompt=None, chat=True):
    """A plain-text conversation the character tokenizer can encode (it has no chat template)."""
    parts = []
    for i, t in enumerate(turns):
        parts.append(t)
        if i < len(answers):
            parts.append(answers[i])
    return " ".join(parts).lower()


ITEMS = [
    BenchPrompt("spec_bench", "multi_turn", "81", ("write a poem about rain", "now make it shorter")),
    BenchPrompt("spec_bench", "math_reasoning", "441", ("what is 3 + 4 ?",), (("steps\n#### 7",),)),
    BenchPrompt("human_eval", "human_eval", "HumanEval/0", ("def add(a, b): return a + b",)),
    BenchPrompt("mgsm_zh", "mgsm_zh", "0", ("1 + 1 = ?",), (("2",),)),
]


def test_parse_method_and_errors():
    assert bench.parse_method("pld") == bench.MethodSpec("pld", "pld", ())
    s = bench.parse_method("r8=racer:capacity=8, acceptance=topk ,relaxed_topk=3")
    assert (s.label, s.method, s.overrides) == ("r8", "racer", (("capacity", "8"), ("acceptance", "topk"),
                                                                 ("relaxed_topk", "3")))
    cfg = bench.decoding_config(s, capacity=16)
    assert (cfg.capacity, cfg.acceptance, cfg.relaxed_topk) == (8, "topk", 3)
    for bad in ("nope", "x=nope", "x=racer:capacity", "x=racer:colour=red", "x=hf_pld:capacity=4", "=racer",
                "x=racer:method=ar", "x=racer:capacity=8,capacity=16"):
        with pytest.raises(ValueError):
            bench.parse_method(bad)


def test_corpus_goes_to_rest_rows_only(tmp_path):
    corpus = str(tmp_path / "c.jsonl")
    assert bench.decoding_config(bench.parse_method("rest"), capacity=16, corpus=corpus).corpus_path == corpus
    assert bench.decoding_config(bench.parse_method("sam"), capacity=16, corpus=corpus).corpus_path is None
    assert bench.decoding_config(bench.parse_method(f"s=sam:corpus_path={corpus}"), capacity=16).corpus_path == corpus


def test_capability_counters():
    t = bench.AnswerQuality()
    t.observe_answer([1, 2, 3, 4, 1, 2, 3, 4], "so the answer is 7", ("#### 7",))
    t.observe_answer([5, 6], "no number", ("2",))
    t.observe_answer([5, 6, 7, 8], "free text", ())  # no reference: not scored
    t.observe_answer([5, 6, 7, 8], "x", ("a reference far too long to be any kind of short answer here",))
    assert (t.correct, t.scored) == (1, 2)
    assert t.repeat_n == 3 and t.repeat_sum == pytest.approx(0.2)  # [1..4]*2: 5 4-grams, 4 distinct


@pytest.fixture(scope="module")
def result():
    mp = pytest.MonkeyPatch()
    mp.setattr(bench, "conversation", _plain)
    try:
        res = bench.run_bench(tiny_bundle(seed=3), methods=["hf_pld", "ar", "racer", "r4=racer:capacity=4",
                                                             "top2=racer:acceptance=topk,relaxed_topk=2"],
                              capacity=16, max_new_tokens=12, items=ITEMS)
    finally:
        mp.undo()
    return res


def test_run_bench_rows_and_exactness(result):
    s = bench.summarize(result)
    assert list(s["overall"]) == ["hf_greedy", "hf_pld", "ar", "racer", "r4", "top2"]
    assert s["method_configs"]["r4"]["capacity"] == 4 and s["method_configs"]["top2"]["acceptance"] == "topk"
    for label in ("hf_pld", "ar", "racer", "r4"):  # lossless rows reproduce HF greedy token for token
        assert s["overall"][label]["exact_match_vs_hf_greedy"] == "5/5"
    assert s["overall"]["ar"]["mat"] == 1.0
    assert s["overall"]["racer"]["answer_accuracy"].endswith("/2")  # two scorable turns (#### 7 and 2)
    assert s["overall"]["racer"]["answer_accuracy"] == s["overall"]["hf_greedy"]["answer_accuracy"]
    # set pooling: spec_bench pools its two groups
    sb = s["sets"]["spec_bench"]["racer"]
    assert sb["rows"] == 3 and sb["tokens"] == sum(s["groups"][g]["racer"]["tokens"] for g in
                                                   ("spec_bench/multi_turn", "spec_bench/math_reasoning"))


def test_published_table_and_markdown(result, tmp_path):
    s = bench.summarize(result)
    pub = {(r["label"], r["set"]): r for r in s["published"]}
    assert (pub[("racer", "mgsm_zh")]["published_mat"], pub[("racer", "mgsm_zh")]["published_speedup"]) == \
        published("mgsm_zh", "racer") == (3.71, 2.77)
    assert pub[("racer", "human_eval")]["mat"] == s["sets"]["human_eval"]["racer"]["mat"]
    assert ("r4", "spec_bench") not in pub  # variants carry no paper figure
    jpath, mpath = bench.write_results(s, tmp_path, command="racer-batch bench (test)")
    md = mpath.read_text()
    assert "## Beside the published figures" in md
    section = md.split("## Beside the published figures", 1)[1]
    racer_line = next(line for line in section.splitlines() if line.startswith("| racer |"))
    assert "3.00 / " in racer_line and "3.71 / " in racer_line and "2.77x / " in racer_line
    assert "| r4 | - / " in section
    assert json.loads(jpath.read_text())["sets"]["mgsm_zh"]["racer"]["rows"] == 1


def test_cli_rejects_bad_variants():
    r = CliRunner().invoke(main, ["bench", "--variant", "x=racer:capacity=0"])
    assert r.exit_code == 2 and "--variant" in r.output and "capacity" in r.output
    r = CliRunner().invoke(main, ["bench", "--variant", "x=racer:capacity=abc"])
    assert r.exit_code == 2 and "capacity = 'abc'" in r.output and "capacity.int" not in r.output
    r = CliRunner().invoke(main, ["bench", "--variant", "x=nosuch"])
    assert r.exit_code == 2 and r.output.count("x=nosuch") == 1
    r = CliRunner().invoke(main, ["bench", "--variant", "racer=pld"])
    assert r.exit_code == 2 and "unique" in r.output
    r = CliRunner().invoke(main, ["bench", "--methods", "racer,racer"])
    assert r.exit_code == 2 and "--methods" in r.output and "unique" in r.output


def test_markdown_marks_relaxed_variants_and_defines_columns(result, tmp_path):
    _, mpath = bench.write_results(bench.summarize(result), tmp_path, command="racer-batch bench (test)")
    md = mpath.read_text()
    head = md.split("## Overall", 1)[0]
    assert "- `r4`: racer with capacity=4" in head
    assert "- `top2`: racer with acceptance=topk, relaxed_topk=2 (**relaxed acceptance" in head
    assert "- `racer`" not in head and "- `ar`" not in head  # plain rows are not variants
    assert "repeat4: mean repeated 4-gram rate" in md and "- answer_accuracy: " in md
    assert "## Spec-Bench (groups pooled)" in md and "## HumanEval (groups pooled)" not in md


def _script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docstring_examples():
    import doctest

    import racer_batch.published

    for mod in (bench, racer_batch.published):
        res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert res.attempted > 0 and res.failed == 0, mod.__name__


def test_capacity_vs_relaxed_reading():
    cvr = _script("capacity_vs_relaxed")
    names = cvr.variants([8, 16, 64], 16, 2, 0.1)
    assert names[0] == "lossless-c64=racer:capacity=64" and names.count("lossless-c64=racer:capacity=64") == 1
    assert all(bench.parse_method(n).method == "racer" for n in names)

    def rows(**s):
        return {k.replace("_", "-"): {"speedup_vs_hf_greedy": v} for k, v in s.items()}

    a = cvr.analyse(rows(lossless_c64=1.0, lossless_c16=1.3, top2_c64=1.2, top2_c16=1.4))
    assert (a["best_lossless"], a["best_relaxed"]) == ("lossless-c16", "top2-c16")
    assert a["share"] == pytest.approx(0.75) and a["verdict"].startswith("reproduced")
    a = cvr.analyse(rows(lossless_c64=1.0, lossless_c16=1.05, top2_c64=1.5))
    assert a["share"] == pytest.approx(0.1) and a["verdict"].startswith("refuted")
    a = cvr.analyse(rows(lossless_c64=1.0, lossless_c16=1.05, top2_c64=0.9))
    assert a["share"] is None


def test_rest_corpus_leaves_the_smoke_items_out(tmp_path):
    import gzip

    from racer_batch.benchdata import data_root, load_set, smoke_subset

    build = _script("build_rest_corpus")
    docs = build.human_eval_docs(data_root())
    smoke = {it.item_id for it in smoke_subset(load_set("human_eval"))}
    with gzip.open(data_root() / "human_eval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as fh:
        recs = {r["task_id"]: r for r in map(json.loads, fh)}
    assert len(docs) == len(recs) - len(smoke) > 0
    text = "\n".join(docs)
    assert all(recs[t]["prompt"] not in text for t in smoke)
    mg = build.mgsm_docs(data_root())
    assert len(mg) == 250 - 8
    smoke_q = [it.turns[0] for it in smoke_subset(load_set("mgsm_zh"))]
    assert not any(d.split("\n")[0] in smoke_q for d in mg)


def test_sample_by_group_picks_the_same_items_as_the_whole_set():
    from racer_batch.benchdata import parse_sample, sample_prompts

    assert parse_sample("spec_bench/qa=3, human_eval=2") == {"spec_bench/qa": 3, "human_eval": 2}
    for bad in ("spec_bench/=3", "specbench/qa=3", "spec_bench/qa=0", "spec_bench/qa"):
        with pytest.raises(ValueError):
            parse_sample(bad)
    whole = [p for p in sample_prompts({"spec_bench": 4}) if p.group == "rag"]
    only = sample_prompts({"spec_bench/rag": 4})
    assert [p.item_id for p in only] == [p.item_id for p in whole] and len(only) == 4
    with pytest.raises(ValueError, match="no group"):
        sample_prompts({"spec_bench/nope": 2})


def test_merge_bench_pools_token_weighted():
    merge = _script("merge_bench")

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


@pytest.fixture(scope="module")
def throughput():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "throughput_bench.py"
    spec = importlib.util.spec_from_file_location("throughput_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["throughput_bench"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


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
    md = jpath.with_suffix(".md").read_text()
    assert "Reproduce: `python scripts/throughput_bench.py --smoke" in md and "**Lossless: 0 mismatches**" in md
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
    items = throughput.pick_prompts(12)
    assert len(items) == 12 and len({it.item_id for it in items}) == 12
    assert items == throughput.pick_prompts(12)  # deterministic
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


def _kernel_ab():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "kernel_ab.py"
    spec = importlib.util.spec_from_file_location("kernel_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_ab_times_two_revisions_in_alternating_processes(tmp_path):
    """scripts/kernel_ab.py: HEAD (unpacked from git) against this checkout, attention only, one config: each
    revision's ms, the ratio, the commit each revision named, and the report files; bad configs refused."""
    from racer_batch.engine.kernels import cpu_ops
    kab = _kernel_ab()
    with pytest.raises(SystemExit) as bad:
        kab.main(["--base", "HEAD", "--configs", "4x0x3"])
    assert bad.value.code == 2
    if cpu_ops() is None:  # the children would fail the same way: the error says so
        with pytest.raises(RuntimeError, match="failed"):
            kab.main(["--base", "HEAD", "--configs", "1x16x2", "--rounds", "1", "--repeats", "1", "--no-verify",
                      "--out", str(tmp_path)])
        return
    assert kab.main(["--base", "HEAD", "--configs", "1x16x2,2x8x1", "--rounds", "2", "--repeats", "1",
                     "--no-verify", "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("kernel-ab-*.json")
    d = json.loads(js.read_text())
    assert [r["config"] for r in d["rows"]] == ["1x16x2", "2x8x1"] and all(r["what"] == "attention" for r in d["rows"])
    assert all(r["base_ms"] > 0 and r["head_ms"] > 0 and r["head_over_base"] > 0 for r in d["rows"])
    assert d["base"].startswith("HEAD (") and d["head"].startswith("WORKTREE (at ") and len(d["raw"]) == 2
    assert "| attention | 1x16x2 |" in js.with_suffix(".md").read_text()
