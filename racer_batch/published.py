"""Published figures to print beside our benchmark numbers (facts, cited; no text copied).

Source: the RACER paper's comparison (Zhang et al., ACL 2026 Findings, arXiv 2604.14885) as summarised in
``docs/method.md`` section 6: target Vicuna-7B on a GPU, greedy, MAT = accepted drafts + 1 per
target forward, speedup = wall-time ratio against the paper's own autoregressive baseline. Only figures
stated there are listed; a method without a row has no published figure (LogitSpec, REST, SAM-Decoding and
Graft are not in that table). benchmarks/PUBLISHED.md lists the same figures with the other published rows
(other target models and hardware).
"""

from __future__ import annotations

SOURCE = "RACER paper (arXiv 2604.14885), Vicuna-7B on a GPU, via docs/method.md section 6"

# set -> paper row -> (MAT, speedup)
PUBLISHED: dict[str, dict[str, tuple[float, float]]] = {
    "spec_bench": {"ar": (1.00, 1.00), "pld": (1.71, 1.50), "tr": (2.76, 2.06), "retrieval": (1.59, 1.43),
                   "logits": (2.72, 2.01), "racer": (3.00, 2.21)},
    "human_eval": {"ar": (1.00, 1.00), "pld": (1.58, 1.40), "tr": (2.83, 2.17), "retrieval": (1.67, 1.52),
                   "logits": (2.68, 2.04), "racer": (3.11, 2.29)},
    "mgsm_zh": {"ar": (1.00, 1.00), "pld": (2.57, 2.27), "tr": (3.00, 2.30), "retrieval": (2.39, 2.11),
                "logits": (2.95, 2.23), "racer": (3.71, 2.77)},
}
SET_TITLES = {"spec_bench": "Spec-Bench", "human_eval": "HumanEval", "mgsm_zh": "MGSM-ZH"}

# our method / bench label -> the paper's row it corresponds to
PAPER_ROW = {"ar": "ar", "hf_greedy": "ar", "pld": "pld", "hf_pld": "pld", "tr": "tr",
             "retrieval": "retrieval", "logits": "logits", "racer": "racer"}


def published(set_name: str, label: str) -> tuple[float, float] | None:
    """(MAT, speedup) the paper reports for our method ``label`` on ``set_name``; None when it reports none.

    >>> published("mgsm_zh", "racer"), published("spec_bench", "hf_pld"), published("human_eval", "sam")
    ((3.71, 2.77), (1.71, 1.5), None)
    """
    row = PAPER_ROW.get(label)
    return PUBLISHED.get(set_name, {}).get(row) if row else None
