"""`racer-batch export JOB --format jsonl`: the job's answers as chat records for dataset synthesis.

One record per answer (per sample when the job ran ``n_samples`` > 1)::

    {"id": "code-01", "route": "code", "sample": 0, "seed": 17, "finish_reason": "eos", "output_tokens": 80,
     "model": "smollm2-135m", "method": "racer", "config_hash": "...", "job_id": "...",
     "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

``messages`` are the input messages as the model saw them (the spec's system prompt first, if any) plus the
assistant turn; a multi-turn row interleaves each user turn with its answer. The prompts are read again from
the job's input, one shard at a time, so nothing holds the whole dataset in memory.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from racer_batch.report.load import JobData, ReportError
from racer_batch.service.job.inputs import iter_raw_rows
from racer_batch.service.job.rows import RowTask, parse_row
from racer_batch.service.results.output import SHARD_META_KEY
from racer_batch.service.results.schema import OUTPUT_SCHEMA

MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])
CHAT_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("route", pa.string()), pa.field("sample", pa.int32()),
    pa.field("seed", pa.int64()), pa.field("finish_reason", pa.string()), pa.field("output_tokens", pa.int64()),
    pa.field("model", pa.string()), pa.field("method", pa.string()), pa.field("config_hash", pa.string()),
    pa.field("job_id", pa.string()), pa.field("messages", pa.list_(MESSAGE)),
])


def chat_messages(prompt_chat: Optional[list[dict]], *, raw: Optional[str], turns: Optional[list[str]],
                  answers: list[str]) -> list[dict]:
    """Input messages plus the assistant turn(s).

    >>> chat_messages([{"role": "user", "content": "hi"}], raw=None, turns=None, answers=["hello"])
    [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]
    >>> chat_messages([], raw=None, turns=["a", "b"], answers=["A", "B"])  # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'A'},
     {'role': 'user', 'content': 'b'}, {'role': 'assistant', 'content': 'B'}]
    """
    msgs = [dict(m) for m in (prompt_chat or [])]
    if turns is not None:
        for turn, answer in zip(turns, answers):
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return msgs
    if raw is not None and not prompt_chat:  # a prompt row under prompt_format auto carries both forms
        msgs.append({"role": "user", "content": raw})
    msgs.append({"role": "assistant", "content": answers[-1] if answers else ""})
    return msgs


def _part_rows(part: Path) -> tuple[dict[int, dict], int, int]:
    """One output part file: ({row_idx: output record}, row_start, row_stop) of its shard (the range from the
    file's shard metadata, else from the rows it holds)."""
    meta = json.loads((pq.read_schema(part).metadata or {}).get(SHARD_META_KEY, b"{}"))
    out_rows = {r["row_idx"]: r for r in pq.read_table(part, schema=OUTPUT_SCHEMA).to_pylist()}
    lo = meta.get("row_start", min(out_rows, default=0))
    hi = meta.get("row_stop", max(out_rows, default=-1) + 1)
    return out_rows, lo, hi


def _samples(out: dict) -> list[dict]:
    """An output row's samples; a row without a ``samples`` list is its own single sample 0."""
    return out["samples"] or [{"sample": 0, "seed": out["seed"], "status": out["status"], "text": out["text"],
                               "turn_texts": out["turn_texts"], "output_tokens": out["output_tokens"],
                               "finish_reason": out["finish_reason"]}]


def _chat_record(out: dict, s: dict, row: RowTask) -> dict:
    """The chat record (CHAT_SCHEMA) of one sample ``s`` of output row ``out``, whose input is ``row``."""
    answers = list(s["turn_texts"] or ([s["text"]] if s["text"] is not None else []))
    return {"id": out["id"], "route": out["route"], "sample": s["sample"], "seed": s["seed"],
            "finish_reason": s["finish_reason"], "output_tokens": s["output_tokens"],
            "model": out["model"], "method": out["method"], "config_hash": out["config_hash"],
            "job_id": out["job_id"],
            "messages": chat_messages(row.chat, raw=row.raw, turns=row.turns, answers=answers)}


def iter_chat_records(data: JobData, *, only_ok: bool = True, skipped: Optional[list[int]] = None
                      ) -> Iterator[dict]:
    """Chat records in row order, shard by shard (output part file + the same rows of the input).

    With ``only_ok``, rows or samples that are not ok are left out and counted in ``skipped[0]``.
    Raises ReportError when the manifest lacks the spec or input plan."""
    spec, plan = data.job_input()
    columns = list(spec.input.columns.model_dump().values())
    skipped = skipped if skipped is not None else [0]
    for part in sorted(data.out_dir.glob("part-*.parquet")):
        out_rows, lo, hi = _part_rows(part)
        for row_idx, rec in iter_raw_rows(plan, lo, hi, columns):
            out = out_rows.get(row_idx)
            if out is None:
                continue
            row = parse_row(spec, row_idx, rec)
            assert row.id == out["id"], (
                f"row {row_idx}: input id {row.id!r} != output id {out['id']!r} (input changed since the job ran?)")
            for s in _samples(out):
                if only_ok and (out["status"] != "ok" or s["status"] != "ok"):
                    skipped[0] += 1
                    continue
                yield _chat_record(out, s, row)


def export_chat(data: JobData, path: str | Path, *, fmt: str = "jsonl", only_ok: bool = True) -> tuple[int, int]:
    """Write the chat records (atomically). Returns (records written, rows or samples skipped)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    skipped = [0]
    n = 0
    try:
        if fmt == "jsonl":
            with open(tmp, "w", encoding="utf-8") as fh:
                for rec in iter_chat_records(data, only_ok=only_ok, skipped=skipped):
                    fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    n += 1
        elif fmt == "parquet":
            recs = list(iter_chat_records(data, only_ok=only_ok, skipped=skipped))
            n = len(recs)
            pq.write_table(pa.Table.from_pylist(recs, schema=CHAT_SCHEMA), tmp)
        else:
            raise ReportError(f"--format {fmt!r}: expected jsonl or parquet")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n, skipped[0]
