"""The report names the weights a job's shards ran on (issue 31: ``model.weights`` may be unset, and a GGUF model
then runs as stored where it can, else on float32): from the shard summaries, which record the loaded bundle's."""

from __future__ import annotations

from types import SimpleNamespace

from racer_batch.report.build import _job_summary, _weights_text


def _data(shards: dict) -> SimpleNamespace:
    manifest = {"name": "j", "state": "done", "model": "smollm2-135m", "method": "racer", "shards": shards}
    return SimpleNamespace(manifest=manifest, spec={"decoding": {"method": "racer"}}, job_id="j1", out_dir="out")


def test_the_report_names_the_weights_the_shards_ran_on():
    job = _job_summary(_data({"00000": {"weights": "as_stored"}, "00001": {"weights": "as_stored"}}), [])
    assert job["weights"] == ["as_stored"] and _weights_text(job) == "as_stored"
    mixed = _job_summary(_data({"00000": {"weights": "float32"}, "00001": {"weights": "as_stored"}}), [])
    assert _weights_text(mixed) == "as_stored + float32"  # a resumed job may switch it (never hashed)
    old = _job_summary(_data({"00000": {"rows": 3}}), [])  # output written before shards recorded it
    assert _weights_text(old) == "unrecorded"
