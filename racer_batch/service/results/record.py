"""One output row as one typed object, and the Parquet schemas derived from it.

``RowRecord`` is what ``RowRunner`` produces per row and what every sink consumes (the part file, the shadow
file, Redis telemetry, the tally behind status, the manifest, Prometheus and the report). Its fields, in
order, are the columns of ``OUTPUT_SCHEMA``: each field carries its Arrow type in its metadata, so the schema
is defined here once. ``ShadowRecord`` is a row of a shadow file (service/results/shadow.py): a ``RowRecord`` plus the
side of the pair; ``SHADOW_SCHEMA`` takes its row columns' types from ``RowRecord``.

Counting rules: ``accepted_hist[k]`` is the number of steps that accepted k draft tokens (the prefill step
counts under k = 0). A multi-turn row sums tokens, steps and times over its turns; ``prompt_tokens`` is then
the sum of each turn's prompt length (the tokens prefilled), ``text`` the last turn's answer and
``turn_texts`` every answer in order. A row with ``n_samples > 1`` sums every sample's counts and times;
its text is sample 0's, and ``samples`` lists each answer.

Example (a one-turn row; ``res`` is an engine ``GenerationResult``)::

    rec = RowRecord.from_turns([res], status="ok", error=None, origin=origin)
    rec.mat == rec.output_tokens / rec.steps
    RowRecord.from_row(rec.to_row()) == rec
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import pyarrow as pa

SCHEMA_VERSION = 1
STATUSES = ("ok", "error", "cancelled")
SIDES = ("method", "baseline")
SOURCES = ("retrieval", "logits", "both", "other")  # accepted draft tokens by where they came from
TIMES_MS = ("prefill_ms", "decode_ms", "draft_ms", "verify_ms", "update_ms")


def _col(arrow: pa.DataType, *, nullable: bool = True, default: Any = None) -> Any:
    """A dataclass field that is also a Parquet column of type ``arrow``."""
    meta = {"arrow": arrow, "nullable": nullable}
    if isinstance(default, list):
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _arrow_schema(cls: type, metadata: Optional[dict] = None) -> pa.Schema:
    fields = [pa.field(f.name, f.metadata["arrow"], nullable=f.metadata["nullable"])
              for f in dataclasses.fields(cls) if "arrow" in f.metadata]
    return pa.schema(fields, metadata=metadata)


@dataclass
class Sample:
    """One answer of a row with ``n_samples > 1`` (its own seed). A struct inside ``RowRecord.samples``."""

    sample: Optional[int] = _col(pa.int32())
    seed: Optional[int] = _col(pa.int64())
    status: Optional[str] = _col(pa.string())
    text: Optional[str] = _col(pa.string())
    turn_texts: list[str] = _col(pa.list_(pa.string()), default=[])
    output_tokens: Optional[int] = _col(pa.int64())
    finish_reason: Optional[str] = _col(pa.string())


SAMPLE_TYPE = pa.struct(list(_arrow_schema(Sample)))


@dataclass(frozen=True)
class RowOrigin:
    """Where a row comes from and what answered it: the identity columns of a ``RowRecord``."""

    id: str
    row_idx: int
    shard: Optional[int] = None
    route: str = "default"
    seed: Optional[int] = None
    worker: Optional[str] = None
    device: Optional[str] = None
    node: Optional[str] = None  # the Ray node id of the actor that answered; None on threads of the worker
    model: Optional[str] = None
    method: Optional[str] = None
    config_hash: Optional[str] = None
    job_id: str = ""

    @classmethod
    def of(cls, base: Union["RowOrigin", Mapping[str, Any]]) -> "RowOrigin":
        """A RowOrigin as is, or one from a mapping of its fields (unknown keys are an error)."""
        return base if isinstance(base, RowOrigin) else cls(**dict(base))


@dataclass(kw_only=True)
class RowRecord:
    """One output row (a line of a part file). Field order and types are ``OUTPUT_SCHEMA``'s.

    Counts are None where nothing was generated (a bad input row, a row cancelled before it ran); times are
    milliseconds; ``mat`` = output_tokens / steps; ``tokens_per_s`` = output_tokens / (prefill + decode).
    """

    id: str = _col(pa.string(), nullable=False)
    row_idx: int = _col(pa.int64(), nullable=False)
    shard: Optional[int] = _col(pa.int32(), nullable=False)  # None only outside a shard (post-hoc shadow)
    route: str = _col(pa.string(), nullable=False)
    status: str = _col(pa.string(), nullable=False)  # one of STATUSES
    error: Optional[str] = _col(pa.string())
    text: Optional[str] = _col(pa.string())
    turn_texts: Optional[list[str]] = _col(pa.list_(pa.string()), default=[])
    prompt_tokens: Optional[int] = _col(pa.int64())  # summed over turns (tokens prefilled)
    output_tokens: Optional[int] = _col(pa.int64())
    finish_reason: Optional[str] = _col(pa.string())  # the last turn's
    steps: Optional[int] = _col(pa.int64())  # target forwards, prefill included
    mat: Optional[float] = _col(pa.float64())  # output_tokens / steps
    accepted_hist: Optional[list[int]] = _col(pa.list_(pa.int64()), default=[])
    # accepted draft tokens by source: retrieval only, logits only, both, other (PLD and the peers)
    accepted_retrieval: Optional[int] = _col(pa.int64())
    accepted_logits: Optional[int] = _col(pa.int64())
    accepted_both: Optional[int] = _col(pa.int64())
    accepted_other: Optional[int] = _col(pa.int64())
    prefill_ms: Optional[float] = _col(pa.float64())
    decode_ms: Optional[float] = _col(pa.float64())
    draft_ms: Optional[float] = _col(pa.float64())
    verify_ms: Optional[float] = _col(pa.float64())
    update_ms: Optional[float] = _col(pa.float64())
    # the row's share of its actor's forwards (ms) when rows ran several per forward (streams_per_actor > 1):
    # a forward of n rows counts 1/n of its time for each, a prefill all of it; None: prefill_ms + decode_ms
    device_ms: Optional[float] = _col(pa.float64())
    tokens_per_s: Optional[float] = _col(pa.float64())
    worker: Optional[str] = _col(pa.string())
    device: Optional[str] = _col(pa.string())
    # the Ray node id (hex) of the actor that answered the row; null on worker threads (``--no-ray``) and in
    # part files written before issue 15
    node: Optional[str] = _col(pa.string())
    model: Optional[str] = _col(pa.string())
    method: Optional[str] = _col(pa.string())
    config_hash: Optional[str] = _col(pa.string())
    seed: Optional[int] = _col(pa.int64())
    job_id: str = _col(pa.string(), nullable=False)
    finished_at: Optional[dt.datetime] = _col(pa.timestamp("ms", tz="UTC"))
    # n_samples > 1 only (else None): every answer with its own seed; the row's text is sample 0's.
    samples: Optional[list[Sample]] = _col(pa.list_(SAMPLE_TYPE))

    # ---- construction
    @classmethod
    def from_turns(cls, turns: Sequence[Any], *, status: str, error: Optional[str],
                   origin: Union[RowOrigin, Mapping[str, Any]]) -> "RowRecord":
        """The record of one answer from its turns (engine ``GenerationResult`` objects, in order; may be
        empty when the first turn raised). ``status`` is one of STATUSES."""
        assert status in STATUSES, f"row {RowOrigin.of(origin).id!r}: unknown status {status!r}"
        last = turns[-1] if turns else None
        rec = cls(**dataclasses.asdict(RowOrigin.of(origin)), status=status, error=error,
                  text=last.text if last else None, turn_texts=[r.text for r in turns],
                  finish_reason=last.finish_reason if last else None,
                  accepted_hist=add_lists(*(_hist_list(r.stats.accepted_hist) for r in turns)), **_turn_sums(turns))
        rec._derive()
        return rec

    @classmethod
    def without_answer(cls, *, status: str, error: str, origin: Union[RowOrigin, Mapping[str, Any]],
                       finished_at: Optional[dt.datetime] = None) -> "RowRecord":
        """A row that produced no generation (bad input, cancelled before it ran, a shard that kept crashing)."""
        assert status in STATUSES, f"row {RowOrigin.of(origin).id!r}: unknown status {status!r}"
        return cls(**dataclasses.asdict(RowOrigin.of(origin)), status=status, error=error, finished_at=finished_at)

    @classmethod
    def from_samples(cls, answers: Sequence[tuple["RowRecord", int]]) -> "RowRecord":
        """One row from its ``n_samples`` answers ``[(record, seed)]`` (sample 0 first): counts and times
        summed, texts and finish reason sample 0's, status the first non-ok one, ``samples`` listing each."""
        first = answers[0][0]
        out = dataclasses.replace(first, turn_texts=list(first.turn_texts or []), accepted_hist=[])
        bad = next((r for r, _ in answers if r.status != "ok"), None)
        if bad is not None:
            out.status, out.error = bad.status, bad.error
        for key in ("prompt_tokens", "output_tokens", "steps", *(f"accepted_{s}" for s in SOURCES)):
            setattr(out, key, sum(getattr(r, key) or 0 for r, _ in answers))
        for key in TIMES_MS:
            setattr(out, key, sum((getattr(r, key) or 0.0 for r, _ in answers), 0.0))
        out.accepted_hist = add_lists(*(r.accepted_hist for r, _ in answers))
        out.samples = [Sample(sample=k, seed=seed, status=r.status, text=r.text, turn_texts=list(r.turn_texts or []),
                              output_tokens=r.output_tokens, finish_reason=r.finish_reason)
                       for k, (r, seed) in enumerate(answers)]
        out._derive()
        return out

    def _derive(self) -> None:
        steps, tokens = self.steps or 0, self.output_tokens or 0
        self.mat = tokens / steps if steps else None
        total_ms = self.gen_ms
        self.tokens_per_s = tokens / (total_ms / 1000.0) if total_ms > 0 else None

    # ---- derived figures
    @property
    def busy_ms(self) -> float:
        """The actor time the row used: ``device_ms`` when rows shared forwards, else its generation time."""
        return self.gen_ms if self.device_ms is None else float(self.device_ms)

    @property
    def gen_ms(self) -> float:
        """Generation time, prefill + decode (0.0 when nothing was generated)."""
        return (self.prefill_ms or 0.0) + (self.decode_ms or 0.0)

    @property
    def accepted_tokens(self) -> int:
        """Accepted draft tokens (bonus tokens excluded): sum of k * accepted_hist[k]."""
        return sum(k * int(n or 0) for k, n in enumerate(self.accepted_hist or []))

    # ---- Parquet rows
    def to_row(self) -> dict:
        """A dict in OUTPUT_SCHEMA's column order (``samples`` as structs)."""
        row = {name: getattr(self, name) for name in OUTPUT_SCHEMA.names}
        if self.samples is not None:
            row["samples"] = [dataclasses.asdict(s) for s in self.samples]
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "RowRecord":
        """From a Parquet row (``table.to_pylist()`` item). Missing columns are null; unknown ones an error.

        Raises:
            AssertionError: a key outside OUTPUT_SCHEMA."""
        extra = set(row) - set(OUTPUT_SCHEMA.names)
        assert not extra, f"record for row {row.get('row_idx')} has fields outside the schema: {sorted(extra)}"
        kw = dict(row)
        if kw.get("samples") is not None:
            kw["samples"] = [s if isinstance(s, Sample) else Sample(**s) for s in kw["samples"]]
        return cls(**{"id": None, "row_idx": None, "shard": None, "route": None, "status": None, "job_id": None,
                      **kw})

    def telemetry(self) -> dict:
        """The small JSON dict of one row for the Redis row stream (``racer-batch status --rows``)."""
        keys = ("id", "row_idx", "shard", "route", "status", "error", "output_tokens", "steps", "mat",
                "tokens_per_s", "finish_reason", "worker", "device", "node")
        return {k: getattr(self, k) for k in keys}


