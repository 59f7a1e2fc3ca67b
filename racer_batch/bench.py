"""Side-by-side benchmark of the decoding methods on the smoke prompt set (a script that writes files).

Runs HF ``generate`` greedy (the baseline), HF prompt lookup (``prompt_lookup_num_tokens``) and the
engine's methods in one process on the same prompts, interleaved prompt by prompt so that machine drift
hits every method alike. Speedup = (baseline total ms / total tokens) / (method total ms / total tokens),
token-weighted, prefill included (RACER.md section 1). Writes ``bench-<stamp>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .benchdata import BenchPrompt, conversation, smoke_prompts
from .engine import Engine
from .models import ModelBundle
from .types import DecodingConfig, GenerationParams

log = logging.getLogger(__name__)

HF_METHODS = ("hf_greedy", "hf_pld")


@dataclass
class MethodTotals:
    """Accumulated over rows of one group for one method."""

    tokens: int = 0
    steps: int = 0
    wall_ms: float = 0.0
    draft_ms: float = 0.0
    update_ms: float = 0.0
    verify_ms: float = 0.0
    rows: int = 0
    exact: int = 0  # turns whose tokens equal the HF greedy baseline's

    def add(self, other: "MethodTotals") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def mat(self) -> float | None:
        return self.tokens / self.steps if self.steps else None

    @property
    def ms_per_token(self) -> float:
        return self.wall_ms / self.tokens if self.tokens else float("nan")


@dataclass
class BenchResult:
    config: dict
    groups: dict[str, dict[str, MethodTotals]] = field(default_factory=dict)

    def totals(self, method: str) -> MethodTotals:
        t = MethodTotals()
        for g in self.groups.values():
            if method in g:
                t.add(g[method])
        return t


def _hf_runner(bundle: ModelBundle, max_new: int, *, lookup: int | None) -> Callable:
    def run(ids: list[int]):
        x = torch.tensor([ids], device=bundle.device)
        kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=bundle.eos_ids,
                  pad_token_id=bundle.eos_ids[0], attention_mask=torch.ones_like(x))
        if lookup:
            kw["prompt_lookup_num_tokens"] = lookup
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = bundle.model.generate(x, **kw)
        ms = (time.perf_counter() - t0) * 1000.0
        new = out[0, len(ids):].tolist()
        return new, ms, None
    return run


def _engine_runner(engine: Engine, max_new: int) -> Callable:
    state = engine.new_state()
    params = GenerationParams(max_new_tokens=max_new)

    def run(ids: list[int]):
        t0 = time.perf_counter()
        r = engine.generate(ids, params, state=state)
        ms = (time.perf_counter() - t0) * 1000.0
        return r.token_ids, ms, r.stats
    return run


def run_bench(
    bundle: ModelBundle,
    *,
    methods: list[str],
    capacity: int | str,
    max_new_tokens: int,
    per_set: int = 8,
    items: list[BenchPrompt] | None = None,
) -> BenchResult:
    """Run every method on every prompt (all turns), interleaved; returns per-group totals."""
    items = items if items is not None else smoke_prompts(per_set)
    runners: dict[str, Callable] = {"hf_greedy": _hf_runner(bundle, max_new_tokens, lookup=None)}
    for m in methods:
        if m == "hf_pld":
            runners[m] = _hf_runner(bundle, max_new_tokens, lookup=10)
        elif m != "hf_greedy":
            runners[m] = _engine_runner(Engine(bundle, DecodingConfig(method=m, capacity=capacity)), max_new_tokens)
    tok = bundle.tokenizer
    enc = Engine(bundle, DecodingConfig(method="ar"))
    res = BenchResult(config=dict(model=bundle.name, capacity=capacity, max_new_tokens=max_new_tokens,
                                  methods=list(runners), items=len(items), device=bundle.device, dtype=bundle.dtype,
                                  torch_threads=torch.get_num_threads(), machine=platform.machine(),
                                  processor=platform.processor() or platform.machine()))
    # warm-up so the first measured row does not pay one-time costs
    for run in runners.values():
        run(enc.encode(conversation(["Say hello."], [])))
    for n, item in enumerate(items):
        group = f"{item.set}/{item.group}" if item.set == "spec_bench" else item.set
        answers: dict[str, list[str]] = {m: [] for m in runners}
        baseline_ids: list[list[int]] = []
        for turn in range(len(item.turns)):
            for m, run in runners.items():
                ids = enc.encode(conversation(list(item.turns[: turn + 1]), answers[m]))
                new, ms, stats = run(ids)
                tot = res.groups.setdefault(group, {}).setdefault(m, MethodTotals())
                tot.rows += 1
                tot.tokens += len(new)
                tot.wall_ms += ms
                if stats is not None:
                    tot.steps += stats.steps
                    tot.draft_ms += stats.draft_ms
                    tot.update_ms += stats.update_ms
                    tot.verify_ms += stats.verify_ms
                elif m == "hf_greedy":
                    tot.steps += len(new)  # one forward per token
                if m == "hf_greedy":
                    baseline_ids.append(new)
                tot.exact += int(new == baseline_ids[turn])
                answers[m].append(tok.decode([t for t in new if t not in bundle.eos_ids], skip_special_tokens=True))
        log.info("bench: %d/%d items done", n + 1, len(items))
    return res


def _row(res: BenchResult, tots: dict[str, MethodTotals], method: str) -> dict:
    base = tots["hf_greedy"]
    t = tots[method]
    step_ms = t.draft_ms + t.verify_ms + t.update_ms
    return {
        "rows": t.rows,
        "tokens": t.tokens,
        "mat": round(t.mat, 3) if t.mat else None,
        "ms_per_token": round(t.ms_per_token, 2),
        "speedup_vs_hf_greedy": round(base.ms_per_token / t.ms_per_token, 3) if t.tokens else None,
        "exact_match_vs_hf_greedy": f"{t.exact}/{t.rows}",
        "draft_update_share_of_step": round((t.draft_ms + t.update_ms) / step_ms, 4) if step_ms else None,
    }


def summarize(res: BenchResult) -> dict:
    out = {"config": res.config, "groups": {}, "overall": {}}
    for g, tots in res.groups.items():
        out["groups"][g] = {m: _row(res, tots, m) for m in tots}
    overall = {m: res.totals(m) for m in res.config["methods"]}
    out["overall"] = {m: _row(res, overall, m) for m in overall}
    return out


def write_results(summary: dict, out_dir: Path, *, command: str) -> tuple[Path, Path]:
    """Write JSON and Markdown; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    summary = dict(summary, command=command, written_at=stamp)
    jpath = out_dir / f"bench-{stamp}.json"
    jpath.write_text(json.dumps(summary, indent=2))
    lines = [f"# Benchmark {stamp}", "", f"Reproduce: `{command}`", "",
             "Config: " + ", ".join(f"{k}={v}" for k, v in summary["config"].items()), "",
             "## Overall", "", _md_table(summary["overall"]), ""]
    for g, rows in summary["groups"].items():
        lines += [f"## {g}", "", _md_table(rows), ""]
    mpath = out_dir / f"bench-{stamp}.md"
    mpath.write_text("\n".join(lines))
    return jpath, mpath


def _md_table(rows: dict[str, dict]) -> str:
    cols = ["rows", "tokens", "mat", "ms_per_token", "speedup_vs_hf_greedy", "exact_match_vs_hf_greedy",
            "draft_update_share_of_step"]
    head = "| method | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols)
    body = ["| " + m + " | " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |"
            for m, r in rows.items()]
    return "\n".join([head, *body])
