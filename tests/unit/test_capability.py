"""Capability measures (racer_batch/capability.py): answer scoring, repetition, length helpers."""

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

import racer_batch.capability as cap


def test_docstring_examples():
    res = doctest.testmod(cap, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted >= 10 and res.failed == 0


@pytest.mark.parametrize("output, reference, expected", [
    ("珍妮特每天赚 9 × 2 = 18 美元。", "18", True),            # MGSM-ZH: last number
    ("利润是 70,000 美元", "70000", True),                        # thousands commas in the output
    ("利润是 70000 美元", "70,000", True),                        # ... and in the reference
    ("The answer is 18, not 19.", "18", False),                   # the last number counts
    ("He pays 1000 dollars in total.", "steps...\n#### 1000", True),  # GSM8K-style worked reference
    ("It costs 2.5 dollars", "2.50", True),
    ("no number here", "7", False),
    ("You are in SECOND   place.", "You are in second place.", True),  # short answer, folded
    ("You are first.", "You are in second place.", False),
    ("anything", "", None),
    ("anything", None, None),
    ("anything", "a reference that is far too long to be a short answer of a few words", None),
])
def test_answer_correct(output, reference, expected):
    assert cap.answer_correct(output, reference) is expected


def test_accuracy_and_mean_skip_unscored():
    assert cap.accuracy([True, None, False, True]) == (2, 3)
    assert cap.accuracy([None]) == (0, 0)
    assert cap.mean([1.0, None, 3.0]) == 2.0
    assert cap.mean([None]) is None


def test_repetition_detects_a_loop():
    looping = cap.text_units("the cat sat on the mat " * 10)
    varied = cap.text_units("one two three four five six seven eight nine ten eleven twelve")
    assert cap.repeated_ngram_rate(varied) == 0.0
    assert cap.repeated_ngram_rate(looping) > 0.8
    assert cap.repeated_ngram_rate([1, 2, 3]) is None  # shorter than n


@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 5))
def test_repetition_matches_a_direct_count(seq, n):
    got = cap.repeated_ngram_rate(seq, n)
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    if not grams:
        assert got is None
    else:
        assert got == pytest.approx(1 - len(set(grams)) / len(grams))
        assert 0.0 <= got < 1.0
