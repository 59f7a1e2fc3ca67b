"""Exact stopping rules shared by the reference and the speculative engine (docs/method.md section 4, 9.11)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..values import FinishReason


class StopChecker:
    """Feeds emitted tokens one at a time and says when and why generation ends.

    Rules, checked after every token in this order: an EOS id (any of the model's, plus extra ids) ->
    ``eos``; a stop string completed in the decoded output, also across token boundaries -> ``stop``;
    ``max_new_tokens`` reached -> ``length``; the sequence (prompt + output) filled the model's context ->
    ``context``. The token that triggers a rule is kept in ``token_ids``; the final text drops EOS tokens
    and everything from the first stop string on.
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        eos_ids: Sequence[int],
        stop: Sequence[str],
        max_new_tokens: int,
        prompt_tokens: int,
        context_length: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(int(e) for e in eos_ids)
        self.stop = [s for s in stop if s]
        self.max_new_tokens = max_new_tokens
        self.room = context_length - prompt_tokens  # tokens that fit before the context is full
        self.tokens: list[int] = []
        self.finish: FinishReason | None = None
        self._stop_window = max((len(s) for s in self.stop), default=0) + 8
        self.stop_at_char: int | None = None
        # the EOS ids as one int64 row [1, E], ascending: a native commit checks them by id (engine/step.py)
        self.eos_row = np.array([sorted(self.eos)], dtype=np.int64).reshape(1, -1)
        self._check_here = 0 if self.stop else 1

    @property
    def remaining(self) -> int:
        """How many more tokens may be emitted under the length and context caps."""
        return max(0, min(self.max_new_tokens, self.room) - len(self.tokens))

    def push(self, token: int) -> bool:
        """Append one emitted token; True when generation must end (``finish`` says why)."""
        assert self.finish is None, "push after finish"
        self.tokens.append(int(token))
        if token in self.eos:
            self.finish = "eos"
        elif self.stop and self._stop_completed():
            self.finish = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish = "length"
        elif len(self.tokens) >= self.room:
            self.finish = "context"
        return self.finish is not None

    def push_many(self, tokens: Sequence[int]) -> int:
        """Push ``tokens`` in order until one ends generation; returns how many were taken (``finish`` is set
        when generation ended). Text is decoded only when the checker has stop strings."""
        for i, tok in enumerate(tokens):
            if self.push(tok):
                return i + 1
        return len(tokens)

    def limits(self) -> tuple[int, int, int]:
        """``(tokens left under max_new_tokens, tokens left under the context, 1 where every rule is checkable by
        token id (no stop strings) else 0)``: a row of ``commit_greedy_batch``'s ``limits``."""
        n = len(self.tokens)
        return self.max_new_tokens - n, self.room - n, self._check_here

    def commit_checked(self, tokens: Sequence[int], finish: FinishReason | None) -> None:
        """Append ``tokens`` already checked by id elsewhere (``drafters.native.commit_greedy_batch``: the EOS
        ids, ``max_new_tokens`` and the context, in ``push``'s order) and set ``finish`` as ``push`` would have
        after the last of them. Only for a checker without stop strings (those need the decoded text).

        Raises:
            ValueError: the checker has stop strings, or already finished."""
        self._checkable("commit_checked")
        self.tokens.extend(tokens)
        self.finish = finish

    def end_checked(self, finish: FinishReason) -> None:
        """Set ``finish`` where the tokens ending generation were appended to ``tokens`` elsewhere, already checked
        by id (``drafters.native.step_context`` with this checker's list appends a step's emitted tokens itself).

        Raises:
            ValueError: the checker has stop strings, or already finished."""
        self._checkable("end_checked")
        self.finish = finish

    def _checkable(self, what: str) -> None:
        if self.stop or self.finish is not None:
            raise ValueError(f"{what} needs a checker without stop strings that has not finished")

    def _stop_completed(self) -> bool:
        # Cheap check on the tail first (a stop string of m characters spans at most m tokens that each
        # decode to at least one character; the margin covers byte-fallback pieces), then the exact cut.
        tail = self.tokenizer.decode(self.tokens[-self._stop_window :], skip_special_tokens=False)
        if not any(s in tail for s in self.stop):
            return False
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=False)
        hits = [text.find(s) for s in self.stop if s in text]
        if not hits:
            return False
        self.stop_at_char = min(hits)
        return True

    def text(self) -> str:
        """The answer: special tokens dropped; cut before the first stop string when one ended generation."""
        if self.finish == "stop" and self.stop_at_char is not None:
            raw = self.tokenizer.decode(self.tokens, skip_special_tokens=False)[: self.stop_at_char]
            # re-decode without special tokens: drop special-token text that precedes the cut
            specials = [t for t in getattr(self.tokenizer, "all_special_tokens", []) if t]
            for s in specials:
                raw = raw.replace(s, "")
            return raw
        ids = [t for t in self.tokens if t not in self.eos]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
