"""The one declared output schema, and the builders of its rows.

Every part file has exactly this schema (an all-error or empty shard included). ``accepted_hist[k]`` is the
number of steps that accepted k draft tokens (the prefill step counts under k = 0). Multi-turn rows sum
tokens, steps and times over their turns; ``prompt_tokens`` is then the sum of each turn's prompt length
(the tokens prefilled), ``text`` the last turn's answer and ``turn_texts`` every answer in order.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Optional

import pyarrow as pa

SCHEMA_VERSION = 1
STATUSES = ("ok", "error", "cancelled")

SAMPLE_TYPE = pa.struct([
    pa.field("sample", pa.int32()), pa.field("seed", pa.int64()), pa.field("status", pa.string()),
    pa.field("text", pa.string()), pa.field("turn_texts", pa.list_(pa.string())),
    pa.field("output_tokens", pa.int64()), pa.field("finish_reason", pa.string()),
])

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("row_idx", pa.int64(), nullable=False),
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("route", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("text", pa.string()),
        pa.field("turn_texts", pa.list_(pa.string())),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("output_tokens", pa.int64()),
        pa.field("finish_reason", pa.string()),
        pa.field("steps", pa.int64()),
        pa.field("mat", pa.float64()),
        pa.field("accepted_hist", pa.list_(pa.int64())),
        pa.field("accepted_retrieval", pa.int64()),
        pa.field("accepted_logits", pa.int64()),
        pa.field("accepted_both", pa.int64()),
        pa.field("accepted_other", pa.int64()),
        pa.field("prefill_ms", pa.float64()),
        pa.field("decode_ms", pa.float64()),
        pa.field("draft_ms", pa.float64()),
        pa.field("verify_ms", pa.float64()),
        pa.field("update_ms", pa.float64()),
        pa.field("tokens_per_s", pa.float64()),
        pa.field("worker", pa.string()),
        pa.field("device", pa.string()),
        pa.field("model", pa.string()),
        pa.field("method", pa.string()),
        pa.field("config_hash", pa.string()),
        pa.field("seed", pa.int64()),
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("finished_at", pa.timestamp("ms", tz="UTC")),
        # n_samples > 1 only (else null): every answer with its own seed; the row's text is sample 0's.
        pa.field("samples", pa.list_(SAMPLE_TYPE)),
    ],
    metadata={b"racer_batch.schema_version": str(SCHEMA_VERSION).encode()},
)


class RowAccumulator:
    """Sums one row's turns into an output record (plain dict in OUTPUT_SCHEMA's field order)."""

    def __init__(self) -> None:
        self.turn_texts: list[str] = []
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.steps = 0
        self.hist: dict[int, int] = {}
        self.by_source = {"accepted_retrieval": 0, "accepted_logits": 0, "accepted_both": 0, "accepted_other": 0}
        self.ms = {"prefill_ms": 0.0, "decode_ms": 0.0, "draft_ms": 0.0, "verify_ms": 0.0, "update_ms": 0.0}
        self.finish_reason: Optional[str] = None

    def add_turn(self, res: Any) -> None:
        """Add one GenerationResult."""
        st = res.stats
        self.turn_texts.append(res.text)
        self.prompt_tokens += int(res.prompt_tokens)
        self.output_tokens += int(res.output_tokens)
        self.steps += int(st.steps)
        for k, v in st.accepted_hist.items():
            self.hist[int(k)] = self.hist.get(int(k), 0) + int(v)
        for k in self.by_source:
            self.by_source[k] += int(getattr(st, k))
        self.ms["prefill_ms"] += float(res.prefill_ms)
        self.ms["decode_ms"] += float(res.decode_ms)
        for k in ("draft_ms", "verify_ms", "update_ms"):
            self.ms[k] += float(getattr(st, k))
        self.finish_reason = res.finish_reason

    def add(self, other: "RowAccumulator") -> None:
        """Add another answer's counts and times (texts and finish reason stay this one's)."""
        self.prompt_tokens += other.prompt_tokens
        self.output_tokens += other.output_tokens
        self.steps += other.steps
        for k, v in other.hist.items():
            self.hist[k] = self.hist.get(k, 0) + v
        for k in self.by_source:
            self.by_source[k] += other.by_source[k]
        for k in self.ms:
            self.ms[k] += other.ms[k]

    def record(self, *, status: str, error: Optional[str], base: dict) -> dict:
        total_ms = self.ms["prefill_ms"] + self.ms["decode_ms"]
        hist = [0] * (max(self.hist) + 1) if self.hist else []
        for k, v in self.hist.items():
            hist[k] = v
        rec = dict(base)
        rec.update(
            status=status, error=error,
            text=self.turn_texts[-1] if self.turn_texts else None,
            turn_texts=list(self.turn_texts),
            prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            finish_reason=self.finish_reason, steps=self.steps,
            mat=(self.output_tokens / self.steps) if self.steps else None,
            accepted_hist=hist, **self.by_source, **self.ms,
            tokens_per_s=(self.output_tokens / (total_ms / 1000.0)) if total_ms > 0 else None,
        )
        return rec


def error_record(*, status: str, error: str, base: dict) -> dict:
    """A row that produced no generation (bad input, cancelled before start)."""
    rec = {name: None for name in OUTPUT_SCHEMA.names}
    rec.update(base)
    rec.update(status=status, error=error, turn_texts=[], accepted_hist=[])
    return rec


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def to_table(records: list[dict]) -> pa.Table:
    """Records -> Table with exactly OUTPUT_SCHEMA (missing keys are null; unknown keys are an error)."""
    for r in records:
        extra = set(r) - set(OUTPUT_SCHEMA.names)
        assert not extra, f"record for row {r.get('row_idx')} has fields outside the schema: {sorted(extra)}"
    cols = {name: [r.get(name) for r in records] for name in OUTPUT_SCHEMA.names}
    return pa.Table.from_pydict(cols, schema=OUTPUT_SCHEMA)
