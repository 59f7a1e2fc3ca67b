"""Relaxed (lossy) acceptance is refused in a job unless a lossless shadow comparison runs beside it."""

import pytest
from pydantic import ValidationError

from racer_batch.service.job.spec import JobSpec

BASE = {"input": {"path": "x.parquet"}, "output": {"path": "out"}}


def test_relaxed_without_shadow_is_refused():
    with pytest.raises(ValidationError, match="refused unless the job also runs a shadow"):
        JobSpec.model_validate({**BASE, "decoding": {"method": "racer", "acceptance": "topk", "relaxed_topk": 2}})


def test_relaxed_with_relaxed_shadow_is_refused():
    spec = {**BASE, "decoding": {"acceptance": "threshold"},
            "shadow": {"config": {"method": "ar", "acceptance": "topk"}, "fraction": 0.1}}
    with pytest.raises(ValidationError, match="must decode losslessly"):
        JobSpec.model_validate(spec)


def test_relaxed_with_lossless_shadow_is_accepted_and_lossless_needs_nothing():
    spec = JobSpec.model_validate({**BASE, "decoding": {"acceptance": "topk"},
                                   "shadow": {"config": {"method": "ar"}, "fraction": 0.1}})
    assert spec.decoding.acceptance == "topk"
    assert JobSpec.model_validate(BASE).decoding.acceptance == "lossless"


def test_relaxed_with_an_empty_shadow_sample_is_refused_at_submit(tmp_path):
    from racer_batch.service.job.inputs import InputError
    from racer_batch.service.results.shadow import shadow_selected
    from racer_batch.service.submit import validate_job
    from tests.fixtures import write_parquet

    ids = [f"r{i}" for i in range(6)]
    write_parquet(tmp_path / "in.parquet", [{"id": i, "prompt": "p"} for i in ids])
    fraction = 0.01
    seed = next(s for s in range(1000) if not any(shadow_selected(s, i, fraction) for i in ids))

    def spec(dec: dict, fr: float) -> JobSpec:
        return JobSpec.model_validate({"input": {"path": str(tmp_path / "in.parquet")},
                                       "output": {"path": str(tmp_path / "out")}, "decoding": dec,
                                       "shadow": {"config": {"method": "ar"}, "fraction": fr, "seed": seed}})

    with pytest.raises(InputError, match=r"selects none of the 6 rows.*raise shadow.fraction"):
        validate_job(spec({"acceptance": "topk"}, fraction))
    assert validate_job(spec({"acceptance": "topk"}, 1.0)).num_rows == 6  # every row shadowed
    assert validate_job(spec({}, fraction)).num_rows == 6  # a lossless job may sample nothing


def test_corpus_path_is_resolved_from_the_job_file_and_checked_at_submit(tmp_path):
    from racer_batch.service.job.inputs import InputError
    from racer_batch.service.job.spec import load_spec
    from racer_batch.service.submit import validate_job
    from tests.fixtures import write_parquet

    write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "p"}])
    job = tmp_path / "job.yaml"
    job.write_text("input: {path: in.parquet}\noutput: {path: out}\n"
                   "decoding: {method: rest, corpus_path: corpus.jsonl}\n")
    spec = load_spec(job)
    assert spec.decoding.corpus_path == str(tmp_path / "corpus.jsonl")  # the job file's folder, not the cwd
    with pytest.raises(InputError, match="corpus_path = .*corpus.jsonl': no such file"):
        validate_job(spec)
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello"}\n')
    assert validate_job(spec).num_rows == 1
