"""``PromptLookupIndex`` (drafters/pld.py) against ``prompt_lookup``'s backward scan, its oracle."""

from __future__ import annotations

import random

import pytest

from racer_batch.drafters.pld import PromptLookupIndex, prompt_lookup


@pytest.mark.parametrize("vocab", [2, 5, 50, 5000])
@pytest.mark.parametrize("max_ngram", [1, 3, 5])
def test_the_index_finds_what_the_scan_finds_as_the_context_grows(vocab, max_ngram):
    rng = random.Random(vocab * 31 + max_ngram)
    for _ in range(20):
        index = PromptLookupIndex(max_ngram)
        ctx: list[int] = []
        first = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        index.extend(first)
        ctx.extend(first)
        for _ in range(30):
            for num in (1, 3, 8):
                for lo in (1, 2):
                    assert index.lookup(num_tokens=num, min_ngram=lo) == \
                        prompt_lookup(ctx, max_ngram=max_ngram, num_tokens=num, min_ngram=lo), (ctx, num, lo)
            # a step commits 1-4 tokens, sometimes a copy of an earlier stretch (what PLD drafts)
            if ctx and rng.random() < 0.3:
                s = rng.randrange(len(ctx))
                more = ctx[s: s + rng.randrange(1, 5)]
            else:
                more = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
            index.extend(more)
            ctx.extend(more)
        assert index.context == ctx


def test_small_contexts_and_bad_arguments():
    index = PromptLookupIndex(3)
    assert index.lookup(num_tokens=4) == [] == prompt_lookup([], max_ngram=3, num_tokens=4)
    index.extend([7])
    assert index.lookup(num_tokens=4) == [] == prompt_lookup([7], max_ngram=3, num_tokens=4)
    index.extend([7])
    assert index.lookup(num_tokens=4) == [7] == prompt_lookup([7, 7], max_ngram=3, num_tokens=4)
    with pytest.raises(ValueError):
        PromptLookupIndex(0)
