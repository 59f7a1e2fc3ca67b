"""Turning one input record into a row to answer (``parse_row`` -> ``RowTask``): the prompt in its form (chat
messages, a raw prompt, or user turns answered one after another), the row's own generation parameters over the
job's, its seed and route, its reference answers. A bad row becomes a ``RowTask`` with ``error`` set (written as
status=error), never an exception. Reading the records from the input files is inputs.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from racer_batch.service.job.inputs import InvalidText
from racer_batch.service.job.spec import ColumnMap, JobSpec

Chat = list[dict[str, str]]


@dataclass
class RowTask:
    """One input row, normalised. ``error`` set means the row is bad and is written as status=error."""

    row_idx: int
    id: str
    route: str
    seed: int
    chat: Optional[Chat] = None  # messages to answer (prompt or messages rows; raw prompts use `raw`)
    raw: Optional[str] = None  # a raw (non-chat) prompt
    turns: Optional[list[str]] = None  # user turns answered one after another
    params: Any = None  # GenerationParams
    error: Optional[str] = None
    extra: dict = field(default_factory=dict)
    reference: Optional[list[Optional[str]]] = None  # reference answer per turn (parse_reference); analysis only


def _clean_str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{what} must be a string, got {type(v).__name__}")
    if not v.strip():
        raise ValueError(f"{what} is empty")
    return v


def _reference_text(v: Any) -> Optional[str]:
    """One reference entry as text; None for null, empty or NaN; raises TypeError for another type."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise TypeError(type(v).__name__)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return None
        v = int(v) if v.is_integer() else v
    text = str(v)
    return text if text.strip() else None


def parse_reference(value: Any, *, n_turns: int) -> Optional[list[Optional[str]]]:
    """The row's reference answers, one per turn (``n_turns`` >= 1), or None when it has none to use.

    A string or number is the reference of the last turn (the final answer); a list gives one per turn and
    must have exactly ``n_turns`` entries (a null or empty entry: that turn has none). Any other value (another
    type, a list of another length, text that is not valid UTF-8) gives None: references only feed the shadow
    analysis, so a bad one never fails the row; the report counts the turns that had a scorable one.

    >>> parse_reference("18", n_turns=1), parse_reference(1000.0, n_turns=2)
    (['18'], [None, '1000'])
    >>> parse_reference(["", "#### 7"], n_turns=2)
    [None, '#### 7']
    >>> parse_reference(["a"], n_turns=2) is None, parse_reference({"a": 1}, n_turns=1) is None
    (True, True)
    """
    assert n_turns >= 1, f"n_turns must be >= 1, got {n_turns}"
    try:
        if isinstance(value, (list, tuple)):
            if len(value) != n_turns:
                return None
            refs = [_reference_text(v) for v in value]
        else:
            refs = [None] * (n_turns - 1) + [_reference_text(value)]
    except TypeError:
        return None
    return refs if any(r is not None for r in refs) else None


_ROW_PARAM_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed")


def _check_utf8(rec: dict, reference_col: str) -> None:
    """Raise ValueError for the first column (but the reference's) whose text is not valid UTF-8."""
    bad = next((v for k, v in rec.items() if isinstance(v, InvalidText) and k != reference_col), None)
    if bad is not None:
        raise ValueError(f"column {bad.column!r} is not valid UTF-8 ({bad.detail})")


def _row_overrides(rec: dict, cols: ColumnMap) -> dict[str, Any]:
    """The per-row generation parameters the record sets, by GenerationParams field name."""
    overrides: dict[str, Any] = {}
    for name in _ROW_PARAM_FIELDS:
        v = rec.get(getattr(cols, name))
        if v is not None:
            overrides[name] = v
    stop = rec.get(cols.stop)
    if stop is not None:
        overrides["stop"] = [stop] if isinstance(stop, str) else list(stop)
    return overrides


def _row_params(job: JobSpec, overrides: dict[str, Any], *, seed: int) -> Any:
    """``job.row_params``, with a pydantic error turned into a ValueError naming the field and value."""
    try:
        return job.row_params(overrides, seed=seed)
    except ValidationError as exc:
        e = exc.errors()[0]
        field_name = ".".join(str(p) for p in e["loc"])
        raise ValueError(f"invalid per-row {field_name} = {e.get('input')!r}: {e['msg']}") from None


def _messages_chat(messages: Any, head: Chat) -> Chat:
    """A messages row as the chat to answer: ``head`` (the system prompt) first unless the row has its own."""
    if not messages:
        raise ValueError("messages is empty")
    chat: Chat = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}].role = {role!r}: expected system, user or assistant")
        chat.append({"role": role, "content": _clean_str(m.get("content"), f"messages[{i}].content")})
    if chat[-1]["role"] != "user":
        raise ValueError("the last message must be from the user")
    return (head if chat[0]["role"] != "system" else []) + chat


def _set_prompt(task: RowTask, job: JobSpec, rec: dict) -> None:
    """Fill ``task.raw``, ``task.chat`` or ``task.turns`` from the one prompt field the record sets.
    Raises ValueError when none or several are set, or the one set is malformed."""
    cols = job.input.columns
    system = job.generation.system_prompt
    head: Chat = [{"role": "system", "content": system}] if system else []
    prompt, messages, turns = rec.get(cols.prompt), rec.get(cols.messages), rec.get(cols.turns)
    given = [n for n, v in (("prompt", prompt), ("messages", messages), ("turns", turns)) if v is not None]
    if not given:
        raise ValueError("no prompt: prompt, messages and turns are all null")
    if len(given) > 1:
        raise ValueError(f"several prompt fields set ({', '.join(given)}); set exactly one")
    if prompt is not None:
        text = _clean_str(prompt, "prompt")
        if job.input.prompt_format != "chat":
            task.raw = text
        if job.input.prompt_format != "raw":  # auto: both; the worker takes chat where the model has a template
            task.chat = head + [{"role": "user", "content": text}]
    elif messages is not None:
        task.chat = _messages_chat(messages, head)
    else:
        if not turns:
            raise ValueError("turns is empty")
        task.turns = [_clean_str(t, f"turns[{i}]") for i, t in enumerate(turns)]
        task.chat = head


def parse_row(job: JobSpec, row_idx: int, rec: dict) -> RowTask:
    """Normalise one input record; a bad row comes back with ``error`` set (never raises).

    The reference column (``parse_reference``) never makes a row bad: an unusable reference is dropped."""
    cols = job.input.columns
    rid = rec.get(cols.id)
    route = rec.get(cols.route)
    route = job.route if not route or isinstance(route, InvalidText) else route
    task = RowTask(row_idx=row_idx, id=str(rid), route=str(route), seed=(job.seed + row_idx) % (2**63))
    try:
        _check_utf8(rec, cols.reference)
        task.params = _row_params(job, _row_overrides(rec, cols), seed=task.seed)
        task.seed = task.params.seed
        _set_prompt(task, job, rec)
        task.reference = parse_reference(rec.get(cols.reference), n_turns=len(task.turns) if task.turns else 1)
    except ValueError as exc:
        task.error = str(exc)
    return task
