"""Greedy equality under reduced precision: where two greedy outputs part, and whether that is numerics.

On CUDA the target model runs in bfloat16 (or float16). The speculative path scores a token inside a
T-token tree forward and plain decoding scores it alone; the two reductions round differently, so when the
target's top two logits nearly tie the argmax can flip, and from there the texts differ. Exact equality is
then the wrong test. Compare the common prefix instead, and at the first difference ask the target how far
apart the two tokens are: a gap within the dtype's rounding is a numerical tie, a large gap is a bug.

Example::

    div = first_divergence([5, 7, 9, 2], [5, 7, 4])
    div.common_prefix, div.token_a, div.token_b      # (2, 9, 4)
    div = compare_greedy(bundle, prompt_ids, ref_ids, spec_ids)
    div.describe()  # "diverge after 2 of 4/3 tokens: 9 vs 4, logit gap 0.031 (bfloat16 tie tolerance 0.5)"
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

# Logit gaps under which a flipped argmax is taken as rounding, per model dtype. Rules of thumb: bfloat16
# keeps 8 significand bits (relative step 2**-8 ~ 0.004), so logits of magnitude 10..30 round in steps of
# 0.04..0.12 and a 30-layer forward accumulates several of them; float16 keeps 11 bits.
TIE_TOLERANCE = {"bfloat16": 0.5, "float16": 0.1, "float32": 1e-3}


@dataclass(frozen=True)
class Divergence:
    """Where two token sequences part. ``token_a``/``token_b`` are None where a sequence ended first."""

    common_prefix: int  # tokens equal from the start
    len_a: int
    len_b: int
    token_a: Optional[int] = None
    token_b: Optional[int] = None
    logit_gap: Optional[float] = None  # target logit of token_a minus token_b after the common prefix
    dtype: Optional[str] = None  # dtype of the forward that measured logit_gap

    @property
    def identical(self) -> bool:
        return self.len_a == self.len_b == self.common_prefix

    @property
    def is_tie(self) -> Optional[bool]:
        """True when the gap is within the dtype's tie tolerance; None when no gap was measured."""
        if self.logit_gap is None or self.dtype is None:
            return None
        return abs(self.logit_gap) <= TIE_TOLERANCE.get(self.dtype, 1e-3)

    def describe(self) -> str:
        if self.identical:
            return f"identical ({self.len_a} tokens)"
        head = (f"diverge after {self.common_prefix} of {self.len_a}/{self.len_b} tokens: "
                f"{self.token_a} vs {self.token_b}")
        if self.logit_gap is None:
            return head
        tol = TIE_TOLERANCE.get(self.dtype or "", 1e-3)
        return f"{head}, logit gap {self.logit_gap:.3g} ({self.dtype} tie tolerance {tol})"


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Divergence:
    """The first index where ``a`` and ``b`` differ (pure).

    >>> first_divergence([5, 7, 9, 2], [5, 7, 4])
    Divergence(common_prefix=2, len_a=4, len_b=3, token_a=9, token_b=4, logit_gap=None, dtype=None)
    >>> first_divergence([1, 2], [1, 2, 3]).token_a is None
    True
    """
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    ta = int(a[n]) if n < len(a) else None
    tb = int(b[n]) if n < len(b) else None
    return Divergence(common_prefix=n, len_a=len(a), len_b=len(b), token_a=ta, token_b=tb)


@torch.inference_mode()
def compare_greedy(bundle: Any, prompt_ids: Sequence[int], a: Sequence[int], b: Sequence[int]) -> Divergence:
    """``first_divergence`` plus the target's logit gap between the two tokens where the outputs part.

    One plain forward (no cache, no tree) over ``prompt_ids + a[:common_prefix]`` in the model's own dtype;
    the gap is read from the last position's logits ``[V]``. Both outputs must be greedy continuations of
    ``prompt_ids`` by the model in ``bundle`` (a ``ModelBundle``).
    """
    div = first_divergence(a, b)
    if div.identical or div.token_a is None or div.token_b is None:
        return div
    from ..models import hf_model

    model = hf_model(bundle)
    ids = torch.tensor([list(prompt_ids) + list(a[: div.common_prefix])], device=model.device)  # [1, L]
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()  # [V]
    gap = float(logits[div.token_a] - logits[div.token_b])
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return replace(div, logit_gap=gap, dtype=dtype)
