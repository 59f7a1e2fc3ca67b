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


class PromptLookupIndex:
    """``prompt_lookup`` over a growing context in O(max_ngram) dictionary reads per lookup, not a scan.

    For each n in 1..max_ngram it maps every n-gram that ends before the context's last token to its most recent
    start, which is what ``prompt_lookup`` finds by scanning backwards (an occurrence ending at the last token
    is the suffix itself). ``extend`` adds the n-grams that the new tokens complete; memory is
    O(len(context) x max_ngram) entries per row. Equal to ``prompt_lookup`` on every context
    (tests/unit/test_pld_index.py holds it to the scan on random and repetitive token streams).
    """

    def __init__(self, max_ngram: int) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.context: list[int] = []
        self._last: list[dict] = [{} for _ in range(max_ngram + 1)]  # [n]: n-gram -> most recent start

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the context."""
        ctx = self.context
        old = len(ctx)
        ctx.extend(int(t) for t in tokens)
        # n-grams ending at positions old - 1 .. len - 2 (those now before the last token) become findable; in
        # start order, so a later start overwrites an earlier one
        last_end = len(ctx) - 2
        if last_end - old < 8:  # a decode step's few tokens: one n-gram at a time
            for end in range(max(old - 1, 0), last_end + 1):
                for n in range(1, min(self.max_ngram, end + 1) + 1):
                    self._last[n][tuple(ctx[end - n + 1: end + 1])] = end - n + 1
            return
        for n in range(1, self.max_ngram + 1):
            first = max(old - 1, n - 1) - n + 1  # first new start
            stop = last_end - n + 2  # one past the last start
            if stop > first:
                grams = zip(*(ctx[first + i: stop + i] for i in range(n)))
                self._last[n].update(zip(grams, range(first, stop)))

    def lookup(self, *, num_tokens: int, min_ngram: int = 1) -> list[int]:
        """``prompt_lookup(self.context, max_ngram=self.max_ngram, num_tokens=num_tokens, min_ngram=min_ngram)``."""
        ctx = self.context
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), min_ngram - 1, -1):
            start = self._last[n].get(tuple(ctx[n_ctx - n:]))
            if start is not None:
                follow = ctx[start + n: start + n + num_tokens]
                if follow:
                    return follow
        return []
