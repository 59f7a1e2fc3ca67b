"""Resume never keeps a stale answer (issue 13, part 4), and the output folder is a Parquet dataset (part 2).

Stand-in engine on threads, real Redis. The stand-in's answer depends on the prompt text and the row's seed
(job seed + row position), so a fresh job over the same input in another folder is the oracle.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from racer_batch.service.execution.local import run_until_done
from racer_batch.service.job.spec import load_spec
from racer_batch.service.results.output import (
    ROWS_META_KEY,
    SHARD_META_KEY,
    part_path,
    read_output,
)
from racer_batch.service.submit import submit_job
from tests.fixtures import base_overrides, queue_url, write_parquet

pytestmark = pytest.mark.service


def _run(queue, spec):
    sub = submit_job(queue, spec)
    assert run_until_done(queue, sub.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    return sub


def _texts(out_dir) -> dict[str, str]:
    rows = read_output(out_dir).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"an id appears twice: {sorted(ids)}"
    return {r["id"]: r["text"] for r in rows}


def _oracle(queue, tmp_path, rows, name) -> dict[str, str]:
    """Answers of a fresh job over ``rows`` (its own input file and output folder)."""
    write_parquet(tmp_path / f"{name}.parquet", rows)
    spec = load_spec(None, base_overrides(tmp_path, **{"input.path": str(tmp_path / f"{name}.parquet"),
                                                       "output.path": str(tmp_path / name)}))
    _run(queue, spec)
    return _texts(spec.output.path)


def test_edited_appended_removed_and_reordered_rows_get_current_answers(queue, tmp_path):
    spec = load_spec(None, base_overrides(tmp_path))  # shards of 4 rows
    rows = [{"id": str(i), "prompt": f"question {i}"} for i in range(12)]
    write_parquet(tmp_path / "in.parquet", rows)
    first = _run(queue, spec)
    assert _texts(spec.output.path) == _oracle(queue, tmp_path, rows, "oracle1")
    shard0 = part_path(spec.output.path, 0).read_bytes()

    # edit id 5 (shard 1), swap ids 8 and 9 (shard 2), append ids 12 and 13 (a new shard 3)
    rows[5] = {"id": "5", "prompt": "question 5, edited"}
    rows[8], rows[9] = rows[9], rows[8]
    rows += [{"id": "12", "prompt": "question 12"}, {"id": "13", "prompt": "question 13"}]
    write_parquet(tmp_path / "in.parquet", rows)
    again = submit_job(queue, spec)
    assert again.job_id == first.job_id and again.action == "resumed"
    assert (again.shards_kept, again.shards_total) == (1, 4)
    assert any("shard 1" in n and "edited '5'" in n for n in again.notes), again.notes
    assert any("shard 2" in n and "moved '8', '9'" in n for n in again.notes), again.notes
    assert run_until_done(queue, again.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    texts = _texts(spec.output.path)
    assert texts == _oracle(queue, tmp_path, rows, "oracle2")
    assert sorted(texts, key=int) == [str(i) for i in range(14)]
    assert part_path(spec.output.path, 0).read_bytes() == shard0, "an unchanged shard must be kept as it was"

    # remove ids 11, 12 and 13: shard 2 shrinks (redone), shard 3 goes away (its part file too)
    rows = rows[:11]
    write_parquet(tmp_path / "in.parquet", rows)
    third = submit_job(queue, spec)
    assert any("deleting 1 part file" in n for n in third.notes), third.notes
    assert (third.shards_kept, third.shards_total) == (2, 3)
    assert run_until_done(queue, third.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    assert not part_path(spec.output.path, 3).exists()
    texts = _texts(spec.output.path)
    assert texts == _oracle(queue, tmp_path, rows, "oracle3")
    assert sorted(texts, key=int) == [str(i) for i in range(11)]
    st = queue.status(third.job_id)
    assert (st.rows_done, st.shards_done) == (11, 3), "Redis must forget the shards the folder dropped"
    # the folder is a Parquet dataset: no glob, no manifest or shadow file in the way
    assert pq.read_table(spec.output.path).num_rows == 11


def test_part_files_carry_the_input_fingerprint(queue, tmp_path):
    spec = load_spec(None, base_overrides(tmp_path))
    write_parquet(tmp_path / "in.parquet", [{"id": str(i), "prompt": f"p {i}"} for i in range(5)])
    _run(queue, spec)
    md = pq.read_schema(part_path(spec.output.path, 1)).metadata
    meta, rows = json.loads(md[SHARD_META_KEY]), json.loads(md[ROWS_META_KEY])
    assert meta["spec_hash"] == spec.spec_hash() and len(meta["input_fingerprint"]) == 16
    assert [r[0] for r in rows] == ["4"]


def test_part_files_without_input_fingerprints_are_redone(queue, tmp_path):
    """Part files whose footers carry no input fingerprints (nothing to check them against the input) are not
    kept: re-submitting resumes the same job, notes them, redoes them, and every row is answered once."""
    spec = load_spec(None, base_overrides(tmp_path))
    rows = [{"id": str(i), "prompt": f"p {i}"} for i in range(6)]
    write_parquet(tmp_path / "in.parquet", rows)
    first = _run(queue, spec)
    out = tmp_path / "out"
    for shard in (0, 1):  # strip the fingerprints
        p = part_path(out, shard)
        table = pq.read_table(p)
        md = dict(table.schema.metadata)
        meta = json.loads(md.pop(SHARD_META_KEY))
        meta.pop("input_fingerprint")
        md.pop(ROWS_META_KEY)
        md[SHARD_META_KEY] = json.dumps(meta).encode()
        pq.write_table(table.replace_schema_metadata(md), p)

    again = submit_job(queue, spec)
    assert again.job_id == first.job_id and again.action == "resumed"
    assert again.shards_kept == 0 and any("before input fingerprints" in n for n in again.notes), again.notes
    assert run_until_done(queue, again.job_id, url=queue_url(queue), prefix=queue.prefix,
                          executor_kind="thread").state == "done"
    assert sorted(_texts(out), key=int) == [str(i) for i in range(6)]
