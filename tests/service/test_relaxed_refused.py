"""Relaxed (lossy) acceptance is refused in a job unless a lossless shadow comparison runs beside it."""

import pytest
from pydantic import ValidationError

from racer_batch.service.spec import JobSpec

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
