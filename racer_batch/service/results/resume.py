"""What a (re-)run of a job can keep from its output folder: resume never keeps a stale answer.

A part file is kept only when it was written for the same spec hash and row range, has no cancelled rows,
and answered the rows the input holds *now*: its footer stores the fingerprint of its input rows (every
column the answer depends on, plus each row's position, which sets its seed; inputs.row_fingerprint), and
the input is read again to compare. A shard whose rows changed (an edited prompt, rows added, removed or
moved) is redone, not refused: its old part file is deleted before the run, so the folder never shows the
old answer, and the ids that changed are logged and returned. Part files of shards the input no longer has
(rows removed at the end) are deleted too. Files written before fingerprints existed cannot be checked:
they are deleted and redone once.

Example: 12 rows in shards of 4 have run. The prompt of id 5 is edited and ids 12 and 13 are appended:
shard 0 is kept; shard 1 (id 5) is redone; shard 2 is kept; shard 3 (ids 12, 13) is new.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from racer_batch.service.job.inputs import InputPlan, answer_columns, iter_shards, row_fingerprint, shard_fingerprint
from racer_batch.service.job.spec import JobSpec
from racer_batch.service.results.output import existing_parts, meta_matches, part_path, read_part_footer
from racer_batch.service.results.shadow import shadow_path

log = logging.getLogger(__name__)

MAX_IDS_SHOWN = 5


@dataclass
class ResumePlan:
    """What the folder holds for this spec and input.

    ``done``: shard -> committed summary (kept); ``changed``: shard -> {kind: ids} of the rows that differ from
    what its part file answered (kinds: edited, added, removed, moved; redone); ``unverified``: shards whose part
    file predates input fingerprints (redone); ``gone``: part files of shards past the input's end (deleted)."""

    done: dict[int, dict] = field(default_factory=dict)
    changed: dict[int, dict[str, list[str]]] = field(default_factory=dict)
    unverified: list[int] = field(default_factory=list)
    gone: list[Path] = field(default_factory=list)

    def describe(self) -> list[str]:
        """One line per kind of redone shard, e.g. ``redoing shard 1: input rows changed since it was written
        (edited '5'; removed '4')``; [] when nothing is redone for a changed input."""
        lines = []
        for shard, kinds in sorted(self.changed.items()):
            parts = []
            for kind, ids in kinds.items():
                shown = ", ".join(map(repr, ids[:MAX_IDS_SHOWN]))
                more = f" and {len(ids) - MAX_IDS_SHOWN} more" if len(ids) > MAX_IDS_SHOWN else ""
                parts.append(f"{kind} {shown}{more}")
            lines.append(f"redoing shard {shard}: input rows changed since it was written ({'; '.join(parts)})")
        if self.unverified:
            lines.append(f"redoing {len(self.unverified)} shard(s) written before input fingerprints existed "
                         f"(shards {', '.join(map(str, self.unverified[:10]))}"
                         f"{' ...' if len(self.unverified) > 10 else ''})")
        if self.gone:
            lines.append(f"deleting {len(self.gone)} part file(s) of rows the input no longer has "
                         f"({', '.join(p.name for p in self.gone[:5])})")
        return lines


def _changed_ids(old: list[tuple[str, str]] | None, new: list[tuple[str, str]]) -> dict[str, list[str]]:
    """How a shard's rows changed, by id: ``edited`` (same id, other input), ``added``, ``removed``, ``moved``
    (same id and input at another position); kinds with no id are left out.

    >>> _changed_ids([("a", "1"), ("b", "2")], [("b", "2"), ("a", "1"), ("c", "3")])
    {'added': ['c'], 'moved': ['a', 'b']}
    >>> _changed_ids([("a", "1"), ("b", "2")], [("a", "9")])
    {'edited': ['a'], 'removed': ['b']}
    """
    old = [(str(i), f) for i, f in (old or [])]
    new = [(str(i), f) for i, f in new]
    kinds = {"edited": [], "added": [], "removed": _missing(old, new), "moved": [], "same": []}
    old_at = {i: (k, f) for k, (i, f) in enumerate(old)}
    for k, (i, f) in enumerate(new):
        kinds[_row_change(old_at.get(i), k, f)].append(i)
    kinds["moved"].sort()
    return {k: v for k, v in kinds.items() if v and k != "same"}


def _missing(old: list[tuple[str, str]], new: list[tuple[str, str]]) -> list[str]:
    """Ids of ``old`` that ``new`` does not hold, in ``old``'s order."""
    now = {i for i, _ in new}
    return [i for i, _ in old if i not in now]


def _row_change(before: tuple[int, str] | None, position: int, fingerprint: str) -> str:
    """The kind of change of one current row, given its (position, fingerprint) in the part file if any."""
    if before is None:
        return "added"
    if before[1] != fingerprint:
        return "edited"
    return "moved" if before[0] != position else "same"


def plan_resume(spec: JobSpec, plan: InputPlan) -> ResumePlan:
    """Compare the output folder with the input as it is now (reads the input rows of every shard that has
    a part file for this spec; nothing when the folder holds no part files). Raises what reading the input
    raises (InputError, OSError, pyarrow errors)."""
    shard_rows = spec.output.shard_rows
    num_shards = plan.num_shards(shard_rows)
    spec_hash = spec.spec_hash()
    result = ResumePlan()
    parts = existing_parts(spec.output.path)
    result.gone = [p for s, p in parts.items() if s >= num_shards]
    candidates: dict[int, tuple[dict, list | None]] = {}
    for shard, path in parts.items():
        if shard >= num_shards:
            continue
        meta, rows = read_part_footer(path)
        if not meta_matches(meta, spec_hash=spec_hash, row_range=plan.shard_range(shard, shard_rows)):
            continue  # cancelled, another range or spec: rewritten when the shard runs
        if not meta.get("input_fingerprint"):
            result.unverified.append(shard)
            continue
        candidates[shard] = (meta, rows)
    if not candidates:
        return result
    cols = answer_columns(spec.input)
    id_col = spec.input.columns.id
    skip = frozenset(set(range(num_shards)) - set(candidates))
    for shard, recs in iter_shards(plan, columns=cols, shard_rows=shard_rows, skip=skip):
        meta, old_rows = candidates[shard]
        new_rows = [(str(rec.get(id_col)), row_fingerprint(rec, cols)) for _, rec in recs]
        fp = shard_fingerprint([(row_idx, h) for (row_idx, _), (_, h) in zip(recs, new_rows)])
        if fp == meta["input_fingerprint"]:
            result.done[shard] = meta
        else:
            result.changed[shard] = _changed_ids(old_rows, new_rows) or {"edited": ["?"]}
    return result


def clear_stale(spec: JobSpec, resume: ResumePlan) -> None:
    """Delete the part (and shadow) files that must not be read as answers: changed and unverified shards
    and shards past the input's end. Raises OSError when a file cannot be deleted."""
    out = spec.output.path
    doomed = list(resume.gone) + [part_path(out, s) for s in [*resume.changed, *resume.unverified]]
    for p in doomed:
        shard_name = p.stem.split("-", 1)[1]
        for f in (p, shadow_path(out, shard_name)):
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