_RESULT_SUMS = ("prompt_tokens", "output_tokens", "prefill_ms", "decode_ms")  # GenerationResult fields
_STATS_SUMS = ("steps", *(f"accepted_{s}" for s in SOURCES), "draft_ms", "verify_ms", "update_ms")  # RowStats


def _turn_sums(turns: Sequence[Any]) -> dict:
    """Counts (int) and times (float, ``*_ms``) summed over a row's turns, by RowRecord field name."""
    def total(key: str, part: Callable[[Any], Any]) -> Any:
        cast = float if key.endswith("_ms") else int
        return sum((cast(getattr(part(r), key)) for r in turns), cast(0))

    out = {key: total(key, lambda r: r) for key in _RESULT_SUMS}
    out.update({key: total(key, lambda r: r.stats) for key in _STATS_SUMS})
    return out


def _hist_list(hist: Mapping[int, int]) -> list[int]:
    """``{accepted length: steps}`` -> list indexed by accepted length: ``{0: 2, 3: 1}`` -> ``[2, 0, 0, 1]``."""
    return [int(hist.get(k, 0)) for k in range(max(hist) + 1)] if hist else []


def add_lists(*lists: Sequence[int]) -> list[int]:
    """Element-wise sum of count lists of any lengths: ``add_lists([1, 2], [3]) == [4, 2]``."""
    out = [0] * max((len(x) for x in lists), default=0)
    for x in lists:
        for k, v in enumerate(x or ()):
            out[k] += int(v or 0)
    return out


