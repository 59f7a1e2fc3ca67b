"""Capability measures for comparing decoding setups that may change outputs (relaxed acceptance, issue 8).

Lossless methods must reproduce the target model's output exactly, so for them exact match is the whole
story. Relaxed acceptance (Xia, Ribar and Balanca, 2026; docs/method.md section 6) trades some of that for speed, so
beside the speed gain a comparison reports:

- exact match against the lossless answer (``first_divergence`` in report/shadow.py);
- answer accuracy where the data carries a reference that can be scored automatically: a numeric answer
  (MGSM-ZH answers, GSM8K-style ``#### 42`` references of Spec-Bench math_reasoning), compared with the last
  number of the output; or a short answer (at most ``SHORT_ANSWER_WORDS`` words), counted correct when it
  appears in the output after case and whitespace folding. Longer references (translations, summaries,
  sample programs) would need a learned or n-gram metric and are not scored (``None``);
- length: output tokens (and characters);
- repetition: the share of repeated n-grams, ``1 - distinct / total`` over the output's n-grams, which grows
  when decoding falls into loops (a known failure of over-eager acceptance).
"""

from __future__ import annotations

import math
import re
from typing import Hashable, Iterable, Optional, Sequence

SHORT_ANSWER_WORDS = 8
REPEAT_N = 4

# A number: optional sign, digits with optional thousands commas, optional decimals; or a bare decimal.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
# Text units for repetition on plain text: one CJK character, a run of other word characters, or a symbol.
_UNIT = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"
                   r"|[^\W\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+|[^\w\s]")


def parse_number(text: str) -> Optional[float]:
    """The value of ``text`` when it is one number (thousands commas, ``$`` and ``%`` allowed), else None.

    >>> parse_number("70,000"), parse_number(" $18 "), parse_number("12 apples")
    (70000.0, 18.0, None)
    """
    s = text.strip().strip("$%").strip()
    m = _NUMBER.fullmatch(s)
    return float(m.group(0).replace(",", "")) if m else None


def last_number(text: str) -> Optional[float]:
    """The last number written in ``text`` (thousands commas removed), or None.

    >>> last_number("3 + 4 = 7, so she earns $18.")
    18.0
    >>> last_number("no digits") is None
    True
    """
    found = _NUMBER.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def reference_answer(reference: str) -> str:
    """The final answer of a reference: the part after ``####`` in GSM8K-style worked solutions, else all of it.

    >>> reference_answer("400*.5=200\\n#### 1,000")
    '1,000'
    """
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    return reference.strip()


def _fold(text: str) -> str:
    return " ".join(text.casefold().split())


def answer_correct(output: str, reference: Optional[str]) -> Optional[bool]:
    """Whether ``output`` gives the reference answer; None when the reference cannot be scored automatically.

    Numeric reference (after ``reference_answer``): the output's last number equals it (absolute tolerance
    1e-6 after removing thousands commas). Short text reference (<= SHORT_ANSWER_WORDS words): it occurs in
    the output, case and whitespace folded. Empty, missing or longer references: None.

    >>> answer_correct("She makes 9 * 2 = 18 dollars.", "18")
    True
    >>> answer_correct("The answer is 17.", "#### 18")
    False
    >>> answer_correct("Then you are in second place now.", "You are in second place.")
    True
    >>> answer_correct("A long essay.", "word " * 20) is None
    True
    """
    if reference is None:
        return None
    ans = reference_answer(str(reference))
    if not ans:
        return None
    value = parse_number(ans)
    if value is not None:
        got = last_number(output)
        return got is not None and math.isclose(got, value, rel_tol=0.0, abs_tol=1e-6)
    folded = _fold(ans).rstrip(".")
    if not folded or len(folded.split()) > SHORT_ANSWER_WORDS:
        return None
    return folded in _fold(output)


def text_units(text: str) -> list[str]:
    """Units for repetition statistics on text: CJK characters one by one, other words whole, symbols alone.

    >>> text_units("Hi, 你好 world!")
    ['Hi', ',', '你', '好', 'world', '!']
    """
    return _UNIT.findall(text)


def repeated_ngram_rate(seq: Sequence[Hashable], n: int = REPEAT_N) -> Optional[float]:
    """``1 - distinct / total`` over the n-grams of ``seq``; None when ``seq`` has fewer than ``n`` items.

    0.0 means no n-gram repeats; a sequence that loops one n-gram forever tends to 1.

    >>> repeated_ngram_rate([1, 2, 3, 4, 5], n=2)
    0.0
    >>> repeated_ngram_rate([1, 2, 1, 2, 1, 2], n=2)  # 5 bigrams, 2 distinct
    0.6
    """
    assert n >= 1, f"n must be >= 1, got {n}"
    total = len(seq) - n + 1
    if total <= 0:
        return None
    grams = {tuple(seq[i : i + n]) for i in range(total)}
    return round(1.0 - len(grams) / total, 12)


def mean(values: Iterable[Optional[float]]) -> Optional[float]:
    """Mean of the values that are not None; None when there are none."""
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def accuracy(results: Iterable[Optional[bool]]) -> tuple[int, int]:
    """(correct, scored) over answer_correct results, skipping the unscored (None) ones."""
    scored = [r for r in results if r is not None]
    return sum(bool(r) for r in scored), len(scored)
