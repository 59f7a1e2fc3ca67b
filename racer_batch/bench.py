"""Side-by-side benchmark of the decoding methods on the smoke prompt set (a script that writes files).

Runs HF ``generate`` greedy (the baseline), HF prompt lookup (``prompt_lookup_num_tokens``) and the
engine's methods in one process on the same prompts, interleaved prompt by prompt so that machine drift
hits every method alike. Speedup = (baseline total ms / total tokens) / (method total ms / total tokens),
token-weighted, prefill included (docs/method.md section 1). Writes ``bench-<stamp>.json`` and ``.md``; the Markdown
ends with one table of our MAT and speedup per prompt set beside the RACER paper's published figures for the
same method (racer_batch/published.py).

A *variant* runs a method with other settings under its own label (``LABEL=METHOD:key=value,...``, e.g.
``racer-c32=racer:capacity=32`` or ``racer-top2=racer:acceptance=topk,relaxed_topk=2``). Methods that may
change outputs (relaxed acceptance) are measured for capability too: exact match against HF greedy, answer
accuracy where the prompt set has references (racer_batch/capability.py), mean output length and the
repeated 4-gram rate of the output tokens.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .benchdata import BenchPrompt, conversation, has_chat_template, smoke_prompts
from .capability import REPEAT_N, answer_correct, repeated_ngram_rate
from .engine import Engine
from .models import ModelBundle, hf_model
from .published import PAPER_ROW, SET_TITLES, SOURCE, published
from .report.markdown import md_records, md_table
from .service.results.record import RowRecord
from .service.results.tally import Tally
from .values import METHODS, DecodingConfig, GenerationParams

log = logging.getLogger(__name__)

HF_METHODS = ("hf_greedy", "hf_pld")
CORPUS_METHODS = ("rest",)  # methods that get --corpus as their static corpus (variants may set corpus_path)


@dataclass(frozen=True)
class MethodSpec:
    """One benchmark row: ``label`` (the row's name), the method, and DecodingConfig overrides."""

    label: str
    method: str
    overrides: tuple[tuple[str, str], ...] = ()


def parse_method(text: str) -> MethodSpec:
    """``racer`` or ``LABEL=METHOD:key=value,key=value`` -> MethodSpec.

    Raises:
        ValueError: empty label, unknown method, a malformed ``key=value``, an unknown DecodingConfig field,
            or overrides on an HF method (they take none).

    >>> parse_method("racer")
    MethodSpec(label='racer', method='racer', overrides=())
    >>> parse_method("racer-c32=racer:capacity=32,acceptance=topk")
    MethodSpec(label='racer-c32', method='racer', overrides=(('capacity', '32'), ('acceptance', 'topk')))
    """
    text = text.strip()
    label, sep, rest = text.partition("=")
    if not sep:
        label, rest = text, text
    method, _, opts = rest.partition(":")
    label, method = label.strip(), method.strip()
    if not label or not method:
        raise ValueError(f"{text!r}: expected METHOD or LABEL=METHOD[:key=value,...]")
    if method not in (*HF_METHODS, *METHODS):
        raise ValueError(f"{text!r}: unknown method {method!r}; choose from {[*HF_METHODS, *METHODS]}")
    pairs = []
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{text!r}: {item!r} is not key=value")
        if key.strip() not in DecodingConfig.model_fields or key.strip() == "method":
            raise ValueError(f"{text!r}: {key.strip()!r} is not a decoding setting")
        if any(k == key.strip() for k, _ in pairs):
            raise ValueError(f"{text!r}: {key.strip()!r} is set twice")
        pairs.append((key.strip(), value.strip()))
    if pairs and method in HF_METHODS:
        raise ValueError(f"{text!r}: {method} takes no settings")
    return MethodSpec(label, method, tuple(pairs))


def decoding_config(spec: MethodSpec, *, capacity: int | str, corpus: str | None = None) -> DecodingConfig:
    """The DecodingConfig of an engine method row: bench defaults, then the row's overrides.

    Raises:
        pydantic.ValidationError: an override value the config refuses.
    """
    assert spec.method not in HF_METHODS, f"{spec.method} is not an engine method"
    fields: dict = {"method": spec.method, "capacity": capacity}
    if corpus and spec.method in CORPUS_METHODS:
        fields["corpus_path"] = corpus
    fields.update(dict(spec.overrides))
    if str(fields.get("capacity")).isdigit():
        fields["capacity"] = int(fields["capacity"])
    return DecodingConfig.model_validate(fields)


@dataclass
class AnswerQuality:
    """Capability counters of the answered turns of one method (what a speed tally cannot say)."""

    exact: int = 0  # turns whose tokens equal the HF greedy baseline's
    scored: int = 0  # turns with a reference answer that can be scored (capability.answer_correct)
    correct: int = 0
    repeat_sum: float = 0.0  # sum of per-turn repeated 4-gram rates of the output tokens
    repeat_n: int = 0

    def merge(self, other: "AnswerQuality") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def observe_answer(self, new_ids: list[int], text: str, references: tuple[str, ...]) -> None:
        """Capability counters of one answered turn (references: any acceptable answer counts)."""
        rate = repeated_ngram_rate(new_ids, REPEAT_N)
        if rate is not None:
            self.repeat_sum += rate
            self.repeat_n += 1
        marks = [answer_correct(text, ref) for ref in references]
        marks = [m for m in marks if m is not None]
        if marks:
            self.scored += 1
            self.correct += int(any(marks))


@dataclass
class MethodTotals:
    """One method over the turns of one group: the row tally (one bench turn is one ``RowRecord``: its wall
    time as ``decode_ms``, tokens, steps, drafting times) and the answer quality beside it."""

    tally: Tally = field(default_factory=Tally)
    quality: AnswerQuality = field(default_factory=AnswerQuality)

    def add(self, other: "MethodTotals") -> None:
        self.tally.merge(other.tally)
        self.quality.merge(other.quality)

    @property
    def ms_per_token(self) -> float:
        """Wall time per output token (NaN before any token)."""
        return self.tally.gen_ms / self.tally.output_tokens if self.tally.output_tokens else float("nan")


def turn_record(label: str, *, run_id: str, item: BenchPrompt, index: int, turn: int, new_ids: list[int],
                wall_ms: float, stats: Any) -> RowRecord:
    """The RowRecord of turn ``turn`` of benchmark item ``item`` (the ``index``-th of the run ``run_id``) under
    method ``label``, which is also its route: ``stats`` (engine RowStats, None for HF rows) gives steps and
    drafting times; HF greedy takes one forward per token, HF prompt lookup counts none."""
    steps = stats.steps if stats is not None else len(new_ids) if label == "hf_greedy" else 0
    return RowRecord(id=f"{item.set}/{item.item_id}/turn{turn + 1}", row_idx=index, shard=None, route=label,
                     status="ok", job_id=run_id, output_tokens=len(new_ids), steps=steps, prefill_ms=0.0,
                     decode_ms=wall_ms, draft_ms=getattr(stats, "draft_ms", 0.0),
                     verify_ms=getattr(stats, "verify_ms", 0.0), update_ms=getattr(stats, "update_ms", 0.0))


@dataclass
class BenchResult:
    config: dict
    run_id: str = field(default_factory=lambda: "bench-" + time.strftime("%Y%m%d-%H%M%S"))
    groups: dict[str, dict[str, MethodTotals]] = field(default_factory=dict)
    method_configs: dict[str, dict] = field(default_factory=dict)  # label -> decoding config (JSON)

    def totals(self, method: str) -> MethodTotals:
        t = MethodTotals()
        for g in self.groups.values():
            if method in g:
                t.add(g[method])
        return t


def machine() -> dict:
    """What ran a benchmark, for every results file: the CPU's model name, family and model numbers (they tell
    Zen 3 / 4 / 5 and Intel generations apart), its vector ISA (``avx512f``, ``avx2``, ``amx``), cores, the load
    average, Python and torch versions. Read from /proc/cpuinfo; elsewhere what ``platform`` knows."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "family": None, "model": None}
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]  # the first processor's block
    except OSError:
        first = ""
    fields = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in first.splitlines()))
    flags = set(fields.get("flags", "").split())
    info.update(cpu=fields.get("model name", info["cpu"]), family=fields.get("cpu family"), model=fields.get("model"),
                isa=[f for f in ("avx512f", "avx2", "amx_tile") if f in flags])
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    info.update(cores=os.cpu_count(), load=load, python=platform.python_version(), torch=torch.__version__)
    return info


def _hf_runner(bundle: ModelBundle, max_new: int, *, lookup: int | None) -> Callable:
    model = hf_model(bundle)  # HF's forward: an as-stored bundle's weights expanded to float32 (their exact numbers)

    def run(ids: list[int]):
        x = torch.tensor([ids], device=bundle.device)
        kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=bundle.eos_ids,
                  pad_token_id=bundle.eos_ids[0], attention_mask=torch.ones_like(x))
        if lookup:
            kw["prompt_lookup_num_tokens"] = lookup
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, **kw)
        ms = (time.perf_counter() - t0) * 1000.0
        new = out[0, len(ids):].tolist()
        return new, ms, None
    return run


def _engine_runner(engine: Engine, max_new: int) -> Callable:
    """A runner keeping one draft state across all prompts (job scope, as a batch job does)."""
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
    methods: list[str | MethodSpec],
    capacity: int | str,
    max_new_tokens: int,
    per_set: int = 8,
    items: list[BenchPrompt] | None = None,
    corpus: str | None = None,
    on_item: Callable[[BenchResult], None] | None = None,
    system_prompt: str | None = None,
    extra: dict[str, tuple[Callable, dict, str]] | None = None,
) -> BenchResult:
    """Run every method on every prompt (all turns), interleaved; returns per-group totals.

    ``methods``: names or ``parse_method`` strings / MethodSpecs; HF greedy (the baseline) always runs first.
    ``corpus``: static corpus file for the ``rest`` rows (CORPUS_METHODS), as ``DecodingConfig.corpus_path``.
    ``on_item``: called with the results so far after every item (the CLI writes partial files with it).
    ``system_prompt``: a system message before every conversation (default none: the model's chat template
    alone, as jobs and ``generate`` do).
    ``extra``: more rows run by the caller, label -> (runner, config JSON, kind); a runner takes the prompt's
    token ids and returns (new token ids, the end token included where it stopped on one; wall ms; RowStats or
    None), e.g. another engine on other weights or an outside program (benchmarks/vs_llamacpp.py).

    Raises:
        ValueError: a bad method string or two rows with the same label.
        pydantic.ValidationError: a variant's setting the config refuses.
    """
    items = items if items is not None else smoke_prompts(per_set)
    specs = [m if isinstance(m, MethodSpec) else parse_method(m) for m in methods]
    labels = [s.label for s in specs if s.label != "hf_greedy"]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"method labels must be unique; repeated: {dup}")
    c = _contenders(bundle, specs, capacity=capacity, max_new_tokens=max_new_tokens, corpus=corpus)
    for label, (run, config, kind) in (extra or {}).items():
        if label in c.runners:
            raise ValueError(f"method labels must be unique; repeated: {[label]}")
        c.runners[label], c.configs[label], c.kinds[label] = run, config, kind
    enc = Engine(bundle, DecodingConfig(method="ar"))
    res = BenchResult(config=dict(model=bundle.name, capacity=capacity, max_new_tokens=max_new_tokens,
                                  methods=list(c.runners), items=len(items), device=bundle.device, dtype=bundle.dtype,
                                  weights=getattr(bundle, "weights", None),
                                  torch_threads=torch.get_num_threads(), machine=platform.machine(),
                                  processor=machine()["cpu"], host=machine(), corpus=corpus,
                                  runners=c.kinds, warmup_s=c.warmups),
                      method_configs=c.configs)
    # warm-up so the first measured row does not pay one-time costs
    for run in c.runners.values():
        run(enc.encode(conversation(["Say hello."], [], system_prompt=system_prompt,
                                    chat=has_chat_template(bundle.tokenizer))))
    for n, item in enumerate(items):
        _run_item(res, item, c.runners, index=n, bundle=bundle, enc=enc, system_prompt=system_prompt)
        log.info("bench: %d/%d items done", n + 1, len(items))
        res.config["items_done"] = n + 1
        if on_item is not None:
            on_item(res)
    return res


@dataclass
class _Contenders:
    """The rows of one bench run: label -> runner, config (JSON), runner kind, warm-up seconds."""

    runners: dict[str, Callable] = field(default_factory=dict)
    configs: dict[str, dict] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    warmups: dict[str, float] = field(default_factory=dict)


def _contenders(bundle: ModelBundle, specs: list[MethodSpec], *, capacity: int | str, max_new_tokens: int,
                corpus: str | None) -> _Contenders:
    """HF greedy first (the baseline), then every spec: HF generate rows and engine rows."""
    c = _Contenders()
    c.runners["hf_greedy"] = _hf_runner(bundle, max_new_tokens, lookup=None)
    c.configs["hf_greedy"], c.kinds["hf_greedy"] = {"method": "hf_greedy"}, "hf"
    for spec in specs:
        if spec.label == "hf_greedy" and spec.method == "hf_greedy":
            continue
        if spec.method in HF_METHODS:
            c.runners[spec.label] = _hf_runner(bundle, max_new_tokens, lookup=10 if spec.method == "hf_pld" else None)
            c.configs[spec.label], c.kinds[spec.label] = {"method": spec.method}, "hf"
            continue
        cfg = decoding_config(spec, capacity=capacity, corpus=corpus)
        engine = Engine(bundle, cfg)
        c.runners[spec.label] = _engine_runner(engine, max_new_tokens)
        c.configs[spec.label] = cfg.model_dump(mode="json")
        c.kinds[spec.label] = engine.runner.kind
        c.warmups[spec.label] = round(engine.warmup_s, 2)
    return c


def _run_item(res: BenchResult, item: BenchPrompt, runners: dict[str, Callable], *, index: int, bundle: ModelBundle,
              enc: Engine, system_prompt: str | None) -> None:
    """Every turn of one item on every runner, interleaved turn by turn; counts go into ``res.groups``."""
    group = f"{item.set}/{item.group}" if item.set == "spec_bench" else item.set
    answers: dict[str, list[str]] = {m: [] for m in runners}
    baseline_ids: list[list[int]] = []
    for turn in range(len(item.turns)):
        for m, run in runners.items():
            ids = enc.encode(conversation(list(item.turns[: turn + 1]), answers[m], system_prompt=system_prompt,
                                          chat=has_chat_template(bundle.tokenizer)))
            new, ms, stats = run(ids)
            tot = res.groups.setdefault(group, {}).setdefault(m, MethodTotals())
            tot.tally.observe_row(turn_record(m, run_id=res.run_id, item=item, index=index, turn=turn, new_ids=new,
                                              wall_ms=ms, stats=stats))
            if m == "hf_greedy":
                baseline_ids.append(new)
            tot.quality.exact += int(new == baseline_ids[turn])
            content = [t for t in new if t not in bundle.eos_ids]
            answers[m].append(bundle.tokenizer.decode(content, skip_special_tokens=True))
            tot.quality.observe_answer(content, answers[m][-1], item.turn_references(turn))


def _row(res: BenchResult, tots: dict[str, MethodTotals], method: str) -> dict:
    base = tots["hf_greedy"]
    t, q = tots[method].tally, tots[method].quality
    step_ms = t.draft_ms + t.verify_ms + t.update_ms
    return {
        "rows": t.rows,
        "tokens": t.output_tokens,
        "mat": round(t.mat, 3) if t.mat else None,
        "ms_per_token": round(tots[method].ms_per_token, 2),
        "speedup_vs_hf_greedy": round(base.ms_per_token / tots[method].ms_per_token, 3) if t.output_tokens else None,
        "exact_match_vs_hf_greedy": f"{q.exact}/{t.rows}",
        "answer_accuracy": f"{q.correct}/{q.scored}" if q.scored else None,
        "mean_tokens": round(t.output_tokens / t.rows, 1) if t.rows else None,
        "repeat4": round(q.repeat_sum / q.repeat_n, 4) if q.repeat_n else None,
        "draft_update_share_of_step": round((t.draft_ms + t.update_ms) / step_ms, 4) if step_ms else None,
    }


def set_of(group: str) -> str:
    """The prompt set of a result group: ``spec_bench/qa`` -> ``spec_bench``."""
    return group.split("/", 1)[0]


def summarize(res: BenchResult) -> dict:
    """Per group, per prompt set (groups pooled, token-weighted) and overall rows of every method."""
    out: dict = {"config": res.config, "method_configs": res.method_configs, "groups": {}, "sets": {}, "overall": {}}
    for g, tots in res.groups.items():
        out["groups"][g] = {m: _row(res, tots, m) for m in tots}
    pooled: dict[str, dict[str, MethodTotals]] = {}
    for g, tots in res.groups.items():
        for m, t in tots.items():
            pooled.setdefault(set_of(g), {}).setdefault(m, MethodTotals()).add(t)
    out["sets"] = {s: {m: _row(res, tots, m) for m in tots} for s, tots in pooled.items()}
    overall = {m: res.totals(m) for m in res.config["methods"]}
    out["overall"] = {m: _row(res, overall, m) for m in overall}
    out["published"] = published_table(out)
    return out


def published_table(summary: dict) -> list[dict]:
    """Rows ``{label, set, published_mat, published_speedup, mat, speedup}`` for every method with a paper row.

    A row label is matched to the paper by its name (``racer``, ``hf_pld`` -> ``pld``, ...); variants with
    other settings carry their own label and get no published figure.
    """
    rows = []
    for s_name, methods in summary["sets"].items():
        for label, r in methods.items():
            pub = published(s_name, label)
            if pub is None:
                continue
            mat = r["mat"] if r["mat"] is not None else (1.0 if PAPER_ROW.get(label) == "ar" else None)
            rows.append({"label": label, "set": s_name, "published_mat": pub[0], "published_speedup": pub[1],
                         "mat": mat, "speedup": r["speedup_vs_hf_greedy"]})
    return rows


def write_results(summary: dict, out_dir: Path, *, command: str, stamp: str | None = None, name: str = "bench",
                  preamble: list[str] | None = None) -> tuple[Path, Path]:
    """Write JSON and Markdown (``<name>-<stamp>``; a given stamp overwrites that run's partial files); returns
    their paths. ``preamble``: Markdown lines put after the title."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    summary = dict(summary, command=command, written_at=stamp)
    jpath = out_dir / f"{name}-{stamp}.json"
    jpath.write_text(json.dumps(summary, indent=2))
    lines = [f"# Benchmark {stamp}", "", *(preamble or []), f"Reproduce: `{command}`", "",
             "Config: " + ", ".join(f"{k}={v}" for k, v in summary["config"].items() if k != "host"), "",
             *_md_machine(summary["config"].get("host")),
             *_md_settings(summary), "## Overall", "", md_records(summary["overall"], TABLE_COLUMNS), "",
             *_md_definitions()]
    multi = {set_of(g) for g in summary["groups"] if "/" in g}
    for s_name, rows in summary.get("sets", {}).items():
        if s_name in multi:  # a one-group set's pooled table would repeat its group's table below
            lines += [f"## {SET_TITLES.get(s_name, s_name)} (groups pooled)", "", md_records(rows, TABLE_COLUMNS), ""]
    for g, rows in summary["groups"].items():
        lines += [f"## {g}", "", md_records(rows, TABLE_COLUMNS), ""]
    lines += _md_published(summary)
    mpath = out_dir / f"{name}-{stamp}.md"
    mpath.write_text("\n".join(lines))
    return jpath, mpath


DEFINITIONS = [
    "rows: answered turns (a two-turn question counts twice); tokens: output tokens over those turns.",
    "mat: output tokens per target forward (prefill included; HF rows: hf_greedy is 1 by definition, hf_pld "
    "is not counted).",
    "ms_per_token: wall time (prefill + decode) per output token; speedup_vs_hf_greedy: HF greedy's ms_per_token "
    "over the row's (token-weighted, docs/method.md section 1).",
    "exact_match_vs_hf_greedy: turns whose tokens equal HF greedy's; every lossless method must show all of them.",
    "answer_accuracy: correct / scored turns, over turns whose reference is a number or a short answer "
    "(racer_batch/capability.py; MGSM-ZH answers and Spec-Bench math_reasoning / short references).",
    "mean_tokens: output tokens per turn; repeat4: mean repeated 4-gram rate of each turn's output tokens "
    "(1 - distinct / total 4-grams; loops raise it).",
    "draft_update_share_of_step: drafting and state-update time over the whole step time (draft + verify + update).",
]


def machine_line(m: dict) -> str:
    """One line naming a ``machine()``, e.g. ``AMD EPYC (family 25 model 1, avx2), 2 cores``."""
    isa = ", ".join(m.get("isa") or []) or "no AVX2"
    return f"{m['cpu']} (family {m.get('family')} model {m.get('model')}, {isa}), {m.get('cores')} cores"


def _md_machine(host: dict | None) -> list[str]:
    """The machine line of a results file that has one (``config.host``)."""
    if not host:
        return []
    return [f"Machine: {machine_line(host)}, torch {host.get('torch')}, Python {host.get('python')}.", ""]


def _md_definitions() -> list[str]:
    return ["Columns:", "", *[f"- {d}" for d in DEFINITIONS], ""]


def _md_settings(summary: dict) -> list[str]:
    """One line per row run with settings other than the bench defaults (variants); relaxed ones marked."""
    conf = summary["config"]
    out = []
    for label, dumped in summary.get("method_configs", {}).items():
        if dumped.get("method") in HF_METHODS:
            continue
        try:
            cfg = DecodingConfig.model_validate(dumped)
        except ValueError:  # an outside engine's row (run_bench's ``extra``): its own settings as given
            out.append(f"- `{label}`: " + ", ".join(f"{k}={v}" for k, v in dumped.items()))
            continue
        default = decoding_config(MethodSpec(label, cfg.method), capacity=conf.get("capacity", 16),
                                  corpus=conf.get("corpus"))
        diff = {k: v for k, v in cfg.model_dump(mode="json").items() if v != getattr(default, k, None)}
        if cfg.acceptance == "topk":
            diff["relaxed_topk"] = cfg.relaxed_topk
        elif cfg.acceptance == "threshold":
            diff["relaxed_threshold"] = cfg.relaxed_threshold
        if not diff and label == cfg.method:
            continue
        settings = ", ".join(f"{k}={v}" for k, v in sorted(diff.items())) or "the defaults"
        mark = (" (**relaxed acceptance: outputs may differ from greedy by design**)"
                if cfg.acceptance != "lossless" else "")
        out.append(f"- `{label}`: {cfg.method} with {settings}{mark}")
    return ["Variants (settings other than the bench defaults):", "", *out, ""] if out else []


def _md_published(summary: dict) -> list[str]:
    """One table: per method, per prompt set, 'published / ours' MAT and speedup (a dash where none)."""
    sets = [s for s in SET_TITLES if s in summary.get("sets", {})]
    if not sets:
        return []
    by = {(r["label"], r["set"]): r for r in summary.get("published", [])}
    labels = list(summary["overall"])
    head = ["method"] + [f"{SET_TITLES[s]} MAT (paper / ours)" for s in sets] + \
           [f"{SET_TITLES[s]} speedup (paper / ours)" for s in sets]

    def cell(pub: float | None, ours: float | None, unit: str = "") -> str:
        p = f"{pub:.2f}{unit}" if pub is not None else "-"
        o = f"{ours:.2f}{unit}" if ours is not None else "-"
        return f"{p} / {o}"

    body = []
    for label in labels:
        mats, speeds = [], []
        for s in sets:
            ours = summary["sets"][s].get(label, {})
            r = by.get((label, s))
            mats.append(cell(r["published_mat"] if r else None, r["mat"] if r else ours.get("mat")))
            speeds.append(cell(r["published_speedup"] if r else None, ours.get("speedup_vs_hf_greedy"), "x"))
        body.append([label, *mats, *speeds])
    turns = {s: summary["sets"][s].get("hf_greedy", {}).get("rows") for s in sets}
    return ["## Beside the published figures", "",
            f"Paper: {SOURCE} (listed in benchmarks/PUBLISHED.md). Ours: {summary['config'].get('model')} on "
            f"{summary['config'].get('device')}, speedup against HF `generate` greedy, over "
            + ", ".join(f"{turns[s]} turns of {SET_TITLES[s]}" for s in sets)
            + f" at {summary['config'].get('max_new_tokens')} new tokens (the paper: full sets, 1024): few "
            "prompts give noisy figures. Compare MAT first: speedup depends on the hardware "
            "(docs/method.md section 8). A dash: no published figure for that method.", "",
            md_table(head, body), ""]


TABLE_COLUMNS = ("rows", "tokens", "mat", "ms_per_token", "speedup_vs_hf_greedy", "exact_match_vs_hf_greedy",
                 "answer_accuracy", "mean_tokens", "repeat4", "draft_update_share_of_step")