OUTPUT_SCHEMA = _arrow_schema(RowRecord, metadata={b"racer_batch.schema_version": str(SCHEMA_VERSION).encode()})


@dataclass(kw_only=True)
class ShadowRecord:
    """One side of a shadow pair (a line of ``_shadow-*.parquet``): the row as that side answered it.

    ``run``: ``"job"`` (in the job) or ``"posthoc:<baseline>"``; ``side``: ``"method"`` | ``"baseline"``;
    ``reference``: the row's reference answer per turn (input column ``reference``; None: none)."""

    row: RowRecord
    run: str = "job"
    side: str = "method"
    ran_first: Optional[bool] = None
    temperature: Optional[float] = None
    reference: Optional[list[Optional[str]]] = None

    def __post_init__(self) -> None:
        assert self.side in SIDES, f"side must be one of {SIDES}, got {self.side!r}"

    def to_row(self) -> dict:
        """A dict in SHADOW_SCHEMA's column order."""
        return {name: getattr(self, name) if name in _SHADOW_OWN else getattr(self.row, name)
                for name in SHADOW_SCHEMA.names}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "ShadowRecord":
        """From a shadow file's row (columns outside SHADOW_SCHEMA are an error)."""
        extra = set(row) - set(SHADOW_SCHEMA.names)
        assert not extra, f"shadow record for row {row.get('row_idx')} has fields outside the schema: {sorted(extra)}"
        own = {k: row[k] for k in _SHADOW_OWN if row.get(k) is not None}
        return cls(row=RowRecord.from_row({k: v for k, v in row.items() if k not in _SHADOW_OWN}), **own)


