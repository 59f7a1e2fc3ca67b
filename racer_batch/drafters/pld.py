"""Prompt lookup decoding (PLD): copy the tokens that followed the last match of the context's suffix."""

from __future__ import annotations

from typing import Sequence


def prompt_lookup(context: Sequence[int], *, max_ngram: int, num_tokens: int, min_ngram: int = 1) -> list[int]:
    """Continuation of the longest suffix n-gram of ``context`` found earlier in it (a chain draft).

    Tries n = max_ngram down to min_ngram; for the first n whose suffix occurs earlier, takes the most
    recent earlier occurrence and returns up to ``num_tokens`` tokens that followed it.

    Example: context [1, 2, 3, 9, 1, 2], max_ngram 3: the suffix [1, 2] occurs at position 0, followed
    by [3, 9, 1, 2]; with num_tokens 2 the result is [3, 9].
    """
    n_ctx = len(context)
    ctx = list(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = ctx[n_ctx - n :]
        # search backwards for the most recent earlier occurrence (not the suffix itself)
        for start in range(n_ctx - n - 1, -1, -1):
            if ctx[start : start + n] == suffix:
                follow = ctx[start + n : start + n + num_tokens]
                if follow:
                    return follow
    return []
