"""The one tally of rows: counts, tokens, steps and times over any set of ``RowRecord`` objects.

A shard attempt's progress (Redis ``inflight``), a committed shard's summary (Redis ``shards``, the part
file's footer, the manifest's ``shards``), a job's totals (status, list, the manifest's ``totals``), the
worker's Prometheus counters, the report's per-route statistics and the bench's per-method figures are all a
``Tally``: ``observe_row(record)`` counts one row, ``merge(other)`` adds another tally. Each tally keeps a
per-route breakdown (``routes``: route -> Tally without a breakdown of its own); the report groups by
another column with ``observe_row(record, group=...)``.

JSON (``to_dict`` / ``from_dict``): flat counters plus ``routes`` as {route: counters}. ``from_dict`` also
reads the summaries written before issue 13, whose ``routes`` were ``[rows, output_tokens, steps]`` lists.

Example::

    t = Tally()
    t.observe_row(RowRecord(id="a", row_idx=0, shard=0, route="chat", status="ok", job_id="j",
                            output_tokens=10, steps=4, accepted_hist=[1, 2, 1], prefill_ms=5.0, decode_ms=20.0))
    t.mat, t.accepted_tokens, t.routes["chat"].gen_ms    # (2.5, 4, 25.0)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Optional

from racer_batch.service.results.record import SOURCES, STATUSES, RowRecord, add_lists

_SUMS = ("rows", "ok", "error", "cancelled", "prompt_tokens", "output_tokens", "steps", "gen_ms", "device_ms",
         "draft_ms", "verify_ms", "update_ms", *(f"accepted_{s}" for s in SOURCES))


@dataclass
class Tally:
    """Sums over rows. Times in milliseconds; ``device_ms`` = the rows' actor time (``RowRecord.busy_ms``: their
    share of shared forwards when several rows ran per forward, else gen_ms) x devices per actor (the report's cost
    basis); ``first_start_s`` / ``last_finish_s``: epoch seconds of the earliest row start (finished_at minus
    its generation time) and the latest finish, None until a row with ``finished_at`` is seen."""

    rows: int = 0  # every status
    ok: int = 0
    error: int = 0  # the report calls them failed
    cancelled: int = 0
    prompt_tokens: int = 0  # tokens prefilled, summed over turns
    output_tokens: int = 0
    steps: int = 0  # target forwards, prefill included
    gen_ms: float = 0.0  # prefill + decode
    device_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    update_ms: float = 0.0
    accepted_hist: list[int] = field(default_factory=list)
    accepted_retrieval: int = 0
    accepted_logits: int = 0
    accepted_both: int = 0
    accepted_other: int = 0
    first_start_s: Optional[float] = None
    last_finish_s: Optional[float] = None
    routes: dict[str, "Tally"] = field(default_factory=dict)

    # ---- counting
    def observe_row(self, record: RowRecord, *, group: Optional[str] = None, devices: float = 1.0) -> None:
        """Count one row, here and under ``routes[group]`` (default: the row's route).

        Raises:
            AssertionError: a status outside STATUSES (names the row)."""
        assert record.status in STATUSES, f"row {record.id!r}: unknown status {record.status!r}"
        self._count(record, devices)
        self.routes.setdefault(record.route if group is None else group, Tally())._count(record, devices)

    def _count(self, rec: RowRecord, devices: float) -> None:
        self.rows += 1
        setattr(self, rec.status, getattr(self, rec.status) + 1)
        self.prompt_tokens += int(rec.prompt_tokens or 0)
        self.output_tokens += int(rec.output_tokens or 0)
        self.steps += int(rec.steps or 0)
        self.gen_ms += rec.gen_ms
        self.device_ms += rec.busy_ms * devices
        for key in ("draft_ms", "verify_ms", "update_ms"):
            setattr(self, key, getattr(self, key) + float(getattr(rec, key) or 0.0))
        for src in SOURCES:
            key = f"accepted_{src}"
            setattr(self, key, getattr(self, key) + int(getattr(rec, key) or 0))
        self.accepted_hist = add_lists(self.accepted_hist, rec.accepted_hist or [])
        fin = epoch_s(rec.finished_at)
        if fin is not None:
            self._span(fin - rec.gen_ms / 1000.0, fin)

    def _span(self, start: Optional[float], finish: Optional[float]) -> None:
        if start is not None:
            self.first_start_s = start if self.first_start_s is None else min(self.first_start_s, start)
        if finish is not None:
            self.last_finish_s = finish if self.last_finish_s is None else max(self.last_finish_s, finish)

    def merge(self, other: "Tally") -> "Tally":
        """Add ``other`` (and its routes) into this tally; returns self."""
        for key in _SUMS:
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.accepted_hist = add_lists(self.accepted_hist, other.accepted_hist)
        self._span(other.first_start_s, other.last_finish_s)
        for route, sub in other.routes.items():
            self.routes.setdefault(route, Tally()).merge(sub)
        return self

    @classmethod
    def of(cls, summaries: Any) -> "Tally":
        """The merged tally of JSON summaries (an iterable of ``to_dict`` outputs)."""
        total = cls()
        for d in summaries:
            total.merge(cls.from_dict(d))
        return total

    # ---- derived figures (None when undefined)
    @property
    def mat(self) -> Optional[float]:
        """Mean tokens per step (output tokens / steps)."""
        return self.output_tokens / self.steps if self.steps else None

    @property
    def accepted_tokens(self) -> int:
        """Accepted draft tokens (bonus tokens excluded): sum of k * accepted_hist[k]."""
        return sum(k * n for k, n in enumerate(self.accepted_hist))

    @property
    def accepted_by_source(self) -> int:
        """Accepted draft tokens counted by source (retrieval + logits + both + other)."""
        return sum(getattr(self, f"accepted_{s}") for s in SOURCES)

    # ---- JSON (Redis, part-file footers, manifest)
    def to_dict(self) -> dict:
        """Plain JSON: every counter, and ``routes`` as {route: counters}."""
        return dict(self._counters(), routes={route: sub._counters() for route, sub in sorted(self.routes.items())})

    def _counters(self) -> dict:
        return {f.name: getattr(self, f.name) if f.name != "accepted_hist" else list(self.accepted_hist)
                for f in dataclasses.fields(self) if f.name != "routes"}

    @classmethod
    def from_dict(cls, d: dict) -> "Tally":
        """Read ``to_dict``'s JSON, or an older summary (missing counters are 0, legacy route lists)."""
        t = cls(**{k: d.get(k) or 0 for k in _SUMS})
        t.accepted_hist = [int(v) for v in d.get("accepted_hist") or []]
        t.first_start_s, t.last_finish_s = d.get("first_start_s"), d.get("last_finish_s")
        for route, v in (d.get("routes") or {}).items():
            if isinstance(v, dict):
                t.routes[route] = cls.from_dict(dict(v, routes={}))
            else:  # before issue 13: [rows, output_tokens, steps]
                rows, tokens, steps = v
                t.routes[route] = cls(rows=rows, output_tokens=tokens, steps=steps)
        return t


def epoch_s(v: object) -> Optional[float]:
    """Epoch seconds of a timestamp (a datetime, naive = UTC, or a number already in seconds); None stays None."""
    if v is None:
        return None
    if isinstance(v, dt.datetime):
        if v.tzinfo is None:
            v = v.replace(tzinfo=dt.timezone.utc)
        return v.timestamp()
    return float(v)  # already epoch seconds
