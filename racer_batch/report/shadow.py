"""Shadow comparison: the job's decoding config against a baseline on the same sampled rows.

Input: shadow records (service/results/shadow.py SHADOW_SCHEMA), two per sampled row: ``side = "method"`` and
``side = "baseline"``, grouped by ``run`` ("job" for rows shadowed inside the job, "posthoc:<baseline>" for
`racer-batch shadow`). Per run and route:

- exact-match rate of the answers (every turn's text). Greedy decoding is lossless, so greedy pairs must
  match 100%; sampled pairs are not expected to match token for token (the methods draw from the generator
  at different points), so for them the report compares output lengths and finish reasons instead.
- first divergence of a mismatch: (turn, character offset) of the first differing character.
- speed ratio (docs/method.md section 1): (baseline total ms / baseline tokens) / (method total ms / method tokens),
  token-weighted, generation time with prefill; > 1 means the method is faster. Confidence interval by a
  percentile bootstrap over rows (pairs resampled with replacement, the ratio recomputed each time).
- MAT of each side: output tokens / steps.
- capability (``capability_summary``; measures in racer_batch/capability.py), over all pairs, greedy and
  sampled: exact-match rate; per side, answer accuracy on the turns whose reference can be scored
  automatically (numeric or short answers; None when none can), mean output tokens and characters per row,
  mean repeated-4-gram rate per answer turn, finish-reason counts. This is what a run with relaxed
  acceptance (``acceptance_rule``: outputs differ by design) must show beside its speed ratio.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from racer_batch.capability import REPEAT_N, accuracy, answer_correct, mean, repeated_ngram_rate, text_units
from racer_batch.report.aggregate import OVERALL
from racer_batch.values import DecodingConfig


@dataclass(frozen=True)
class Pair:
    """One sampled row answered by both sides (status ok on both)."""

    id: str
    route: str
    method_ms: float  # prefill + decode
    method_tokens: int
    method_steps: int
    baseline_ms: float
    baseline_tokens: int
    baseline_steps: int
    method_texts: tuple[str, ...]
    baseline_texts: tuple[str, ...]
    method_finish: Optional[str] = None
    baseline_finish: Optional[str] = None
    greedy: bool = True
    references: tuple[Optional[str], ...] = ()  # reference answer per turn (empty: the row has none)


def first_divergence(a: Sequence[str], b: Sequence[str]) -> Optional[tuple[int, int]]:
    """(turn, character offset) where two answers (lists of turn texts) first differ; None when equal.

    >>> first_divergence(["abc"], ["abc"]) is None
    True
    >>> first_divergence(["hello", "abcd"], ["hello", "abXd"])
    (1, 2)
    >>> first_divergence(["abc"], ["abcdef"])  # one is a prefix of the other: diverges at its end
    (0, 3)
    >>> first_divergence(["a"], ["a", "b"])  # one has an extra turn
    (1, 0)
    """
    for turn in range(max(len(a), len(b))):
        if turn >= len(a) or turn >= len(b):
            return (turn, 0)
        x, y = a[turn], b[turn]
        if x == y:
            continue
        n = min(len(x), len(y))
        for i in range(n):
            if x[i] != y[i]:
                return (turn, i)
        return (turn, n)
    return None


def speed_ratio(pairs: Sequence[Pair]) -> Optional[float]:
    """Token-weighted speed ratio baseline/method (> 1: the method is faster); None without time or tokens.

    Example: method 2 rows (1000 ms, 100 tokens), (1000 ms, 100 tokens) -> 10 ms/token; baseline
    (3000 ms, 100), (1000 ms, 100) -> 20 ms/token; ratio 20 / 10 = 2.0.
    """
    mt = sum(p.method_tokens for p in pairs)
    bt = sum(p.baseline_tokens for p in pairs)
    mm = sum(p.method_ms for p in pairs)
    bm = sum(p.baseline_ms for p in pairs)
    if not (mt and bt and mm > 0 and bm > 0):
        return None
    return (bm / bt) / (mm / mt)


def bootstrap_ci(pairs: Sequence[Pair], *, n_boot: int = 2000, level: float = 0.95, seed: int = 0
                 ) -> Optional[tuple[float, float]]:
    """Percentile bootstrap interval of ``speed_ratio`` over rows; None with fewer than 2 pairs."""
    assert 0 < level < 1, f"level must be in (0, 1), got {level}"
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    n = len(pairs)
    stats = []
    for _ in range(n_boot):
        r = speed_ratio([pairs[rng.randrange(n)] for _ in range(n)])
        if r is not None:
            stats.append(r)
    if not stats:
        return None
    stats.sort()
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2
    return _quantile(stats, lo_q), _quantile(stats, hi_q)


def _quantile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_vals) - 1)
    i = int(pos)
    if i + 1 >= len(sorted_vals):
        return sorted_vals[-1]
    return sorted_vals[i] + (sorted_vals[i + 1] - sorted_vals[i]) * (pos - i)


def acceptance_rule(decoding: Optional[dict]) -> Optional[str]:
    """The relaxed acceptance rule of a stored decoding config (a job manifest's ``spec.decoding``) in words;
    None when it decodes losslessly (the default, also when the key is absent).

    >>> acceptance_rule({"method": "racer", "acceptance": "topk", "relaxed_topk": 3})
    "topk: a draft token is accepted when it is among the target's 3 most likely tokens"
    >>> acceptance_rule({"acceptance": "threshold"})  # relaxed_threshold at its default
    'threshold: a draft token is accepted when the target gives it probability >= 0.1'
    >>> acceptance_rule({"method": "racer"}) is None
    True
    """
    dec = decoding or {}
    kind = dec.get("acceptance", "lossless")
    if kind == "lossless":
        return None
    fields = DecodingConfig.model_fields
    if kind == "topk":
        k = dec.get("relaxed_topk", fields["relaxed_topk"].default)
        return f"topk: a draft token is accepted when it is among the target's {k} most likely tokens"
    if kind == "threshold":
        t = dec.get("relaxed_threshold", fields["relaxed_threshold"].default)
        return f"threshold: a draft token is accepted when the target gives it probability >= {t:g}"
    return f"{kind} (unknown acceptance rule)"


def exact_match_rate(pairs: Sequence[Pair]) -> Optional[float]:
    """Share of pairs whose answers are equal on every turn; None without pairs."""
    if not pairs:
        return None
    return sum(first_divergence(p.method_texts, p.baseline_texts) is None for p in pairs) / len(pairs)


def _turn_refs(p: Pair, n_turns: int) -> list[Optional[str]]:
    refs = list(p.references[:n_turns])
    return refs + [None] * (n_turns - len(refs))


def _side_capability(pairs: Sequence[Pair], side: str) -> dict:
    """Capability measures of one side ("method" or "baseline") over the pairs; see capability_summary."""
    texts = [getattr(p, f"{side}_texts") for p in pairs]
    scores = [answer_correct(t, ref) for p, ts in zip(pairs, texts) for t, ref in zip(ts, _turn_refs(p, len(ts)))]
    correct, scored = accuracy(scores)
    return {
        "accuracy": correct / scored if scored else None, "correct": correct, "scored": scored,
        "mean_tokens": mean(getattr(p, f"{side}_tokens") for p in pairs),
        "mean_chars": mean(sum(len(t) for t in ts) for ts in texts),
        "repeated_ngram_rate": mean(repeated_ngram_rate(text_units(t), REPEAT_N) for ts in texts for t in ts),
        "finish": dict(collections.Counter(str(getattr(p, f"{side}_finish")) for p in pairs)),
    }


def capability_summary(pairs: Sequence[Pair]) -> Optional[dict]:
    """What changes in the answers, beside the speed: None without pairs, else

    - ``exact_match_rate``: share of pairs (greedy and sampled) whose answers are equal on every turn;
    - ``turns``: answer turns compared (the method side's), ``turns_with_reference``: those with a reference;
    - per side (``method``, ``baseline``): ``accuracy`` = correct / scored over the turns whose reference can be
      scored (capability.answer_correct; None when none can), ``correct``, ``scored``; ``mean_tokens`` and
      ``mean_chars`` per row (all turns); ``repeated_ngram_rate``: mean over answer turns of the repeated
      n-gram rate (n = ``repeat_n`` = 4) of the turn's text units (turns shorter than n units left out; None
      when all are); ``finish``: finish-reason counts per row.

    Example: one pair, reference "18", method answer "so 18", baseline answer "so 17" -> method accuracy 1.0
    (1/1), baseline 0.0 (0/1), exact match 0.0.
    """
    if not pairs:
        return None
    return {
        "pairs": len(pairs),
        "exact_match_rate": exact_match_rate(pairs),
        "repeat_n": REPEAT_N,
        "turns": sum(len(p.method_texts) for p in pairs),
        "turns_with_reference": sum(r is not None for p in pairs for r in _turn_refs(p, len(p.method_texts))),
        "method": _side_capability(pairs, "method"),
        "baseline": _side_capability(pairs, "baseline"),
    }


@dataclass
class ShadowResult:
    """Comparison of one run on one route (or OVERALL)."""

    run: str
    route: str
    method: str
    baseline: str
    sampled_rows: int  # rows with both records
    pairs: list[Pair] = field(default_factory=list)  # both sides ok
    job_text_matches: Optional[int] = None  # method side == the job's own output (post-hoc re-runs)
    job_text_compared: int = 0
    acceptance: Optional[str] = None  # relaxed acceptance rule of the method side (acceptance_rule); None: lossless

    @property
    def greedy_pairs(self) -> list[Pair]:
        return [p for p in self.pairs if p.greedy]

    @property
    def sampled_pairs(self) -> list[Pair]:
        return [p for p in self.pairs if not p.greedy]

    def mismatches(self) -> list[tuple[str, tuple[int, int]]]:
        """(row id, first divergence) of every pair whose answers differ."""
        out = []
        for p in self.pairs:
            d = first_divergence(p.method_texts, p.baseline_texts)
            if d is not None:
                out.append((p.id, d))
        return out

    def to_dict(self, *, n_boot: int = 2000) -> dict:
        """Every number of the comparison as plain JSON types (the report's ``shadow`` entries)."""
        ratio = speed_ratio(self.pairs)
        ci = bootstrap_ci(self.pairs, n_boot=n_boot)
        ms = sum(p.method_steps for p in self.pairs)
        bs = sum(p.baseline_steps for p in self.pairs)
        mt = sum(p.method_tokens for p in self.pairs)
        bt = sum(p.baseline_tokens for p in self.pairs)
        sp = self.sampled_pairs
        return {
            "run": self.run, "route": self.route, "method": self.method, "baseline": self.baseline,
            "sampled_rows": self.sampled_rows, "pairs_ok": len(self.pairs),
            "greedy_pairs": len(self.greedy_pairs), "greedy_exact_match_rate": exact_match_rate(self.greedy_pairs),
            "sampled_exact_match_rate": exact_match_rate(sp), "sampling": _sampling_summary(sp),
            "mismatches": [{"id": rid, "turn": d[0], "char": d[1]} for rid, d in self.mismatches()],
            "speed_ratio": ratio, "speed_ratio_ci95": list(ci) if ci else None,
            "mat_method": _ratio(mt, ms), "mat_baseline": _ratio(bt, bs),
            "method_ms": sum(p.method_ms for p in self.pairs), "baseline_ms": sum(p.baseline_ms for p in self.pairs),
            "method_tokens": mt, "baseline_tokens": bt,
            "job_text_matches": self.job_text_matches, "job_text_compared": self.job_text_compared,
            "relaxed": self.acceptance is not None, "acceptance_rule": self.acceptance,
            "capability": capability_summary(self.pairs),
        }


def _ratio(num: float, den: float) -> Optional[float]:
    """num / den; None when den is 0 (MAT of a side without steps)."""
    return num / den if den else None


def _sampling_summary(sp: Sequence[Pair]) -> Optional[dict]:
    """Lengths and finish reasons of the sampled (non-greedy) pairs; None without any."""
    if not sp:
        return None
    return {
        "pairs": len(sp),
        "mean_tokens_method": sum(p.method_tokens for p in sp) / len(sp),
        "mean_tokens_baseline": sum(p.baseline_tokens for p in sp) / len(sp),
        "finish_method": dict(collections.Counter(p.method_finish for p in sp)),
        "finish_baseline": dict(collections.Counter(p.baseline_finish for p in sp)),
    }


def _texts(rec: dict) -> tuple[str, ...]:
    turns = rec.get("turn_texts")
    if turns:
        return tuple(t or "" for t in turns)
    return (rec.get("text") or "",)


def _gen_ms(rec: dict) -> float:
    """A side's actor time: its share of shared forwards (``device_ms``, several rows per forward), else its
    prefill + decode time."""
    if rec.get("device_ms") is not None:
        return float(rec["device_ms"])
    return float(rec.get("prefill_ms") or 0.0) + float(rec.get("decode_ms") or 0.0)


def _int(rec: dict, key: str) -> int:
    """An integer field of a shadow record, 0 when null or absent."""
    return int(rec.get(key) or 0)


def _pair(m: dict, b: dict) -> Pair:
    """The Pair of one row's method record ``m`` and baseline record ``b`` (both status ok)."""
    return Pair(
        id=str(m["id"]), route=m["route"], method_ms=_gen_ms(m), baseline_ms=_gen_ms(b),
        method_tokens=_int(m, "output_tokens"), baseline_tokens=_int(b, "output_tokens"),
        method_steps=_int(m, "steps"), baseline_steps=_int(b, "steps"),
        method_texts=_texts(m), baseline_texts=_texts(b), method_finish=m.get("finish_reason"),
        baseline_finish=b.get("finish_reason"), greedy=float(m.get("temperature") or 0.0) == 0.0,
        references=tuple(m.get("reference") or b.get("reference") or ()),
    )


def _observe(res: ShadowResult, m: dict, b: dict, *, job_row: Optional[dict]) -> None:
    """Add one sampled row to a group: its pair when both sides are ok, and, with the job's own output record
    ``job_row`` (post-hoc runs only), whether the method side reproduced the job's answer."""
    res.sampled_rows += 1
    if m["status"] == "ok" and b["status"] == "ok":
        res.pairs.append(_pair(m, b))
    if job_row is not None and m["status"] == "ok":
        res.job_text_compared += 1
        same = _texts(job_row) == _texts(m)
        res.job_text_matches = (res.job_text_matches or 0) + int(same)


def analyze(records: Iterable[dict], *, job_rows: Optional[dict[int, dict]] = None,
            decoding: Optional[dict] = None) -> list[ShadowResult]:
    """Pair the records by (run, row_idx) and compare per run and route, plus OVERALL per run.

    ``job_rows`` (row_idx -> output record) lets a post-hoc run also check that its re-run of the method
    reproduced the job's own answers. ``decoding`` is the job's stored decoding config (the manifest's
    ``spec.decoding``): the method side of every run decodes with it, so a relaxed ``acceptance`` there marks
    every run as relaxed (``acceptance_rule``).
    """
    rule = acceptance_rule(decoding)
    by_key: dict[tuple[str, int], dict[str, dict]] = collections.defaultdict(dict)
    for r in records:
        by_key[(r["run"], int(r["row_idx"]))][r["side"]] = r
    groups: dict[tuple[str, str], ShadowResult] = {}
    for (run, row_idx), sides in sorted(by_key.items()):
        m, b = sides.get("method"), sides.get("baseline")
        if m is None or b is None:
            continue
        job_row = job_rows.get(row_idx) if job_rows is not None and run != "job" else None
        for route in (m["route"], OVERALL):
            res = groups.get((run, route))
            if res is None:
                res = groups[(run, route)] = ShadowResult(run=run, route=route, method=str(m.get("method")),
                                                          baseline=str(b.get("method")), sampled_rows=0,
                                                          acceptance=rule)
            _observe(res, m, b, job_row=job_row)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], k[1] == OVERALL, k[1]))]
