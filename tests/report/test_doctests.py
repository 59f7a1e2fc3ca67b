"""The worked examples in the docstrings of the pure functions are run as tests."""

import doctest

import pytest

import racer_batch.report.export
import racer_batch.report.shadow
import racer_batch.service.job.inputs
import racer_batch.service.results.shadow


@pytest.mark.parametrize("module", [racer_batch.report.shadow, racer_batch.report.export,
                                    racer_batch.service.results.shadow, racer_batch.service.job.inputs])
def test_docstring_examples(module):
    res = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
