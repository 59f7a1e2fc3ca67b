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


def test_docstring_examples():
    import doctest

    import racer_batch.published

    for mod in (bench, racer_batch.published):
        res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert res.attempted > 0 and res.failed == 0, mod.__name__


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
