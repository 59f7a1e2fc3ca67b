"""Pool several `racer-batch bench` result files into one token-weighted table.

A long benchmark can run as two processes at one torch thread each, one per prompt set (each process
interleaves its own contenders item by item, so every ratio inside a file is measured in one run). This
module adds them up: per method, tokens and wall milliseconds (tokens x ms_per_token) are summed over the
files, so the pooled speedup is the token-weighted one (docs/method.md section 1); MAT is pooled as tokens over
forwards (tokens / mat per file). The per-set and paper rows are copied from the files unchanged.

    python -m benchmarks.merge /tmp/b512a/bench-*.json /tmp/b512b/bench-*.json --out benchmarks

Writes benchmarks/bench-pooled-<stamp>.{json,md}. Raises SystemExit on files with different settings
(model, capacity, max_new_tokens, methods, dtype, torch threads) or no overlapping method.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from benchmarks import common

SAME = ("model", "capacity", "max_new_tokens", "methods", "dtype", "torch_threads", "device")
COLS = ["rows", "tokens", "mat", "ms_per_token", "speedup_vs_hf_greedy", "speedup_vs_hf_pld", "speedup_vs_ar",
        "exact_match_vs_hf_greedy"]


def pool(files: list[dict], part: str = "overall") -> dict:
    """{method: pooled row} over the files' ``overall`` rows, or over ``sets[part]`` for ``part`` a set name
    (files without that set are skipped).

    Raises:
        SystemExit: the files differ in a setting of ``SAME``.
    """
    if part != "overall":
        files = [{"config": f["config"], "overall": f["sets"][part]} for f in files if part in f.get("sets", {})]
    check_same(files)
    rows = {method: pooled_row(acc) for method, acc in accumulate(files).items()}
    base = {m: rows[m]["ms_per_token"] for m in ("hf_greedy", "hf_pld", "ar") if m in rows}
    for r in rows.values():
        for b, ms in base.items():
            r[f"speedup_vs_{b}"] = common.ratio(ms, r["ms_per_token"])
    return rows


def check_same(files: list[dict]) -> None:
    """Raises SystemExit when a file's config differs from the first one's in a setting of ``SAME``."""
    for f in files[1:]:
        diff = [k for k in SAME if f["config"].get(k) != files[0]["config"].get(k)]
        if diff:
            raise SystemExit(f"files differ in {diff}; pool only runs with the same settings")


def accumulate(files: list[dict]) -> dict[str, dict]:
    """Per method, the sums over the files' rows: rows, tokens, wall ms, forwards (tokens / mat; ``mat_known``
    False once a file lacks its MAT) and the exact matches against HF greedy as [same, total]."""
    out: dict[str, dict] = {}
    for f in files:
        for method, row in f["overall"].items():
            acc = out.setdefault(method, {"rows": 0, "tokens": 0, "wall_ms": 0.0, "forwards": 0.0, "mat_known": True,
                                          "exact": [0, 0]})
            acc["rows"] += row["rows"]
            acc["tokens"] += row["tokens"]
            acc["wall_ms"] += row["tokens"] * row["ms_per_token"]
            if row.get("mat"):
                acc["forwards"] += row["tokens"] / row["mat"]
            else:
                acc["mat_known"] = False
            same, total = (int(x) for x in str(row["exact_match_vs_hf_greedy"]).split("/"))
            acc["exact"][0] += same
            acc["exact"][1] += total
    return out


def pooled_row(acc: dict) -> dict:
    """One method's pooled row from its sums (``accumulate``)."""
    return {
        "rows": acc["rows"], "tokens": acc["tokens"],
        "mat": round(acc["tokens"] / acc["forwards"], 3) if acc["mat_known"] and acc["forwards"] else None,
        "ms_per_token": round(acc["wall_ms"] / acc["tokens"], 2),
        "exact_match_vs_hf_greedy": f"{acc['exact'][0]}/{acc['exact'][1]}",
    }


def _machine_text(cfg: dict) -> str:
    """The machine of the first file: its ``host`` (``common.machine``), else the processor name it kept."""
    return common.machine_line(cfg["host"]) if cfg.get("host") else str(cfg.get("processor"))


def markdown(files: list[dict], names: list[str], rows: dict, stamp: str, command: str = "") -> str:
    """The pooled tables: overall, per set, and beside the paper's figures."""
    lines = [f"# Pooled benchmark {stamp}", "", *([f"Reproduce: `{command}`", ""] if command else []),
             "Pooled from (each file one interleaved run; commands inside them):", ""]
    for n, f in zip(names, files):
        lines.append(f"- `{n}`: `{f.get('command', '?')}` ({f['config'].get('items_done', '?')} items)")
    cfg = files[0]["config"]
    lines += ["", f"Settings: model={cfg['model']}, capacity={cfg['capacity']}, "
              f"max_new_tokens={cfg['max_new_tokens']}, "
              f"dtype={cfg['dtype']}, torch_threads={cfg['torch_threads']}, machine: {_machine_text(cfg)}, "
              f"runners={cfg.get('runners')}", "", "## Overall (token-weighted over every file)", "",
              common.md_records(rows, COLS)]
    sets = list(dict.fromkeys(s for f in files for s in f.get("sets", {})))
    per_set = {s: pool(files, s) for s in sets}
    lines += ["", "## Per set (token-weighted over the files holding the set)", "",
              common.md_table(["set", "method", *COLS], [[set_name, method, *(r.get(c) for c in COLS)]
                                                        for set_name, rows_s in per_set.items()
                                                        for method, r in rows_s.items()])]
    paper = {(p["set"], p["label"]): p for f in files for p in f.get("published", [])}
    body = []
    for (set_name, label), p in paper.items():
        r = per_set.get(set_name, {}).get(label, {})
        body.append([set_name, label, r.get("mat"), p.get("published_mat"), r.get("speedup_vs_hf_greedy"),
                     p.get("published_speedup")])
    lines += ["", "## Beside the paper (its figures as the bench files carry them: docs/method.md; ours: this CPU, "
              "SmolLM2-135M, pooled)", "",
              common.md_table(["set", "method", "our MAT", "paper MAT", "our speedup vs HF greedy", "paper speedup"],
                              body)]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog=common.prog("merge"), description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    files = [json.loads(p.read_text()) for p in args.files]
    rows = pool(files)
    stamp = common.stamp()
    command = common.command("merge", argv)
    md = markdown(files, [p.name for p in args.files], rows, stamp, command)
    common.write_results(args.out, f"bench-pooled-{stamp}",
                         {"command": command, "sources": [str(p) for p in args.files], "overall": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
