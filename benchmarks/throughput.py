"""Output tokens/s of one actor with B streams in flight (issue 14, "Throughput benchmark").

One process, one ``Engine`` per decoding config (``streams`` = the largest B, so every B runs on the same
engine and, for ``capacity: auto``, the same tuner), and for each contender (method, capacity, B) one
``StreamBatch`` with continuous batching over a fixed list of prompts: at most B streams in flight, a
finished stream's place taken by the next prompt (engine/batch.py). Contenders are interleaved: every round
visits each contender once, in an order rotated per round, each decoding the same prompts with a fresh job
draft state, so drift of a shared machine falls on all of them alike. Reported per contender: the median
tokens/s over rounds and the per-round ratios (then medianed) to B=1 of the same method+capacity and to
``ar`` at B=1; verify forwards/s, rows and streams per forward, MAT, and the prefill stall (a joining row's
prefill runs alone while its batch-mates wait: ms per joining row and share of the batch's wall time).

A contender's run is the product's own records: one ``RowRecord`` per prompt (route = the contender, job id =
this run's ``throughput-<stamp>``), summed with ``Tally`` (output tokens, target forwards, MAT), and the
batch's ``BatchStats`` (batched forwards, rows, stream-steps, prefills); beside them the output token ids and a
small dict of what neither holds (wall time, the prefill stall, the rows' capacities, the tuner's choice).
The JSON keeps one summary dict per run (``run_summary``), from which ``--resummarize`` recomputes the rows.

Lossless in the same run: every row's tokens at every B are compared with the B=1 output of the same
method+capacity and with ``ar`` at B=1 of the same round (greedy decoding is lossless, so all equal);
the mismatch count (must be 0) is in the output. Prompts: a deterministic sample of Spec-Bench first turns
under the model's chat template, short and long categories alternating (``common.spec_bench_prompts``).
Writes ``<out>/throughput-<stamp>.json`` and ``.md``, rewritten after every contender (a run stopped midway
keeps what it measured).

    python -m benchmarks.throughput                                   # the full grid (long: ~1 h here)
    python -m benchmarks.throughput --smoke                           # 2 prompts, 16 tokens, B 1 and 2
    python -m benchmarks.throughput --methods racer --racer-capacities auto --streams 1,4 --prompts 4 \\
        --max-new-tokens 32 --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from benchmarks import common
from racer_batch.benchdata import conversation
from racer_batch.engine import Engine
from racer_batch.engine.batch import BatchStats, StreamBatch
from racer_batch.engine.engine import Prompt, encode_prompt
from racer_batch.models import ModelBundle, load_model
from racer_batch.service.results.record import RowOrigin, RowRecord
from racer_batch.service.results.tally import Tally
from racer_batch.values import DecodingConfig, GenerationParams

log = logging.getLogger("benchmarks.throughput")

METHODS = ("ar", "pld", "racer")
DEFAULTS = dict(prompts=24, max_new_tokens=128, streams="1,2,4,8", rounds=3)
SMOKE = dict(prompts=2, max_new_tokens=16, streams="1,2", rounds=1)


# ---- contenders ----
@dataclass(frozen=True)
class Setting:
    """One decoding config: ``label`` (``ar``, ``pld``, ``racer-auto``, ``racer-c8``; ``-avx2`` appended for a
    forced instruction set) and its capacity."""

    label: str
    method: str
    capacity: Any  # int | "auto"
    isa: Optional[str] = None  # our CPU kernels' instruction set for this contender (None: the machine's default)

    def config(self) -> DecodingConfig:
        return DecodingConfig(method=self.method, capacity=self.capacity)


def settings_of(methods: Sequence[str], racer_capacities: Sequence[Any]) -> list[Setting]:
    """ar at capacity 1, pld at its default chain (``pld_num_tokens`` copied tokens + the root), racer at each
    of ``racer_capacities``.

    Raises:
        ValueError: an unknown method or a racer capacity that is neither a positive int nor ``auto``.
    """
    out = []
    for m in methods:
        if m == "ar":
            out.append(Setting("ar", "ar", 1))
        elif m == "pld":
            out.append(Setting("pld", "pld", DecodingConfig().pld_num_tokens + 1))
        elif m == "racer":
            for c in racer_capacities:
                if c != "auto" and (not isinstance(c, int) or c < 1):
                    raise ValueError(f"racer capacity must be a positive int or 'auto', got {c!r}")
                out.append(Setting(f"racer-{'auto' if c == 'auto' else f'c{c}'}", "racer", c))
        else:
            raise ValueError(f"unknown method {m!r}; choose from {METHODS}")
    return out


def with_isas(settings: list[Setting], isas: Sequence[str]) -> list[Setting]:
    """``settings`` once per instruction set of our CPU kernels (``racer::set_isa``): the first keeps its label,
    the others get ``-<isa>`` appended (each runs on its own engine, with the set active from its start, so
    ``capacity: auto`` measures its cost curve on it)."""
    if not isas:
        return list(settings)
    return [Setting(s.label + (f"-{isa}" if i else ""), s.method, s.capacity, isa)
            for i, isa in enumerate(isas) for s in settings]


def _use_isa(isa: Optional[str]) -> None:
    if isa is None:
        return
    from racer_batch.engine.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None:
        raise SystemExit(f"--isas {isa}: our CPU kernels are not available here")
    ops.set_isa(isa)


def contender_label(setting: Setting, streams: int) -> str:
    return f"{setting.label}@B{streams}"


# ---- one contender's run: the product's records ----
def decode_all(engine: Engine, prompt_ids: list[list[int]], *, streams: int, max_new_tokens: int,
               origin: Optional[RowOrigin] = None, ids: Optional[Sequence[str]] = None,
               ) -> tuple[list[RowRecord], list[list[int]], BatchStats, dict]:
    """Greedy-decode every prompt with at most ``streams`` in flight (continuous batching, prompts in list
    order), one job draft state for them all. A row that fails raises (a benchmark has no bad rows).

    Returns the run as the product counts it: one ``RowRecord`` per prompt in prompt order (``origin`` with
    ``id`` = ``ids[i]``, default ``prompt-<i>``, and ``row_idx`` = i; see ``row_records``), the output token
    ids per prompt, the batch's ``BatchStats``, and a dict of what neither holds: ``wall_s``, ``stall_ms`` (the
    prefills that ran while other streams were in flight), ``stall_stream_ms`` (sum over those of prefill ms x
    streams held up), ``row_capacities`` (``GenerationResult.stats.capacity`` -> rows) and ``tuner_choice``
    (capacity auto: the tuner's choice at B streams after the run; else None).

    Raises:
        RuntimeError: a row ended with an error (the error is chained).
    """
    params = GenerationParams(max_new_tokens=max_new_tokens)
    state = engine.new_state()
    batch = StreamBatch()
    todo = list(range(len(prompt_ids)))
    finished: dict[int, Any] = {}
    stall_ms = stall_stream_ms = 0.0
    t0 = time.perf_counter()
    try:
        while todo or len(batch):
            joins = 0
            while todo and len(batch) < streams:
                i = todo.pop(0)
                batch.add(i, engine.stream(prompt_ids[i], params, state=state))
                joins += 1
            waiting = len(batch) - joins  # streams in flight that this step's prefills hold up
            before = batch.stats.prefill_ms
            for f in batch.step():
                if f.error is not None:
                    raise RuntimeError(f"prompt {f.key} failed at B={streams}") from f.error
                finished[f.key] = f
            if joins and waiting > 0:
                d = batch.stats.prefill_ms - before
                stall_ms += d
                stall_stream_ms += d * waiting
    finally:
        batch.close()
        engine.free_state(state)
    wall_s = time.perf_counter() - t0
    done = [finished[i] for i in range(len(prompt_ids))]
    caps: dict[str, int] = {}
    for f in done:
        caps[str(f.result.stats.capacity)] = caps.get(str(f.result.stats.capacity), 0) + 1
    extra = {"wall_s": wall_s, "stall_ms": stall_ms, "stall_stream_ms": stall_stream_ms,
             "row_capacities": dict(sorted(caps.items(), key=lambda kv: int(kv[0]))),
             "tuner_choice": engine.tuner.choose(streams) if engine.tuner is not None else None}
    records = row_records(done, origin or RowOrigin(id="", row_idx=0, job_id="throughput"), ids=ids,
                          runner=engine.runner, streams=streams)
    return records, [list(f.result.token_ids) for f in done], batch.stats, extra


def row_records(done: Sequence[Any], origin: RowOrigin, *, ids: Optional[Sequence[str]], runner: Any,
                streams: int) -> list[RowRecord]:
    """One ``RowRecord`` per ended stream (``engine.batch.Finished``, in prompt order) as the batch service
    writes it: status ok, counts and times from its ``GenerationResult`` (steps: target forwards, prefill
    included; prefill_ms, decode_ms, draft/verify/update ms), ``origin`` with the prompt's id and index, and at
    B > 1 ``device_ms``, the row's share of the batched forwards on ``runner``."""
    out = []
    for i, f in enumerate(done):
        row_origin = dataclasses.replace(origin, id=ids[i] if ids is not None else f"prompt-{i}", row_idx=i)
        rec = RowRecord.from_turns([f.result], status="ok", error=None, origin=row_origin)
        share = f.device_ms.get(id(runner))
        if streams > 1 and share:
            rec.device_ms = share
        out.append(rec)
    return out


def tally_of(records: Sequence[RowRecord]) -> Tally:
    """The product's totals over a run's rows (output tokens, target forwards, MAT, times)."""
    tally = Tally()
    for rec in records:
        tally.observe_row(rec)
    return tally


def run_summary(records: Sequence[RowRecord], stats: BatchStats, extra: dict) -> dict:
    """One run as the JSON keeps it (``runs``): totals of its rows (``Tally``: output_tokens, row_steps = target
    forwards of the rows, prefill included, mat), the batch's counts (``BatchStats``: forwards = batched verify
    forwards, rows, stream_steps, sizes, prefills, prefill_ms, verify_ms) and ``decode_all``'s ``extra``
    (wall_s, stall_ms, stall_stream_ms, row_capacities, tuner_choice). Unrounded: ``rounded`` is the JSON's."""
    tally = tally_of(records)
    return {"wall_s": extra["wall_s"], "output_tokens": tally.output_tokens,
            "tokens_per_s": _per(tally.output_tokens, extra["wall_s"]), "forwards": stats.steps, "rows": stats.rows,
            "stream_steps": stats.streams, "sizes": {str(k): v for k, v in sorted(stats.sizes.items())},
            "prefills": stats.prefills, "prefill_ms": stats.prefill_ms, "stall_ms": extra["stall_ms"],
            "stall_stream_ms": extra["stall_stream_ms"], "verify_ms": stats.verify_ms, "row_steps": tally.steps,
            "mat": tally.mat, "row_capacities": dict(extra["row_capacities"]), "tuner_choice": extra["tuner_choice"]}


# full enough precision that a summary recomputed from the JSON (--resummarize) matches the run's own, even for
# the millisecond runs of a tiny test model
_DECIMALS = {"wall_s": 6, "tokens_per_s": 3, "prefill_ms": 3, "stall_ms": 3, "stall_stream_ms": 3, "verify_ms": 3,
             "mat": 3}


def rounded(run: dict) -> dict:
    """A ``run_summary`` as written to the JSON."""
    return {k: _r(v, _DECIMALS[k]) if k in _DECIMALS else v for k, v in run.items()}


# ---- lossless check ----
def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where two token lists differ (the shorter length if one is a prefix of
    the other), None when equal.

    >>> first_difference([1, 2, 3], [1, 2, 3]) is None
    True
    >>> first_difference([1, 2, 3], [1, 5, 3]), first_difference([1, 2], [1, 2, 3])
    (1, 2)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_round(outputs: dict[str, list[list[int]]], settings: list[Setting],
                  bs: list[int]) -> tuple[list[dict], int]:
    """The mismatches of one round (``outputs``: contender -> rows, the contenders run so far): each
    contender's rows against the smallest B of the same setting, and against ``ar`` at the smallest B (when ar
    ran). Returns (one dict per mismatching row: contender, reference, row, first differing position; the
    number of row comparisons made)."""
    out, compared = [], 0
    b0 = min(bs)
    ar_label = contender_label(Setting("ar", "ar", 1), b0)
    ar = outputs.get(ar_label)
    for s in settings:
        own = outputs.get(contender_label(s, b0))
        for b in bs:
            label = contender_label(s, b)
            rows = outputs.get(label)
            if rows is None:
                continue
            refs = []
            if b != b0 and s.method != "ar":
                refs.append((contender_label(s, b0), own))
            if s.method != "ar" or b != b0:
                refs.append((ar_label, ar))
            for ref_label, ref in refs:
                if ref is None:
                    continue
                for row_idx, (got, want) in enumerate(zip(rows, ref)):
                    compared += 1
                    pos = first_difference(got, want)
                    if pos is not None:
                        out.append({"contender": label, "reference": ref_label, "row": row_idx, "position": pos})
    return out, compared


# ---- summary ----
def _per(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


def _r(x: Optional[float], nd: int) -> Optional[float]:
    return None if x is None else round(x, nd)


def tokens_per_s(run: dict) -> Optional[float]:
    """Output tokens of a run (a ``run_summary``) over its wall time, prefills included."""
    return _per(run["output_tokens"], run["wall_s"])


def decode_tokens_per_s(run: dict) -> Optional[float]:
    """Output tokens over the wall time without the prefills (each runs alone, its batch-mates waiting): the
    part of the run that batching can speed up.

    >>> decode_tokens_per_s({"output_tokens": 30, "wall_s": 2.0, "prefill_ms": 500.0})
    20.0
    """
    decode_s = run["wall_s"] - run["prefill_ms"] / 1000.0
    return run["output_tokens"] / decode_s if decode_s > 0 else None


def per_round_ratios(tps: dict[str, list[Optional[float]]], num: str, den: str) -> list[float]:
    """tokens/s of ``num`` over ``den`` in each round where both ran.

    >>> per_round_ratios({"a": [2.0, 3.0, None], "b": [1.0, 2.0, 1.0]}, "a", "b")
    [2.0, 1.5]
    """
    return [x / y for x, y in zip(tps.get(num, []), tps.get(den, [])) if x is not None and y]


# a summary row's medians over rounds: key -> (the figure of one run summary, decimals)
MEDIANS: dict[str, tuple[Callable[[dict], Optional[float]], int]] = {
    "tokens_per_s": (tokens_per_s, 2),
    "decode_tokens_per_s": (decode_tokens_per_s, 2),
    "forwards_per_s": (lambda r: _per(r["forwards"], r["wall_s"]), 2),
    "rows_per_forward": (lambda r: _per(r["rows"], r["forwards"]), 2),
    "streams_per_forward": (lambda r: _per(r["stream_steps"], r["forwards"]), 2),
    "mat": (lambda r: _per(r["output_tokens"], r["row_steps"]), 3),
    "prefill_ms_per_join": (lambda r: _per(r["prefill_ms"], r["prefills"]), 1),
    "prefill_share": (lambda r: _per(r["prefill_ms"] / 1000.0, r["wall_s"]), 4),
    "stall_share": (lambda r: _per(r["stall_ms"] / 1000.0, r["wall_s"]), 4),
    "stall_stream_ms_per_join": (lambda r: _per(r["stall_stream_ms"], r["prefills"]), 1),
    "wall_s": (lambda r: r["wall_s"], 2),
}
ROW_KEYS = ("contender", "setting", "method", "capacity", "streams", "rounds", "tokens_per_s", "tokens_per_s_min",
            "tokens_per_s_max", "ratio_to_b1", "ratio_to_ar_b1", "decode_tokens_per_s", "decode_ratio_to_b1",
            "forwards_per_s", "rows_per_forward", "streams_per_forward", "mat", "prefill_ms_per_join",
            "prefill_share", "stall_share", "stall_stream_ms_per_join", "tuner_capacity", "row_capacities", "wall_s",
            "output_tokens")


def summarize(runs: dict[str, list[Optional[dict]]], settings: list[Setting], bs: list[int]) -> list[dict]:
    """One row per contender over the rounds done (``runs``: contender -> its ``run_summary`` per round):
    medians, and the ratios computed per round then medianed."""
    tps = {k: [tokens_per_s(r) if r is not None else None for r in v] for k, v in runs.items()}
    dtps = {k: [decode_tokens_per_s(r) if r is not None else None for r in v] for k, v in runs.items()}
    rows = []
    for s in settings:
        for b in bs:
            recs = [r for r in runs.get(contender_label(s, b), []) if r is not None]
            if recs:
                rows.append(contender_row(s, b, recs, tps=tps, dtps=dtps, b0=min(bs)))
    return rows


def contender_row(s: Setting, b: int, recs: list[dict], *, tps: dict[str, list[Optional[float]]],
                  dtps: dict[str, list[Optional[float]]], b0: int) -> dict:
    """The summary row of contender ``s`` at B = ``b`` from its runs ``recs`` (``tps`` / ``dtps``: every
    contender's tokens/s and decode tokens/s per round, for the ratios; ``b0``: the smallest B)."""
    label, own_b0, ar_b0 = contender_label(s, b), contender_label(s, b0), contender_label(Setting("ar", "ar", 1), b0)
    row: dict[str, Any] = {key: _r(common.median(f(r) for r in recs), nd) for key, (f, nd) in MEDIANS.items()}
    speeds = [x for x in map(tokens_per_s, recs) if x is not None]
    choices = [r["tuner_choice"] for r in recs if r["tuner_choice"] is not None]
    row.update(contender=label, setting=s.label, method=s.method, capacity=s.capacity, streams=b, rounds=len(recs),
               tokens_per_s_min=_r(min(speeds, default=None), 2), tokens_per_s_max=_r(max(speeds, default=None), 2),
               ratio_to_b1=_r(common.median(per_round_ratios(tps, label, own_b0)), 3),
               ratio_to_ar_b1=_r(common.median(per_round_ratios(tps, label, ar_b0)), 3) if ar_b0 in tps else None,
               decode_ratio_to_b1=_r(common.median(per_round_ratios(dtps, label, own_b0)), 3),
               tuner_capacity=statistics.median_low(choices) if choices else None,
               row_capacities=row_capacities(recs) or None, output_tokens=recs[0]["output_tokens"])
    return {key: row[key] for key in ROW_KEYS}


def row_capacities(recs: list[dict]) -> dict[str, int]:
    """Rows per capacity (``GenerationResult.stats.capacity``) over the runs.

    >>> row_capacities([{"row_capacities": {"4": 2}}, {"row_capacities": {"4": 1, "8": 1}}])
    {'4': 3, '8': 1}
    """
    caps: dict[str, int] = {}
    for r in recs:
        for c, n in r["row_capacities"].items():
            caps[str(c)] = caps.get(str(c), 0) + n
    return caps


# ---- output ----
DEFINITIONS = [
    "tokens/s: output tokens of all prompts over the wall time of decoding them all (prefills included) with at "
    "most B streams in flight; the median over rounds (min..max in the JSON).",
    "x B=1, x ar B=1: tokens/s over that of the same method+capacity at the smallest B, and over ar at the "
    "smallest B, each computed within a round and then medianed over rounds.",
    "decode tokens/s, decode x B=1: the same without the prefills' time (wall time minus every joining row's "
    "prefill; B streams cannot share a prompt forward, so this is the part batching speeds up), ratio per round "
    "then medianed.",
    "forwards/s: batched verify forwards per second of wall time (a prefill is not counted); rows/forward: tree "
    "rows verified per forward (all streams together); streams/forward: streams whose trees shared a forward "
    "(below B while the batch fills at the start or drains at the end).",
    "MAT: output tokens per target forward of a row (its prefill counted as one), over all rows.",
    "prefill ms/join: wall ms of one joining row's prefill (it runs alone, before the step's batched verify: a "
    "separate prefill); prefill share: all prefills' time over the wall time; stall share: the prefills that "
    "ran while other streams were in flight (they wait for it) over the wall time; stall stream-ms/join: per "
    "joining row, its prefill ms times the streams it held up (JSON).",
    "capacity chosen: capacity auto only, the tuner's choice at B streams after the round (median over rounds; "
    "the JSON has each row's GenerationResult.stats.capacity); ar is capacity 1, pld its default chain "
    "(pld_num_tokens copied tokens after the root).",
    "mismatches: rows whose tokens differ from the smallest-B output of the same method+capacity or from ar at "
    "the smallest B in the same round (greedy decoding is lossless: must be 0).",
]


def render_md(d: dict) -> str:
    """The Markdown of a result dict (``run``'s): how it was run, the lossless verdict, one table row per
    contender, the B=4 figures and the column definitions."""
    s, loss = d["settings"], d["lossless"]
    lens = s["prompt_tokens"]
    lines = [f"# Throughput of one actor, B streams per forward ({d['stamp']})", "",
             f"Reproduce: `{d['command']}`", "",
             *([f"Summary columns recomputed on {d['resummarized_at']} from the runs in the JSON "
                "(`python -m benchmarks.throughput --resummarize`); the measurements are those of the run.", ""]
               if d.get("resummarized_at") else []),
             _machine_text(d["machine"]), "",
             f"Settings: model {s['model']}, {s['prompts']} {s['prompt_source']} (prompt tokens "
             f"{min(lens)}..{max(lens)}, median {statistics.median(lens):g}), {s['max_new_tokens']} new tokens, "
             f"greedy, B in {s['streams']}, {_progress(s)}, contenders interleaved in an order rotated per round. "
             f"One Engine per config ({', '.join(s['settings'])}) with streams={max(s['streams'])}; a fresh job "
             "draft state per contender and round.", "",
             f"**Lossless: {loss['mismatches']} mismatches** in {loss['compared']} row comparisons "
             "(every row at every B against the smallest-B output of the same method+capacity and against ar).", ""]
    if loss["examples"]:
        lines += ["First mismatches: " + "; ".join(
            f"{x['contender']} row {x['row']} vs {x['reference']} at token {x['position']} (round {x['round']})"
            for x in loss["examples"]), ""]
    lines += [_table(d["rows"]), *_at_b4(d), "",
              "Engines (set-up seconds: weight packing, warm-up, capacity auto's cost curve): "
              + ", ".join(f"{k} {v['setup_s']} s" for k, v in d["engines"].items()), "", "Columns:", "",
              *[f"- {x}" for x in DEFINITIONS], ""]
    return "\n".join(lines)


def _machine_text(m: dict) -> str:
    """The header's machine line (a file written before ``common.machine`` has only the CPU's name)."""
    name = common.machine_line(m) if "isa" in m else f"{m['cpu']} ({m['cores']} cores)"
    return (f"Machine: {name}, torch {m['torch']} with {m['torch_threads']} threads; load average "
            f"{m['load_start']} at start, {m.get('load', m.get('load_now'))} at the last write.")


def _progress(s: dict) -> str:
    """How much of the run the file holds: ``3 of 3 rounds``, or where a partial run stopped."""
    done = f"{s['rounds_done']} of {s['rounds']} rounds"
    if s.get("contenders_in_partial_round"):
        done += (f" and {s['contenders_in_partial_round']} of the {s['contenders']} contenders of round "
                 f"{s['rounds_done'] + 1}")
    if s["rounds_done"] < s["rounds"]:
        done += " (**partial: the run is unfinished or was stopped**)"
    return done


TABLE = (("method", "setting"), ("capacity", None), ("B", "streams"), ("tokens/s", "tokens_per_s"),
         ("x B=1", "ratio_to_b1"), ("x ar B=1", "ratio_to_ar_b1"), ("decode tokens/s", "decode_tokens_per_s"),
         ("decode x B=1", "decode_ratio_to_b1"), ("forwards/s", "forwards_per_s"), ("rows/forward", "rows_per_forward"),
         ("streams/forward", "streams_per_forward"), ("MAT", "mat"), ("prefill ms/join", "prefill_ms_per_join"),
         ("prefill share", "prefill_share"), ("stall share", "stall_share"), ("capacity chosen", "tuner_capacity"),
         ("mismatches", "mismatches"))  # (column, row key; capacity: pld's is its chain)


def _table(rows: list[dict]) -> str:
    return common.md_table([col for col, _ in TABLE], [
        [("chain" if r["method"] == "pld" else r["capacity"]) if key is None else r.get(key) for _, key in TABLE]
        for r in rows])


def _at_b4(d: dict) -> list[str]:
    """B=4 over B=1 per setting (issue 14's target), when the run has both."""
    at4 = [r for r in d["rows"]
           if r["streams"] == 4 and r["ratio_to_b1"] is not None and min(d["settings"]["streams"]) == 1]
    if not at4:
        return []
    line = "B=4 over B=1 (issue 14's target on this CPU: at least 2x): " + ", ".join(
        f"{r['setting']} {r['ratio_to_b1']}x" for r in at4) + "."
    if all(r.get("decode_ratio_to_b1") is not None for r in at4):
        line += " Decode only (prefills left out): " + ", ".join(
            f"{r['setting']} {r['decode_ratio_to_b1']}x" for r in at4) + "."
    return ["", line]


def write_results(d: dict, out_dir: Path, *, stamp: str) -> tuple[Path, Path]:
    """``throughput-<stamp>.json`` and ``.md`` (rewritten with the same stamp after every contender)."""
    return common.write_results(out_dir, f"throughput-{stamp}", d, render_md(d))


# ---- the run ----
def build_engines(bundle: ModelBundle, settings: list[Setting], *, streams: int, longest: list[int],
                  max_new_tokens: int) -> tuple[dict[str, Engine], dict[str, dict]]:
    """One engine per setting (``streams`` slots), its first-touch costs paid outside the rounds; returns the
    engines and what the JSON says of each (config, runner, set-up seconds, capacity auto's cost curve)."""
    engines: dict[str, Engine] = {}
    info: dict[str, dict] = {}
    for s in settings:
        t0 = time.perf_counter()
        _use_isa(s.isa)
        engine = Engine(bundle, s.config(), streams=streams)
        # first-touch costs outside the rounds: the longest prompt's prefill chunks, and the KV cache grown (all
        # slots) to what the longest row needs, a few steps decoded, then cancelled
        ticks = itertools.count()
        engine.generate(longest, GenerationParams(max_new_tokens=max_new_tokens),
                        should_cancel=lambda ticks=ticks: next(ticks) >= 4)
        engines[s.label] = engine
        tuner = engine.tuner
        info[s.label] = {"config": s.config().model_dump(mode="json"), "runner": engine.runner.kind,
                         "matmul": getattr(engine.runner, "matmul", None),
                         "setup_s": round(time.perf_counter() - t0, 1),
                         "cost_curve_ms": ({str(k): round(v, 2) for k, v in engine.cost_curve_ms.items()}
                                           if tuner is not None else None),
                         "auto_candidates": tuner.candidates if tuner is not None else None}
        log.info("engine %s ready in %.1f s", s.label, info[s.label]["setup_s"])
    return engines, info


def run(bundle: ModelBundle, prompts: list[Prompt], *, settings: list[Setting], bs: list[int], max_new_tokens: int,
        rounds: int, on_round: Optional[Callable[[dict], None]] = None, system_prompt: Optional[str] = None,
        command: str = "", stamp: str = "", prompt_source: str = "given prompts",
        ids: Optional[Sequence[str]] = None, run_id: Optional[str] = None) -> dict:
    """Build one engine per setting, then ``rounds`` interleaved rounds over every (setting, B); returns the
    result dict (``on_round`` gets the results so far after every contender too). Each contender's rows are
    ``RowRecord``s of the job ``run_id`` (default ``throughput-<stamp>``) routed to the contender's label, with
    ``ids`` (default ``prompt-<i>``) as the prompts' ids."""
    prompt_ids = [encode_prompt(bundle.tokenizer, p, system_prompt=system_prompt) for p in prompts]
    run_id = run_id or f"throughput-{stamp or common.stamp()}"
    engines, engine_info = build_engines(bundle, settings, streams=max(bs), longest=max(prompt_ids, key=len),
                                         max_new_tokens=max_new_tokens)
    contenders = [(s, b) for s in settings for b in bs]
    runs: dict[str, list[dict]] = {contender_label(s, b): [] for s, b in contenders}
    mismatches: list[dict] = []
    d: dict = {}
    load_start = common.machine()["load"]
    compared = 0

    def snapshot(rnd: int, outputs: dict[str, list[list[int]]]) -> dict:
        """The results so far: rounds before ``rnd`` complete, round ``rnd`` up to the contenders in ``outputs``."""
        now, n_now = compare_round(outputs, settings, bs)
        bad = mismatches + [dict(x, round=rnd + 1) for x in now]
        rows = summarize(runs, settings, bs)
        for row in rows:
            row["mismatches"] = sum(x["contender"] == row["contender"] for x in bad)
        full = len(outputs) == len(contenders)
        return {
            "command": command, "stamp": stamp, "run_id": run_id, "written_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": dict(common.machine(), torch_threads=torch.get_num_threads(), load_start=load_start),
            "settings": {"model": bundle.name, "prompts": len(prompt_ids),
                         "prompt_tokens": [len(p) for p in prompt_ids],
                         "prompt_source": prompt_source, "max_new_tokens": max_new_tokens, "streams": bs,
                         "rounds": rounds, "rounds_done": rnd + 1 if full else rnd,
                         "contenders": len(contenders), "contenders_in_partial_round": 0 if full else len(outputs),
                         "settings": [s.label for s in settings], "system_prompt": system_prompt},
            "engines": engine_info,
            "lossless": {"mismatches": len(bad), "compared": compared + n_now, "examples": bad[:5]},
            "rows": rows,
            "runs": {label: [rounded(r) for r in recs] for label, recs in runs.items()},
        }

    for rnd in range(rounds):
        k = rnd % len(contenders)
        outputs: dict[str, list[list[int]]] = {}
        for s, b in contenders[k:] + contenders[:k]:
            label = contender_label(s, b)
            _use_isa(s.isa)
            origin = RowOrigin(id="", row_idx=0, route=label, model=bundle.name, method=s.method,
                               config_hash=s.config().config_hash(), job_id=run_id)
            records, outputs[label], stats, extra = decode_all(engines[s.label], prompt_ids, streams=b,
                                                               max_new_tokens=max_new_tokens, origin=origin, ids=ids)
            runs[label].append(run_summary(records, stats, extra))
            log.info("round %d %s: %.2f tokens/s", rnd + 1, label, runs[label][-1]["tokens_per_s"])
            d = snapshot(rnd, outputs)
            if on_round is not None:  # after every contender: a run stopped midway keeps what it measured
                on_round(d)
        now, n_now = compare_round(outputs, settings, bs)
        mismatches += [dict(x, round=rnd + 1) for x in now]
        compared += n_now
    return d


def resummarize(path: Path) -> tuple[Path, Path]:
    """Rewrite ``throughput-<stamp>.json`` / ``.md`` with the current ``summarize`` over the runs the JSON
    holds: columns added since it was written are filled in, every value it had (the measured runs, the
    lossless verdict, each row's figures and mismatch count) is kept as written. Returns the two paths.

    Raises:
        ValueError: the file is not a throughput result (no ``runs`` / ``rows``).
    """
    d = json.loads(path.read_text())
    if not isinstance(d, dict) or "runs" not in d or "rows" not in d:
        raise ValueError(f"{path} is not a throughput-*.json result")
    settings: list[Setting] = []
    for row in d["rows"]:
        if all(x.label != row["setting"] for x in settings):
            settings.append(Setting(row["setting"], row["method"], row["capacity"]))
    old = {row["contender"]: row for row in d["rows"]}
    rows = summarize(d["runs"], settings, list(d["settings"]["streams"]))
    for row in rows:
        # what the file already had (its mismatch count included) stays as written: the JSON's runs are
        # rounded, so a recomputed median can move in its last digit; only the columns it lacked are added
        row.update(old.get(row["contender"], {}))
        row.setdefault("mismatches", 0)
    d["rows"] = rows
    d["resummarized_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return write_results(d, path.parent, stamp=d["stamp"])


def parse_list(text: str, *, allow_auto: bool = False) -> list:
    """``"auto,4,8"`` -> ``["auto", 4, 8]`` (``auto`` only where allowed).

    Raises:
        argparse.ArgumentTypeError: an item that is not a positive int (or ``auto``).
    """
    out: list = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if allow_auto and item == "auto":
            out.append("auto")
        elif item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            what = "a positive integer" + (" or 'auto'" if allow_auto else "")
            raise argparse.ArgumentTypeError(f"{item!r} is not {what}")
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=common.prog("throughput"), description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="ar,pld,racer", help="comma list of ar, pld, racer")
    p.add_argument("--racer-capacities", default="auto,4,8,12", help="racer capacities: ints and/or auto")
    p.add_argument("--streams", default=None, help="B: streams in flight per forward (default 1,2,4,8)")
    p.add_argument("--prompts", type=int, default=None, help="Spec-Bench first turns, a deterministic sample "
                   "(default 24)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    p.add_argument("--rounds", type=int, default=None, help="default 3")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--system", default=None, help="a system message before every prompt (default none)")
    p.add_argument("--smoke", action="store_true", help="2 prompts, 16 tokens, B 1 and 2, one round: a check that the "
                   "script runs (minutes, not seconds: every contender's engine is built, capacity auto measures its "
                   "cost curve)")
    p.add_argument("--out", default=str(common.OUT))
    p.add_argument("--tag", default=None, help="appended to the file stamp")
    p.add_argument("--resummarize", default=None, metavar="JSON", help="rewrite a committed throughput-*.json "
                   "and its .md with this version's summary columns from the runs it holds (no decoding)")
    p.add_argument("--isas", default=None, help="our CPU kernels' instruction sets side by side, e.g. avx512,avx2 "
                   "(the first keeps the plain labels; default: the machine's own only)")
    return p


def grid(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[int], list[Setting]]:
    """The B values and the settings the arguments ask for (``--smoke``'s or the defaults filled in first);
    a bad value is a usage error (``p.error``)."""
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():  # a flag given beats --smoke
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        bs = sorted(set(parse_list(args.streams)))
        caps = parse_list(args.racer_capacities, allow_auto=True)
        settings = settings_of([m.strip() for m in args.methods.split(",") if m.strip()], caps)
        isas = [x.strip() for x in (args.isas or "").split(",") if x.strip()]
        if any(x not in ("avx2", "avx512") for x in isas):
            raise ValueError(f"--isas takes avx2 and/or avx512, got {args.isas!r}")
        settings = with_isas(settings, isas)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))
    if args.rounds < 1 or args.max_new_tokens < 1 or args.prompts < 1:
        p.error("--rounds, --max-new-tokens and --prompts must be >= 1")
    return bs, settings


