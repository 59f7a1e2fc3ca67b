"""Build a corpus for the REST drafter's static datastore without leaking the benchmark's own items.

    python -m benchmarks.rest_corpus --job-output out/specbench/racer-cpu-48 --out out/corpus/rest.jsonl
    racer-batch bench --methods rest,... --corpus out/corpus/rest.jsonl

Documents (JSONL, one ``{"text": ...}`` per line, the format DecodingConfig.corpus_path reads):

- Spec-Bench: earlier outputs of the same route, i.e. the answers of a finished racer-batch job over
  Spec-Bench (``--job-output``, e.g. the folder ``python -m benchmarks.specbench_job`` writes), each with
  its question;
- HumanEval: the prompt and canonical solution of each task;
- MGSM-ZH: the question and its answer.

Every item of the smoke subset of each set (the items `racer-batch bench` runs on; benchdata.smoke_subset) is
left out, so the datastore never holds a benchmark prompt or the model's answer to it. The corpus is written
under out/ (it derives from the shared data; never commit it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Optional

from benchmarks import common
from racer_batch.benchdata import data_root, load_set, smoke_subset


def smoke_ids(name: str, root: Path) -> set[str]:
    return {it.item_id for it in smoke_subset(load_set(name, root))}


def spec_bench_docs(job_output: Path | None, root: Path) -> list[str]:
    if job_output is None:
        return []
    from racer_batch.service.results.output import read_output

    questions = {}
    with open(root / "spec_bench" / "question.jsonl", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            questions[str(rec["question_id"])] = rec["turns"]
    skip = smoke_ids("spec_bench", root)
    docs = []
    for r in read_output(job_output).to_pylist():
        if r["status"] != "ok" or str(r["id"]) in skip or str(r["id"]) not in questions:
            continue
        answers = r.get("turn_texts") or [r.get("text") or ""]
        parts = []
        for q, a in zip(questions[str(r["id"])], answers):
            parts += [q, a or ""]
        docs.append("\n\n".join(p for p in parts if p))
    return docs


def human_eval_docs(root: Path) -> list[str]:
    skip = smoke_ids("human_eval", root)
    with gzip.open(root / "human_eval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh]
    return [r["prompt"] + r["canonical_solution"] for r in recs if r["task_id"] not in skip]


def mgsm_docs(root: Path) -> list[str]:
    skip = smoke_ids("mgsm_zh", root)
    return [f"{it.turns[0]}\n{it.references[0][0]}" for it in load_set("mgsm_zh", root) if it.item_id not in skip]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog("rest_corpus"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job-output", type=Path, default=None,
                    help="output folder of a finished Spec-Bench job (its answers become documents)")
    ap.add_argument("--out", type=Path, default=common.ROOT / "out" / "corpus" / "rest.jsonl",
                    help="corpus file to write (default: out/corpus/rest.jsonl)")
    ap.add_argument("--data", type=Path, default=None, help="the shared data folder (default: benchdata.data_root())")
    args = ap.parse_args(argv)
    root = args.data or data_root()
    if args.job_output is not None and not args.job_output.is_dir():
        ap.error(f"--job-output {args.job_output}: not a folder")
    parts = {"spec_bench": spec_bench_docs(args.job_output, root), "human_eval": human_eval_docs(root),
             "mgsm_zh": mgsm_docs(root)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        for docs in parts.values():
            for d in docs:
                fh.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)} documents" for k, v in parts.items()))
    if args.job_output is not None and not parts["spec_bench"]:
        print(f"warning: {args.job_output} gave no Spec-Bench answers (not a Spec-Bench job's output, or only "
              "smoke questions); the corpus has no earlier outputs of the route", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
