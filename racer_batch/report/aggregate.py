"""Per-route and overall statistics of a job's output rows (the numbers behind `racer-batch report`).

Definitions (every row counts, whatever its status, because its compute was spent):

- ``device_s``: the actor time of the rows (``RowRecord.busy_ms``: a row alone, its generation time, prefill +
  decode; rows batched on one actor, each its share of the batched steps, ``device_ms``) times the devices per
  actor (the job's ``gpus_per_actor`` on GPUs; 1 for a CPU actor). This is what a device was busy for.
- ``wall_s``: the span from the first row's start (its ``finished_at`` minus its generation time) to the last
  row's ``finished_at``. With several actors wall time is shorter than device time.
- ``tokens_per_device_s`` = output tokens / device_s; ``tokens_per_wall_s`` = output tokens / wall_s.
- ``mat`` = output tokens / steps (docs/method.md section 1: the prefill counts as one step that emits one token).
- ``accepted_hist[k]``: steps that accepted k draft tokens, summed over rows (index 0 includes the prefill).
- shares of accepted draft tokens by source: retrieval only, logits only, both, other (PLD).
- ``cost_usd`` = price per device-hour x device_s / 3600; ``cost_per_m_tokens`` = cost / output tokens x 1e6.

Worked example (two rows of one route, one device each, price 3.60 per device-hour)::

    row a: 100 output tokens, 40 steps, prefill 200 ms + decode 1800 ms, finished at t = 10 s
    row b:  50 output tokens, 30 steps, prefill 100 ms + decode  900 ms, finished at t = 12 s
    device_s = 2.0 + 1.0 = 3.0            wall_s = 12 - (10 - 2.0) = 4.0
    tokens_per_device_s = 150 / 3 = 50     mat = 150 / 70 = 2.142...
    cost_usd = 3.60 * 3.0 / 3600 = 0.003   cost_per_m_tokens = 0.003 / 150 * 1e6 = 20.0
"""

from __future__ import annotations

from typing import Iterable, Optional

from racer_batch.service.results.record import RowRecord
from racer_batch.service.results.tally import Tally, epoch_s

OVERALL = "(all)"


class RouteStats:
    """The report's figures of one group of rows, derived from its ``tally`` (service/results/tally.py, which does
    all the counting). ``failed`` in ``to_dict`` is the tally's ``error`` count."""

    def __init__(self, route: str, tally: Optional[Tally] = None) -> None:
        self.route = route
        self.tally = tally if tally is not None else Tally()

    # ---- derived quantities (None when undefined)
    @property
    def device_s(self) -> float:
        return self.tally.device_ms / 1000.0

    @property
    def wall_s(self) -> Optional[float]:
        t = self.tally
        if t.first_start_s is None or t.last_finish_s is None:
            return None
        return t.last_finish_s - t.first_start_s

    @property
    def tokens_per_device_s(self) -> Optional[float]:
        return self.tally.output_tokens / self.device_s if self.tally.device_ms > 0 else None

    @property
    def tokens_per_wall_s(self) -> Optional[float]:
        w = self.wall_s
        return self.tally.output_tokens / w if w else None

    def share(self, source: str) -> Optional[float]:
        """Share of accepted draft tokens from ``source`` (retrieval, logits, both, other)."""
        total = self.tally.accepted_by_source
        return getattr(self.tally, f"accepted_{source}") / total if total else None

    def cost_usd(self, price_per_device_hour: Optional[float]) -> Optional[float]:
        return None if price_per_device_hour is None else price_per_device_hour * self.device_s / 3600.0

    def cost_per_m_tokens(self, price_per_device_hour: Optional[float]) -> Optional[float]:
        cost = self.cost_usd(price_per_device_hour)
        return None if cost is None or not self.tally.output_tokens else cost / self.tally.output_tokens * 1e6

    @property
    def device_hours_per_m_tokens(self) -> Optional[float]:
        tokens = self.tally.output_tokens
        return self.device_s / 3600.0 / tokens * 1e6 if tokens else None

    def to_dict(self, price_per_device_hour: Optional[float] = None) -> dict:
        t = self.tally
        return {
            "route": self.route, "rows": t.rows, "ok": t.ok, "failed": t.error,
            "cancelled": t.cancelled, "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
            "steps": t.steps, "wall_s": self.wall_s, "device_s": self.device_s,
            "tokens_per_device_s": self.tokens_per_device_s, "tokens_per_wall_s": self.tokens_per_wall_s,
            "mat": t.mat, "accepted_hist": list(t.accepted_hist),
            "accepted_draft_tokens": t.accepted_by_source,
            "share_retrieval": self.share("retrieval"), "share_logits": self.share("logits"),
            "share_both": self.share("both"), "share_other": self.share("other"),
            "device_hours_per_m_tokens": self.device_hours_per_m_tokens,
            "cost_usd": self.cost_usd(price_per_device_hour),
            "cost_per_m_tokens": self.cost_per_m_tokens(price_per_device_hour),
        }