# Column layout of a shadow file: (name, nullable) of a RowRecord column, or a column of ShadowRecord's own.
_SHADOW_OWN = {"run": pa.string(), "side": pa.string(), "ran_first": pa.bool_(), "temperature": pa.float64(),
               "reference": pa.list_(pa.string())}
_SHADOW_LAYOUT = (("run", False), ("job_id", False), ("id", False), ("row_idx", False), ("shard", True),
                  ("route", False), ("side", False), ("ran_first", True), ("method", True),
                  ("config_hash", True), ("status", False), ("error", True), ("text", True),
                  ("turn_texts", True), ("prompt_tokens", True), ("output_tokens", True),
                  ("finish_reason", True), ("steps", True), ("mat", True), ("accepted_hist", True),
                  ("prefill_ms", True), ("decode_ms", True), ("tokens_per_s", True), ("seed", True),
                  ("temperature", True), ("worker", True), ("device", True), ("finished_at", True),
                  # added for the capability comparison (issue 8); older files read back with nulls here
                  ("reference", True))
SHADOW_SCHEMA = pa.schema([pa.field(name, _SHADOW_OWN[name] if name in _SHADOW_OWN else OUTPUT_SCHEMA.field(name).type,
                                    nullable=nullable) for name, nullable in _SHADOW_LAYOUT])


def records_table(records: Iterable[Union[RowRecord, ShadowRecord, Mapping[str, Any]]], schema: pa.Schema
                  ) -> pa.Table:
    """Records (or Parquet-row dicts, checked through ``from_row``) -> a Table with exactly ``schema``
    (OUTPUT_SCHEMA or SHADOW_SCHEMA)."""
    kind = ShadowRecord if schema is SHADOW_SCHEMA else RowRecord
    assert schema is SHADOW_SCHEMA or schema is OUTPUT_SCHEMA, "records_table takes OUTPUT_SCHEMA or SHADOW_SCHEMA"
    rows = [(r if isinstance(r, kind) else kind.from_row(r)).to_row() for r in records]
    return pa.Table.from_pydict({n: [r[n] for r in rows] for n in schema.names}, schema=schema)
