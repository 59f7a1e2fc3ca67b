"""Reading the input files: find them, open the dataset, check its schema and ids at submit time, read one shard
at a time as raw records, and fingerprint rows and shards for resume. Turning a record into a row to answer is
rows.py (``parse_row``).

Nothing here holds all prompts in memory: planning reads only the id column, batch by batch, and a
shard is read by skipping whole files (their row counts come from metadata) and whole Parquet row groups,
then streaming without read-ahead, so memory holds about one row group of the input at a time.

Text that is not valid UTF-8 never stops a job: in a prompt-like column it becomes an ``InvalidText``
value that ``rows.parse_row`` turns into a row error naming the column; in the id column it is refused at submit.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from racer_batch.service.job.spec import InputSpec

Chat = list[dict[str, str]]
BATCH_ROWS = 1024
MAX_DUPLICATES_SHOWN = 5


class InputError(ValueError):
    """Input data that cannot be queued; the message names the file, column or row."""


@dataclass(frozen=True)
class InputPlan:
    """What planning learned about the input: files, row counts, which optional columns exist."""

    files: tuple[str, ...]
    format: str
    file_rows: tuple[int, ...]  # rows per file, same order as files
    columns: tuple[str, ...]  # canonical names present (id, prompt, messages, ...)
    fingerprint: str  # hash of file paths and sizes: a changed input is detected at run time

    @property
    def num_rows(self) -> int:
        return sum(self.file_rows)

    def num_shards(self, shard_rows: int) -> int:
        return math.ceil(self.num_rows / shard_rows)

    def shard_range(self, shard: int, shard_rows: int) -> tuple[int, int]:
        """Row indices [row_start, row_stop) of one shard."""
        start = shard * shard_rows
        return start, min(start + shard_rows, self.num_rows)

    def to_dict(self) -> dict:
        return {
            "files": list(self.files), "format": self.format, "file_rows": list(self.file_rows),
            "columns": list(self.columns), "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "InputPlan":
        return cls(
            files=tuple(d["files"]), format=d["format"], file_rows=tuple(d["file_rows"]),
            columns=tuple(d["columns"]), fingerprint=d["fingerprint"],
        )


_SUFFIX_FORMAT = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}


def _list_files(path: str) -> list[str]:
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in _SUFFIX_FORMAT
                       and not f.name.startswith((".", "_")))
    elif any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    elif p.is_file():
        files = [str(p)]
    else:
        raise InputError(f"input.path = {path!r}: no such file or folder")
    if not files:
        raise InputError(f"input.path = {path!r}: no Parquet or JSONL files found")
    return files


def _format_of(files: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = {_SUFFIX_FORMAT.get(Path(f).suffix.lower()) for f in files}
    if len(kinds) == 1 and None not in kinds:
        return kinds.pop()
    unknown = sorted({Path(f).suffix or "(none)" for f in files if _SUFFIX_FORMAT.get(Path(f).suffix.lower()) is None})
    supported = "Parquet (.parquet, .pq) or JSON Lines (.jsonl, .json, .ndjson)"
    if unknown:
        hint = (" (CSV: convert it first, e.g. pyarrow.parquet.write_table(pyarrow.csv.read_csv(PATH), 'in.parquet'))"
                if ".csv" in unknown else "")
        raise InputError(f"input files of an unsupported kind ({', '.join(unknown)}): racer-batch reads {supported}"
                         f"{hint}; or set input.format to parquet or jsonl")
    raise InputError(f"input files mix Parquet and JSON Lines ({', '.join(sorted(map(str, kinds)))}): use one kind, "
                     "or set input.format")


def _file_dataset(path: str, fmt: str) -> ds.Dataset:
    return ds.dataset(path, format="parquet" if fmt == "parquet" else "json")


def _blank_jsonl(path: str) -> bool:
    """An empty (or whitespace-only) JSONL file: zero rows, where Arrow would refuse to read a schema."""
    size = os.path.getsize(path)
    if size > 65536:
        return False
    with open(path, "rb") as fh:
        return not fh.read().strip()


def _iter_batches(path: str, fmt: str, columns: list[str], *, skip_rows: int = 0
                  ) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(row index in the file of the batch's first row, batch) for the file's rows, in order.

    Parquet is read row group by row group, starting at the group that holds row ``skip_rows`` (earlier
    rows may be yielded; callers slice), with no read-ahead: memory holds about one row group. Example: row
    groups of 8192 rows and ``skip_rows=20000`` start at group 2, so the first batch starts at row 16384.
    """
    if fmt == "parquet":
        pf = pq.ParquetFile(path)
        names = set(pf.schema_arrow.names)
        cols = [c for c in columns if c in names]
        md = pf.metadata
        first_row, first_group = 0, 0
        while first_group < md.num_row_groups and first_row + md.row_group(first_group).num_rows <= skip_rows:
            first_row += md.row_group(first_group).num_rows
            first_group += 1
        row = first_row
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=cols,
                                     row_groups=range(first_group, md.num_row_groups), use_threads=False):
            yield row, batch
            row += batch.num_rows
        return
    if _blank_jsonl(path):
        return
    dset = _file_dataset(path, fmt)
    cols = [c for c in columns if c in dset.schema.names]
    row = 0
    for batch in dset.to_batches(columns=cols, batch_size=BATCH_ROWS, batch_readahead=1, fragment_readahead=1):
        yield row, batch
        row += batch.num_rows