def devices_per_actor(spec: dict, device: Optional[str]) -> float:
    """Devices one row occupies: the spec's gpus_per_actor on a GPU (auto = 1), 1 for a CPU actor."""
    if device and not str(device).startswith("cpu"):
        g = (spec.get("resources") or {}).get("gpus_per_actor", "auto")
        return 1.0 if g in ("auto", None, 0) else float(g)
    return 1.0


def aggregate(rows: Iterable[dict], *, by: str = "route", spec: Optional[dict] = None) -> dict[str, RouteStats]:
    """Group output rows (Parquet-row dicts) by the column ``by`` (default route): each row becomes a
    RowRecord counted into one Tally under ``str(row[by])``. Returns {group: stats} sorted, then OVERALL."""
    tally = Tally()
    for row in rows:
        rec = RowRecord.from_row(row)
        tally.observe_row(rec, group=str(row.get(by)), devices=devices_per_actor(spec or {}, rec.device))
    out = {key: RouteStats(key, sub) for key, sub in sorted(tally.routes.items())}
    out[OVERALL] = RouteStats(OVERALL, tally)
    return out


def throughput_timeline(rows: Iterable[dict], *, bins: int = 30, by: str = "route",
                        side_rows: Iterable[dict] = (), side_label: str = "shadow baseline"
                        ) -> tuple[list[float], dict[str, list[float]]]:
    """Output tokens per second of wall time across the job, per group and in total.

    Each row's tokens are spread evenly over its own generation interval [finished_at - gen time,
    finished_at], then summed into ``bins`` equal time bins. Returns (bin centres in seconds since the first
    row started, {group: tokens/s per bin, OVERALL: total}).

    ``side_rows`` (shadow baseline records) form one more series, ``side_label``, left out of the total:
    they show where an actor's time went to the baseline instead of the job.

    Example: one row of 100 tokens generated from t=0 to t=10 s, 2 bins -> centres [2.5, 7.5],
    rates [10.0, 10.0].
    """
    spans = _spans(rows, by=by, side_rows=side_rows, side_label=side_label)
    if not spans:
        return [], {}
    t0 = min(sp[0] for sp in spans)
    width = max(max(sp[1] for sp in spans) - t0, 1e-6) / bins
    series: dict[str, list[float]] = {}
    total = [0.0] * bins
    for s, e, tok, g, in_total in spans:
        arr = series.setdefault(g, [0.0] * bins)
        for b, frac in enumerate(_bin_shares(s, e, t0=t0, width=width, bins=bins)):
            arr[b] += tok * frac
            if in_total:
                total[b] += tok * frac
    centres = [(b + 0.5) * width for b in range(bins)]
    rates = {g: [v / width for v in arr] for g, arr in sorted(series.items())}
    rates[OVERALL] = [v / width for v in total]
    return centres, rates


def _spans(rows: Iterable[dict], *, by: str, side_rows: Iterable[dict], side_label: str
           ) -> list[tuple[float, float, int, str, bool]]:
    """(start s, end s, tokens, group, counts toward the total) of every row that generated tokens."""
    spans = []
    for source, is_side in ((rows, False), (side_rows, True)):
        for row in source:
            fin = epoch_s(row.get("finished_at"))
            gen_s = (float(row.get("prefill_ms") or 0.0) + float(row.get("decode_ms") or 0.0)) / 1000.0
            tok = int(row.get("output_tokens") or 0)
            if fin is None or tok == 0:
                continue
            spans.append((fin - gen_s, fin, tok, side_label if is_side else str(row.get(by)), not is_side))
    return spans


def _bin_shares(s: float, e: float, *, t0: float, width: float, bins: int) -> list[float]:
    """The share of the span [s, e] in each of ``bins`` bins of ``width`` seconds from ``t0`` (a zero-length
    span falls wholly in the bin holding e; the last bin is closed)."""
    out = []
    for b in range(bins):
        lo, hi = t0 + b * width, t0 + (b + 1) * width
        if e - s <= 0:
            out.append(1.0 if lo <= e < hi or (b == bins - 1 and e == hi) else 0.0)
        else:
            out.append(max(0.0, min(e, hi) - max(s, lo)) / (e - s))
    return out
