"""Capability beside speed (issue 8): references carried into shadow records, accuracy / length / repetition
per side, the relaxed-acceptance statement, old shadow files without the reference column."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from report_fixtures import finished_job

from racer_batch.capability import answer_correct, repeated_ngram_rate, text_units
from racer_batch.cli import main
from racer_batch.report.aggregate import OVERALL
from racer_batch.report.build import build_report, render_html, render_md, write_report
from racer_batch.report.load import load_output
from racer_batch.report.shadow import acceptance_rule, analyze
from racer_batch.report.shadow_run import run_posthoc_shadow
from racer_batch.service.execution.runner import RowRunner
from racer_batch.service.results.shadow import SHADOW_SCHEMA, read_shadow, shadow_path, write_shadow
from tests.helpers import tiny_bundle

TOPK2 = {"method": "racer", "acceptance": "topk", "relaxed_topk": 2}


def _rec(row_idx, side, *, texts, tok, reference=None, temp=0.0, finish="eos", route="a", run="job"):
    return {"run": run, "job_id": "j", "id": f"r{row_idx}", "row_idx": row_idx, "route": route, "side": side,
            "method": "racer" if side == "method" else "ar", "status": "ok", "text": texts[-1],
            "turn_texts": list(texts), "output_tokens": tok, "steps": tok, "prefill_ms": 0.0, "decode_ms": 10.0 * tok,
            "temperature": temp, "finish_reason": finish, "reference": reference}


def _pair(row_idx, m_texts, b_texts, *, m_tok, b_tok, reference=None, **kw):
    m_finish = kw.pop("m_finish", "eos")
    return [_rec(row_idx, "method", texts=m_texts, tok=m_tok, reference=reference, finish=m_finish, **kw),
            _rec(row_idx, "baseline", texts=b_texts, tok=b_tok, reference=reference, **kw)]


LONG_REF = "The quick brown fox jumps over the lazy dog " * 3  # 27 words: not scored


def _records():
    return [
        # r0: numeric reference, both sides right and equal
        *_pair(0, ["She earns 9 * 2 = 18 dollars."], ["She earns 9 * 2 = 18 dollars."], m_tok=10, b_tok=10,
               reference=["18"]),
        # r1: GSM8K-style worked reference (answer after ####, thousands comma): method wrong, baseline right
        *_pair(1, ["The total is 999."], ["The total is 1,000."], m_tok=6, b_tok=8,
               reference=["Half of 2000 is 1000.\n#### 1,000"]),
        # r2: short text reference, found in the method's answer (case folded), not in the baseline's
        *_pair(2, ["Then you are in second place now."], ["You are first."], m_tok=8, b_tok=4,
               reference=["You are in second place."]),
        # r3: a long reference is not scored; the answers are equal
        *_pair(3, ["A summary."], ["A summary."], m_tok=3, b_tok=3, reference=[LONG_REF]),
        # r4: multi-turn, reference for the second turn only
        *_pair(4, ["hello", "so it is 42"], ["hello", "so it is 41"], m_tok=12, b_tok=12, reference=[None, "42"]),
        # r5: sampled, no reference; the method side loops
        *_pair(5, ["the cat sat the cat sat the cat sat"], ["one two three four five"], m_tok=21, b_tok=13,
               temp=0.8, m_finish="length"),
    ]


def test_capability_per_side_by_hand():
    res = {r.route: r.to_dict(n_boot=50) for r in analyze(_records(), decoding=TOPK2)}
    cap = res["a"]["capability"]
    assert res[OVERALL]["capability"] == cap  # one route
    assert cap["pairs"] == 6
    assert cap["exact_match_rate"] == pytest.approx(2 / 6)  # r0 and r3 equal; sampled r5 counts too
    assert cap["turns"] == 7 and cap["turns_with_reference"] == 5  # r0, r1, r2, r3 (long), r4 turn 1
    m, b = cap["method"], cap["baseline"]
    # scored: r0, r1, r2, r4 turn 1 (r3's reference is too long, r4 turn 0 and r5 have none)
    assert (m["correct"], m["scored"], m["accuracy"]) == (3, 4, 0.75)  # r0, r2, r4 right; r1 wrong (999)
    assert (b["correct"], b["scored"], b["accuracy"]) == (2, 4, 0.5)  # r0, r1 right
    assert m["mean_tokens"] == pytest.approx((10 + 6 + 8 + 3 + 12 + 21) / 6)
    assert b["mean_tokens"] == pytest.approx((10 + 8 + 4 + 3 + 12 + 13) / 6)
    assert m["mean_chars"] == pytest.approx((29 + 17 + 33 + 10 + 5 + 11 + 35) / 6)
    # repetition per answer turn with >= 4 text units: all 0 except r5's method loop, 1 - 3/6 = 0.5;
    # r3 (3 units) and r4 turn 0 (1 unit) are left out -> mean over 5 turns
    assert m["repeated_ngram_rate"] == pytest.approx(0.5 / 5)
    assert b["repeated_ngram_rate"] == 0.0
    assert m["finish"] == {"eos": 5, "length": 1} and b["finish"] == {"eos": 6}
    assert res["a"]["relaxed"] is True and "2 most likely" in res["a"]["acceptance_rule"]
    # the same records without a relaxed decoding config: lossless, no rule
    plain = analyze(_records(), decoding={"method": "racer"})[0].to_dict(n_boot=10)
    assert plain["relaxed"] is False and plain["acceptance_rule"] is None


def test_capability_without_references_and_without_pairs():
    recs = [{**r, "reference": None} for r in _records()]
    cap = analyze(recs)[0].to_dict(n_boot=10)["capability"]
    assert cap["turns_with_reference"] == 0
    assert cap["method"]["scored"] == 0 and cap["method"]["accuracy"] is None
    assert cap["method"]["mean_tokens"] is not None  # length and repetition need no reference
    errored = [dict(r, status="error") if r["side"] == "method" else r for r in _records()]
    assert analyze(errored)[0].to_dict(n_boot=10)["capability"] is None  # no ok pair


def test_acceptance_rule_threshold_and_unknown():
    assert acceptance_rule(None) is None and acceptance_rule({"acceptance": "lossless"}) is None
    assert acceptance_rule({"acceptance": "threshold", "relaxed_threshold": 0.25}).endswith(">= 0.25")


def _old_schema() -> pa.Schema:
    return pa.schema([f for f in SHADOW_SCHEMA if f.name != "reference"])


def test_old_shadow_file_without_reference_column_loads(tmp_path):
    old_recs = [{k: v for k, v in r.items() if k != "reference"} for r in _records()[:8]]  # rows 0-3
    table = pa.Table.from_pydict({n: [r.get(n) for r in old_recs] for n in _old_schema().names}, schema=_old_schema())
    pq.write_table(table, shadow_path(tmp_path, "00000"))
    new = write_shadow(shadow_path(tmp_path, "00001"), _records()[8:])  # rows 4-5
    assert "reference" in pq.read_schema(new).names
    sh = read_shadow(tmp_path)
    assert sh.schema.equals(SHADOW_SCHEMA) and sh.num_rows == 12
    refs = {(r["row_idx"], r["side"]): r["reference"] for r in sh.to_pylist()}
    assert refs[(0, "method")] is None and refs[(4, "method")] == [None, "42"]
    cap = analyze(sh.to_pylist())[0].to_dict(n_boot=10)["capability"]
    assert cap["pairs"] == 6 and cap["method"]["scored"] == 1  # only r4 (new file) has a reference


# ---- through the service: references reach the shadow records (stand-in engine)
def _finished_job(tmp_path, rows, **kw):
    return finished_job(tmp_path, rows, job_id="job-c", **kw)


def test_reference_column_reaches_in_job_and_posthoc_shadow_records(tmp_path):
    rows = [{"id": "n", "prompt": "how much?", "turns": None, "gold": ["18"]},
            {"id": "l", "prompt": "and now?", "turns": None, "gold": None},
            {"id": "m", "prompt": None, "turns": ["one", "two"], "gold": [None, "#### 7"]},
            {"id": "x", "prompt": None, "turns": ["one", "two"], "gold": ["too", "many", "entries"]}]  # dropped
    spec = _finished_job(tmp_path, rows, **{"input.columns.reference": "gold", "shadow.config": "ar",
                                            "shadow.fraction": 1.0})
    got = {(r["id"], r["side"]): r["reference"] for r in read_shadow(spec.output.path).to_pylist()}
    assert got == {(i, s): ref for i, ref in (("n", ["18"]), ("l", None), ("m", [None, "#### 7"]), ("x", None))
                   for s in ("method", "baseline")}
    rep = build_report(load_output(spec.output.path), n_boot=20)
    cap = [s for s in rep.shadow if s["route"] == OVERALL][0]["capability"]
    assert cap["turns_with_reference"] == 2 and cap["method"]["scored"] == 2
    path, n = run_posthoc_shadow(load_output(spec.output.path), baseline="ar", fraction=1.0)
    post = {(r["id"], r["side"]): r["reference"] for r in pq.read_table(path).to_pylist()}
    assert n == 4 and post == got
    res = CliRunner().invoke(main, ["shadow", spec.output.path, "--baseline", "ar", "--fraction", "1"])
    assert res.exit_code == 0, res.output
    assert "(2 scored turns)" in res.stderr and "relaxed" not in res.stderr


# ---- end to end: relaxed acceptance with a lossless shadow on a tiny random model, then the report
PROMPTS = ["abcabcabd", "hello world, hello", "0123012301", "the cat sat on the mat. the cat"]


def test_relaxed_job_report_shows_capability_beside_speed(tmp_path):
    rows = [{"id": f"q{i}", "prompt": p, "reference": ref}
            for i, (p, ref) in enumerate(zip(PROMPTS, ["18", "Half is 6.\n#### 12", "abc", None]))]
    bundle = tiny_bundle()  # character tokenizer, no chat template: raw prompts
    runner = RowRunner(worker_name="t", loader=lambda model, **kw: bundle)
    spec = _finished_job(tmp_path, rows, runner=runner, **{
        "model.name": "tiny-test", "input.prompt_format": "raw", "generation.max_new_tokens": 30,
        "decoding.method": "racer", "decoding.capacity": 16, "decoding.acceptance": "topk",
        "decoding.relaxed_topk": 2, "shadow.config": {"method": "racer", "capacity": 16}, "shadow.fraction": 1.0})
    data = load_output(spec.output.path)
    recs = data.shadow.to_pylist()
    assert len(recs) == 8 and {r["side"] for r in recs} == {"method", "baseline"}
    rep = build_report(data, n_boot=50)
    overall = [s for s in rep.shadow if s["route"] == OVERALL][0]
    assert overall["relaxed"] is True and overall["baseline"] == "racer"
    cap = overall["capability"]
    # recompute from the records: three rows have a scorable reference (q3 has none)
    side = {s: {r["id"]: r for r in recs if r["side"] == s} for s in ("method", "baseline")}
    for s in ("method", "baseline"):
        scores = [answer_correct(side[s][f"q{i}"]["text"], ref) for i, ref in
                  enumerate(["18", "Half is 6.\n#### 12", "abc"])]
        assert cap[s]["scored"] == 3 and cap[s]["correct"] == sum(scores)
        reps = [repeated_ngram_rate(text_units(side[s][f"q{i}"]["text"])) for i in range(4)]
        reps = [x for x in reps if x is not None]
        assert cap[s]["repeated_ngram_rate"] == pytest.approx(sum(reps) / len(reps))
        assert cap[s]["mean_tokens"] == pytest.approx(sum(r["output_tokens"] for r in side[s].values()) / 4)
    equal = sum(side["method"][i]["text"] == side["baseline"][i]["text"] for i in side["method"])
    assert cap["exact_match_rate"] == equal / 4 < 1.0  # top-2 acceptance changed some answers of this model

    md = render_md(rep)
    assert "### Capability beside speed" in md
    assert "outputs differ by design" in md and "among the target's 2 most likely tokens" in md
    line = [ln for ln in md.splitlines() if ln.startswith("| job | all | relaxed | 4 |")]
    assert len(line) == 1 and f"| {100 * equal / 4:.0f}% |" in line[0]
    assert f"({cap['method']['correct']}/3)" in line[0]
    html = render_html(rep)
    assert "Capability beside speed" in html and "outputs differ by design" in html
    write_report(rep, tmp_path / "rep", formats=("json",))
    js = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [s["capability"] for s in js["shadow"]] == [s["capability"] for s in rep.shadow]
    assert all(s["relaxed"] and "top" in s["acceptance_rule"] for s in js["shadow"])
    assert any("relaxed acceptance" in ln for ln in rep.summary_lines())
    assert "Relaxed acceptance (" in md.split("## Per", 1)[0] and "Relaxed acceptance (" in html

    # the same job without its shadow rows (an older job whose sample picked none): the header still says
    # relaxed, and the summary says the capability cost was not measured
    for f in Path(spec.output.path).glob("_shadow-*.parquet"):
        f.unlink()
    bare = build_report(load_output(spec.output.path), n_boot=10, with_charts=False)
    assert not bare.shadow and "Relaxed acceptance (" in render_md(bare).split("## Per", 1)[0]
    assert any("NO shadow rows: the capability cost was not measured" in ln for ln in bare.summary_lines())