class InvalidText:
    """A value whose bytes are not valid UTF-8 (in place of the string): ``parse_row`` makes it a row error.
    A plain class, not a dataclass: ``ShardTask.to_dict`` (dataclasses.asdict) must carry it unchanged."""

    __slots__ = ("column", "detail")

    def __init__(self, *, column: str, detail: str) -> None:
        self.column = column
        self.detail = detail

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InvalidText) and (self.column, self.detail) == (other.column, other.detail)

    def __repr__(self) -> str:
        return f"InvalidText(column={self.column!r}, detail={self.detail!r})"


def _column_values(col: pa.Array, name: str) -> list:
    """``col.to_pylist()``, except that a value that is not valid UTF-8 becomes an InvalidText."""
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        pass
    out: list = []
    for i in range(len(col)):
        try:
            out.append(col[i].as_py())
        except UnicodeDecodeError as exc:
            out.append(InvalidText(column=name, detail=f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"))
    return out


def _records(batch: pa.RecordBatch) -> list[dict]:
    """``batch.to_pylist()`` that survives text that is not valid UTF-8 (see InvalidText)."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        pass
    names = batch.schema.names
    cols = [_column_values(batch.column(i), name) for i, name in enumerate(names)]
    return [dict(zip(names, vals)) for vals in zip(*cols)]


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


def _is_id(t: pa.DataType) -> bool:
    return _is_text(t) or pa.types.is_integer(t)


def _is_text_list(t: pa.DataType) -> bool:
    return _is_list(t) and (_is_text(t.value_type) or pa.types.is_null(t.value_type))


def _is_stop(t: pa.DataType) -> bool:
    return _is_text(t) or _is_text_list(t)


def _is_reference(t: pa.DataType) -> bool:
    vt = t.value_type if _is_list(t) else t
    return _is_text(vt) or _is_number(vt) or pa.types.is_null(vt)


def _is_messages(t: pa.DataType) -> bool:
    if not _is_list(t):
        return False
    vt = t.value_type
    return pa.types.is_struct(vt) and {vt.field(i).name for i in range(vt.num_fields)} >= {"role", "content"}


# canonical column -> (Arrow type check, the expected type in words for the error message)
_COLUMN_TYPES: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "id": (_is_id, "string or integer"),
    "prompt": (_is_text, "string"),
    "route": (_is_text, "string"),
    "max_new_tokens": (pa.types.is_integer, "integer"),
    "seed": (pa.types.is_integer, "integer"),
    "temperature": (_is_number, "number"),
    "top_p": (_is_number, "number"),
    "turns": (_is_text_list, "list of strings"),
    "stop": (_is_stop, "string or list of strings"),
    "messages": (_is_messages, "list of {role, content}"),
    "reference": (_is_reference, "string, number, or a list of them"),
}


def _type_ok(canonical: str, t: pa.DataType) -> bool:
    """Whether a column of Arrow type ``t`` can feed ``canonical``; an all-null column fits anything but the id."""
    if pa.types.is_null(t):
        return canonical != "id"
    check = _COLUMN_TYPES.get(canonical)
    return check is None or check[0](t)


def _read_schema(path: str, fmt: str) -> tuple[pa.Schema, int]:
    """(schema, row count) of one input file. Raises InputError naming the file."""
    try:
        dset = _file_dataset(path, fmt)
        return dset.schema, dset.count_rows()
    except (pa.ArrowInvalid, OSError) as exc:
        bad = _first_bad_json_line(path) if fmt == "jsonl" else None
        if bad is not None:
            raise InputError(f"{path}, line {bad[0]}: not a JSON object ({bad[1]})") from None
        hint = ""
        if fmt == "jsonl" and "changed from" in str(exc):
            hint = ("; in JSONL every row must give a column the same JSON type (for `reference`: a list on "
                    "every row, e.g. [\"18\"] for a one-turn row, or a string on every row)")
        raise InputError(f"cannot read input file {path}: {exc}{hint}") from None


def _first_bad_json_line(path: str) -> Optional[tuple[int, str]]:
    """``(line number counted from 1, what is wrong)`` of the first non-blank line of a JSONL file that is not
    one JSON object; None when every line is one (or the file cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    return n, f"{exc.msg} (column {exc.pos + 1})"
                if not isinstance(value, dict):
                    return n, f"a JSON {type(value).__name__}"
    except OSError:
        return None
    return None


def _check_columns(path: str, schema: pa.Schema, num_rows: int, cols: dict[str, str]) -> set[str]:
    """The canonical columns one file has; ``cols`` maps canonical -> source name. Raises InputError when a
    non-empty file lacks the id or every prompt column, or a column has the wrong type."""
    names = set(schema.names)
    if num_rows > 0 and cols["id"] not in names:
        raise InputError(f"{path}: missing id column {cols['id']!r} (columns: {sorted(names)})")
    if num_rows > 0 and not names & {cols["prompt"], cols["messages"], cols["turns"]}:
        raise InputError(
            f"{path}: needs one of the columns {cols['prompt']!r}, {cols['messages']!r} or {cols['turns']!r}"
            f" (columns: {sorted(names)})"
        )
    here = set()
    for canonical, source in cols.items():
        if source in names:
            t = schema.field(source).type
            if not _type_ok(canonical, t):
                raise InputError(f"{path}: column {source!r} has type {t}, expected {_COLUMN_TYPES[canonical][1]}")
            here.add(canonical)
    return here


def plan_input(spec: InputSpec) -> InputPlan:
    """Find the files, check the columns, count rows (metadata only for Parquet). Raises InputError."""
    files = _list_files(spec.path)
    fmt = _format_of(files, spec.format)
    cols = spec.columns.model_dump()
    present: set[str] = set()
    file_rows = []
    hasher = hashlib.sha256()
    for f in files:
        if fmt == "jsonl" and _blank_jsonl(f):
            file_rows.append(0)
            # "\00" is one NUL (an octal escape), not NUL + "0": kept so existing fingerprints stay the same
            hasher.update(f"{os.path.abspath(f)}\0{os.path.getsize(f)}\00\n".encode())
            continue
        schema, n = _read_schema(f, fmt)
        present |= _check_columns(f, schema, n, cols)
        file_rows.append(n)
        hasher.update(f"{os.path.abspath(f)}\0{os.path.getsize(f)}\0{n}\n".encode())
    return InputPlan(
        files=tuple(files), format=fmt, file_rows=tuple(file_rows), columns=tuple(sorted(present)),
        fingerprint=hasher.hexdigest()[:16],
    )


def check_ids(spec: InputSpec, plan: InputPlan, *, select: Optional[Callable[[str], bool]] = None) -> int:
    """Refuse null ids and duplicate ids, reading only the id column.

    Returns the number of rows whose id ``select`` accepts (all rows without ``select``); the submit path uses
    it to make sure a shadow sample is not empty.

    The message names how many distinct ids repeat, how many extra rows they make, and the first few ids,
    e.g. ``duplicate ids in input: 7 ids appear more than once (13 extra rows): '0', '1', '2', '3', '4' and
    2 more``.

    Raises:
        InputError: a null id, an id that is not valid UTF-8, or duplicate ids.
    """
    id_col = spec.columns.id
    seen: set = set()
    dup_ids: dict[str, None] = {}  # insertion-ordered set of the ids seen more than once
    extra_rows = 0
    row_idx = 0
    selected = 0
    for f, n in zip(plan.files, plan.file_rows):
        if n == 0:
            continue
        for _, batch in _iter_batches(f, plan.format, [id_col]):
            for v in _column_values(batch.column(0), id_col):
                if v is None:
                    raise InputError(f"row {row_idx} ({f}): id is null; every row needs an id")
                if isinstance(v, InvalidText):
                    raise InputError(f"row {row_idx} ({f}): id is not valid UTF-8 ({v.detail})")
                key = str(v)
                if key in seen:
                    extra_rows += 1
                    dup_ids[key] = None
                else:
                    seen.add(key)
                selected += 1 if select is None or select(key) else 0
                row_idx += 1
    if dup_ids:
        shown = list(dup_ids)[:MAX_DUPLICATES_SHOWN]
        more = f" and {len(dup_ids) - len(shown)} more" if len(dup_ids) > len(shown) else ""
        ids = "id appears" if len(dup_ids) == 1 else "ids appear"
        rows = "row" if extra_rows == 1 else "rows"
        raise InputError(f"duplicate ids in input: {len(dup_ids)} {ids} more than once ({extra_rows} extra {rows}): "
                         f"{', '.join(map(repr, shown))}{more}")
    return selected


def iter_raw_rows(plan: InputPlan, row_start: int, row_stop: int, columns: list[str]) -> Iterator[tuple[int, dict]]:
    """Yield (row_idx, {column: value}) for rows [row_start, row_stop), streaming."""
    base = 0
    for f, n in zip(plan.files, plan.file_rows):
        if base + n <= row_start or n == 0:
            base += n
            continue
        if base >= row_stop:
            return
        for first, batch in _iter_batches(f, plan.format, columns, skip_rows=max(0, row_start - base)):
            row_idx = base + first
            if row_idx + batch.num_rows <= row_start:
                continue
            lo = max(0, row_start - row_idx)
            hi = min(batch.num_rows, row_stop - row_idx)
            for i, rec in enumerate(_records(batch.slice(lo, hi - lo))):
                yield row_idx + lo + i, rec
            if row_idx + batch.num_rows >= row_stop:
                return
        base += n


def iter_shards(plan: InputPlan, *, columns: list[str], shard_rows: int, skip: frozenset[int] = frozenset()
                ) -> Iterator[tuple[int, list[tuple[int, dict]]]]:
    """Yield (shard, [(row_idx, record), ...]) in order, reading the input in one pass (lazily: a shard is
    read when the consumer asks for it). Shards in ``skip`` are not read where whole files can be skipped.

    Example: 10 rows, shard_rows 4, skip {1} -> (0, rows 0-3), (2, rows 8-9).
    """
    n = plan.num_shards(shard_rows)
    s = 0
    while s < n:
        if s in skip:
            s += 1
            continue
        e = s
        while e < n and e not in skip:
            e += 1
        cur, buf = s, []
        cur_stop = min((cur + 1) * shard_rows, plan.num_rows)
        for row_idx, rec in iter_raw_rows(plan, s * shard_rows, min(e * shard_rows, plan.num_rows), columns):
            buf.append((row_idx, rec))
            if row_idx + 1 == cur_stop:
                yield cur, buf
                cur, buf = cur + 1, []
                cur_stop = min((cur + 1) * shard_rows, plan.num_rows)
        assert cur == e and not buf, f"input ended early: shard {cur} incomplete (input changed since submit?)"
        s = e


def answer_columns(spec: InputSpec) -> list[str]:
    """The input column names a row's answer depends on: every mapped column but ``reference`` (which only
    feeds shadow scoring). The id column comes first."""
    cols = spec.columns.model_dump()
    ref = cols.pop("reference")
    return [c for c in dict.fromkeys(cols.values()) if c != ref]


def row_fingerprint(rec: dict, columns: list[str]) -> str:
    """16 hex digits over the row's values in ``columns`` (a missing column counts as null).

    Equal rows give equal fingerprints in every process; any change of the id or of a value the answer
    depends on (prompt, messages, turns, route, per-row parameters) gives another one.

    >>> a = row_fingerprint({"id": 1, "prompt": "hi"}, ["id", "prompt"])
    >>> a == row_fingerprint({"id": 1, "prompt": "hi", "other": 0}, ["id", "prompt"]), len(a)
    (True, 16)
    >>> a == row_fingerprint({"id": 1, "prompt": "hi!"}, ["id", "prompt"])
    False
    """
    values = [rec.get(c) for c in columns]
    blob = json.dumps(values, sort_keys=True, default=repr, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def shard_fingerprint(rows: list[tuple[int, str]]) -> str:
    """16 hex digits over a shard's ``[(row_idx, row fingerprint), ...]`` in row order, so an edited,
    added, removed or moved row changes it (a row's seed depends on its position)."""
    h = hashlib.sha256()
    for row_idx, fp in rows:
        h.update(f"{row_idx}\t{fp}\n".encode())
    return h.hexdigest()[:16]
