"""benchmarks/rest_corpus.py: the REST corpus leaves the benchmark items out."""

from __future__ import annotations

import json

from benchmarks import rest_corpus


def test_rest_corpus_leaves_the_smoke_items_out(tmp_path):
    import gzip

    from racer_batch.benchdata import data_root, load_set, smoke_subset

    docs = rest_corpus.human_eval_docs(data_root())
    smoke = {it.item_id for it in smoke_subset(load_set("human_eval"))}
    with gzip.open(data_root() / "human_eval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as fh:
        recs = {r["task_id"]: r for r in map(json.loads, fh)}
    assert len(docs) == len(recs) - len(smoke) > 0
    text = "\n".join(docs)
    assert all(recs[t]["prompt"] not in text for t in smoke)
    mg = rest_corpus.mgsm_docs(data_root())
    assert len(mg) == 250 - 8
    smoke_q = [it.turns[0] for it in smoke_subset(load_set("mgsm_zh"))]
    assert not any(d.split("\n")[0] in smoke_q for d in mg)

