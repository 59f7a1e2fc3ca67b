"""Readers for the public benchmark prompt sets in ``../shared/data`` (never copied into the project).

Protocol (shared/data/README.md) with one change: no system message by default (the data's protocol
names "You are a helpful assistant."; ``PROTOCOL_SYSTEM_PROMPT``, ``bench --system``), so the bench, jobs
and ``generate`` all put the same messages under the model's own chat template (issue 13); HumanEval prompt =
"Implement the following code.\\n" + prompt; MGSM-ZH prompt = the bare question; Spec-Bench two-turn
questions feed the model's own turn-1 answer back before turn 2. Smoke subset: within each group, in file
order, with n items, the items at positions floor(k*n/8) for k = 0..7.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PROTOCOL_SYSTEM_PROMPT = "You are a helpful assistant."  # the data's protocol; opt-in (bench --system)
SETS = ("spec_bench", "human_eval", "mgsm_zh")
MULTI_TURN_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item: ``turns`` are user turns answered in order (one for single-turn sets).

    ``references`` holds each turn's reference answers where the set has them (MGSM-ZH: the numeric answer;
    Spec-Bench: the record's ``reference`` list, several acceptable answers for a RAG question); an empty
    tuple for a turn without one. Score them with ``racer_batch.capability.answer_correct``.
    """

    set: str
    group: str
    item_id: str
    turns: tuple[str, ...]
    references: tuple[tuple[str, ...], ...] = ()

    def turn_references(self, turn: int) -> tuple[str, ...]:
        """The reference answers of turn ``turn`` (0-based); empty when the data has none."""
        return self.references[turn] if turn < len(self.references) else ()


def _spec_bench_references(rec: dict) -> tuple[tuple[str, ...], ...]:
    """Per-turn references of a Spec-Bench record: a string, a list of acceptable strings, or empty."""
    refs = rec.get("reference") or []
    out: list[tuple[str, ...]] = []
    for ref in refs[: len(rec["turns"])]:
        if isinstance(ref, str):
            out.append((ref,) if ref.strip() else ())
        elif isinstance(ref, list):
            out.append(tuple(str(r) for r in ref if str(r).strip()))
        else:
            out.append(())
    return tuple(out)