def bench_prompts(n: int, prompts: Optional[list[Prompt]]) -> tuple[list[Prompt], list[str], str]:
    """The first ``n`` prompts, their ids and how the JSON names their source: ``prompts`` as given (ids
    ``prompt-<i>``), else ``n`` Spec-Bench first turns under the chat template (ids their item ids)."""
    if prompts is not None:
        given = list(prompts)[:n]
        return given, [f"prompt-{i}" for i in range(len(given))], "given prompts"
    items = common.spec_bench_prompts(n)
    return ([conversation([it.turns[0]], []) for it in items], [it.item_id for it in items],
            "Spec-Bench first turns (chat template, short and long categories alternating)")


def main(argv: Optional[list[str]] = None, *, bundle: Optional[ModelBundle] = None,
         prompts: Optional[list[Prompt]] = None) -> int:
    """The CLI. ``bundle`` / ``prompts`` replace the model and the Spec-Bench sample (tests: a tiny model with
    plain-text prompts); the first ``--prompts`` of ``prompts`` are used."""
    p = parser()
    args = p.parse_args(argv)
    if args.resummarize:
        jpath, mpath = resummarize(Path(args.resummarize))
        print(f"rewrote {jpath} and {mpath}")
        return 0
    bs, settings = grid(p, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    if bundle is None:
        bundle = load_model(args.model, device="cpu", dtype="float32")
    prompts, ids, source = bench_prompts(args.prompts, prompts)
    stamp = common.stamp() + (f"-{args.tag}" if args.tag else "")
    command = common.command("throughput", argv)
    out = Path(args.out)
    paths: list[Path] = []

    def write(d: dict) -> None:
        paths[:] = write_results(d, out, stamp=stamp)
        log.info("wrote %s (%d of %d rounds done)", paths[1], d["settings"]["rounds_done"], d["settings"]["rounds"])

    d = run(bundle, prompts, settings=settings, bs=bs, max_new_tokens=args.max_new_tokens, rounds=args.rounds,
            on_round=write, system_prompt=args.system, command=command, stamp=stamp, prompt_source=source, ids=ids,
            run_id=f"throughput-{stamp}")
    print(render_md(d))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 1 if d["lossless"]["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