def data_root() -> Path:
    """``$RACER_BATCH_DATA``, else ``../shared/data`` beside the project root."""
    env = os.environ.get("RACER_BATCH_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def load_set(name: str, root: Path | None = None) -> list[BenchPrompt]:
    """All items of one set, in file order.

    Raises:
        FileNotFoundError: the data folder is missing (set RACER_BATCH_DATA).
        ValueError: unknown set name.
    """
    root = root or data_root()
    if name == "spec_bench":
        out = []
        with open(root / "spec_bench" / "question.jsonl", encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                group = "multi_turn" if rec["category"] in MULTI_TURN_CATEGORIES else rec["category"]
                out.append(BenchPrompt("spec_bench", group, str(rec["question_id"]), tuple(rec["turns"]),
                                       _spec_bench_references(rec)))
        return out
    if name == "human_eval":
        with gzip.open(root / "human_eval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as fh:
            return [
                BenchPrompt("human_eval", "human_eval", r["task_id"],
                            ("Implement the following code.\n" + r["prompt"],))
                for r in map(json.loads, fh)
            ]
    if name == "mgsm_zh":
        with open(root / "mgsm_zh" / "mgsm_zh.tsv", encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
        return [BenchPrompt("mgsm_zh", "mgsm_zh", str(i), (r[0],), ((r[1],),)) for i, r in enumerate(rows)]
    raise ValueError(f"unknown prompt set {name!r}; expected one of {SETS}")


def smoke_subset(items: list[BenchPrompt], per_group: int = 8) -> list[BenchPrompt]:
    """The smoke rule per group (file order kept): positions floor(k*n/per_group), k = 0..per_group-1."""
    groups: dict[str, list[BenchPrompt]] = {}
    for it in items:
        groups.setdefault(it.group, []).append(it)
    out = []
    for members in groups.values():
        n = len(members)
        out.extend(members[(k * n) // per_group] for k in range(min(per_group, n)))
    return out


def smoke_prompts(per_set: int = 8, root: Path | None = None) -> list[BenchPrompt]:
    """``per_set`` items from each set, evenly spaced over that set's smoke subset.

    Spec-Bench's smoke subset has 8 items in each of its 6 groups; the first pick is always a two-turn
    (multi_turn) question.
    """
    out = []
    for name in SETS:
        smoke = smoke_subset(load_set(name, root))
        n = len(smoke)
        out.extend(smoke[(k * n) // per_set] for k in range(min(per_set, n)))
    return out


def spec_bench_mix(n: int, root: Path | None = None) -> list[BenchPrompt]:
    """``n`` Spec-Bench questions, deterministic, short and long mixed (the throughput and host-time
    benchmarks' prompts): ``ceil(n / 6)`` evenly spaced items per category (``sample_prompts``), then one item per
    category in turn, the categories ordered shortest, longest, second shortest, second longest, ... by the mean
    length of their first turns.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    per = -(-n // 6)
    groups: dict[str, list[BenchPrompt]] = {}
    for it in sample_prompts({"spec_bench": per}, root):
        groups.setdefault(it.group, []).append(it)
    by_len = sorted(groups, key=lambda g: statistics.mean(len(it.turns[0]) for it in groups[g]))
    order = []
    while by_len:
        order.append(by_len.pop(0))
        if by_len:
            order.append(by_len.pop())
    out = [groups[g][k] for k in range(per) for g in order if k < len(groups[g])]
    return out[:n]


def sample_prompts(counts: dict[str, int], root: Path | None = None) -> list[BenchPrompt]:
    """Items evenly spaced in file order: ``counts[set]`` per Spec-Bench category (``multi_turn``,
    ``translation``, ...) and per whole set for HumanEval and MGSM-ZH (positions floor(k*n/count)).
    A key ``set/group`` (e.g. ``spec_bench/rag``) takes that one group only, with the same items as the
    whole set's key would pick there, so a long run can be split over processes by category.

    >>> len(sample_prompts({"spec_bench": 10, "human_eval": 20, "mgsm_zh": 20}))
    100
    >>> [p.group for p in sample_prompts({"spec_bench/rag": 2})]
    ['rag', 'rag']

    Raises:
        ValueError: an unknown set or group name, or a count below 1.
    """
    out = []
    for key, count in counts.items():
        name, _, only = key.partition("/")
        if name not in SETS:
            raise ValueError(f"unknown prompt set {name!r}; expected one of {SETS}")
        if count < 1:
            raise ValueError(f"{key}: count must be >= 1, got {count}")
        items = load_set(name, root)
        groups: dict[str, list[BenchPrompt]] = {}
        for it in items:
            groups.setdefault(it.group, []).append(it)
        if only:
            if only not in groups:
                raise ValueError(f"{name} has no group {only!r}; groups: {sorted(groups)}")
            groups = {only: groups[only]}
        for members in groups.values():
            n = len(members)
            out.extend(members[(k * n) // count] for k in range(min(count, n)))
    return out


def parse_sample(text: str) -> dict[str, int]:
    """``"spec_bench=10,human_eval=20"`` -> ``{"spec_bench": 10, "human_eval": 20}``; ``SET/GROUP=COUNT``
    (``spec_bench/qa=10``) keeps one group of a set.

    Raises:
        ValueError: a part that is not ``SET=COUNT`` or ``SET/GROUP=COUNT`` with a known set and a positive
            count (the group is checked when the data is read).
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, num = part.partition("=")
        name = name.strip()
        set_name, slash, group = name.partition("/")
        if (not eq or not num.strip().isdigit() or int(num) < 1 or set_name not in SETS
                or (slash and not group)):
            raise ValueError(f"{part!r}: expected SET=COUNT or SET/GROUP=COUNT with SET one of {SETS} and COUNT >= 1")
        out[name] = int(num)
    if not out:
        raise ValueError("empty sample: expected SET=COUNT[,SET=COUNT...]")
    return out


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template (a base model's does not: its prompts go in as raw text)."""
    return bool(getattr(tokenizer, "chat_template", None))


def conversation(turns: list[str], answers: list[str], *, system_prompt: Optional[str] = None,
                 chat: bool = True) -> list[dict] | str:
    """Chat messages for the next turn: the system prompt (none by default: the model's chat template
    decides), then the turns so far with the model's answers. ``chat=False`` (a base model without a chat
    template): the same as one raw text, the parts separated and closed by blank lines.

    >>> conversation(["Hi", "More"], ["Hello"])
    [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}, {'role': 'user', 'content': 'More'}]
    >>> conversation(["Hi", "More"], ["Hello"], chat=False)
    'Hi\n\nHello\n\nMore\n\n'
    """
    if not chat:
        parts = [system_prompt] if system_prompt else []
        for i, t in enumerate(turns):
            parts.append(t)
            if i < len(answers):
                parts.append(answers[i])
        return "".join(f"{p}\n\n" for p in parts)
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs
