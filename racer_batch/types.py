"""Value types shared by every layer: generation parameters, decoding configuration, results.

Glossary (docs/architecture.md): the *target model* verifies a *draft tree* whose *root* is the last
committed token; each step appends the accepted draft tokens plus one *bonus token*. MAT (mean accepted
tokens) = emitted tokens / steps, where the prefill forward counts as one step that emits one token, so
plain autoregressive decoding has MAT = 1.0 exactly (RACER.md section 1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

FinishReason = Literal["eos", "stop", "length", "context", "cancelled"]
Method = Literal["ar", "pld", "logits", "retrieval", "racer"]
Scope = Literal["job", "request", "global"]

METHODS: tuple[str, ...] = ("ar", "pld", "logits", "retrieval", "racer")

# Bit flags for where a draft node came from (a node proposed by both carries both bits).
SOURCE_RETRIEVAL = 1
SOURCE_LOGITS = 2
SOURCE_PLD = 4
SOURCE_NAMES = {SOURCE_RETRIEVAL: "retrieval", SOURCE_LOGITS: "logits", SOURCE_PLD: "pld"}


class GenerationParams(BaseModel):
    """Per-request sampling and stopping parameters.

    ``temperature == 0`` means greedy decoding. Stop strings are matched on the decoded output text,
    also when they span several tokens; the returned text is cut *before* the stop string (the stop
    string itself is not kept), while ``token_ids`` keep every token up to and including the one that
    completed it.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(256, ge=1, le=1_000_000, description="cap on emitted tokens")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept (1.0 = off)")
    top_k: int = Field(0, ge=0, le=1_000_000, description="keep the k most likely tokens (0 = off)")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="seed of the per-call sampling generator")
    stop: list[str] = Field(default_factory=list, description="stop strings (cut from the text)")
    extra_eos_ids: list[int] = Field(default_factory=list, description="token ids that also end generation")

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        for s in v:
            if not s:
                raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class DecodingConfig(BaseModel):
    """How drafts are made and verified (RACER.md section 5 defaults)."""

    model_config = ConfigDict(extra="forbid")

    method: Method = Field("racer", description="drafter: ar | pld | logits | retrieval | racer")
    capacity: Union[int, Literal["auto"]] = Field(
        64, description="draft tree nodes per step including the root (paper default 64), or 'auto'"
    )
    max_breadth: int = Field(8, ge=1, le=64, description="copy-logit store width k and logits-tree root breadth")
    max_nodes: int = Field(10_000, ge=16, le=10_000_000, description="automaton node pool size")
    ngram: int = Field(10, ge=2, le=64, description="automaton n-gram depth")
    min_border_depth: int = Field(2, ge=1, le=64, description="shallowest automaton match used as a border")
    scope: Scope = Field("job", description="draft state scope: job | request | global")
    pld_max_ngram: int = Field(3, ge=1, le=16, description="PLD: longest suffix n-gram to match")
    pld_num_tokens: int = Field(10, ge=1, le=128, description="PLD: tokens copied after the match")
    auto_capacities: list[int] = Field(
        default_factory=lambda: [4, 8, 12, 16, 24, 32, 48, 64],
        description="capacities the 'auto' tuner may choose from",
    )

    @field_validator("capacity")
    @classmethod
    def _capacity_range(cls, v: Union[int, str]) -> Union[int, str]:
        if isinstance(v, int) and not 1 <= v <= 1024:
            raise ValueError(f"capacity must be in 1..1024 or 'auto', got {v}")
        return v

    def config_hash(self) -> str:
        """Short stable hash of the configuration, stamped on every output row."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class StepRecord:
    """One verification step (the prefill forward is step 0 with tree_size 1)."""

    tree_size: int
    accepted_length: int  # draft tokens accepted (emitted), excluding the bonus
    emitted: int  # tokens appended to the output by this step (<= accepted_length + 1 after stops)
    accepted_retrieval: int  # accepted draft tokens proposed by retrieval only
    accepted_logits: int  # ... by the logits tree only
    accepted_both: int  # ... by both
    accepted_other: int  # ... by another drafter (pld)
    draft_ms: float
    verify_ms: float
    update_ms: float


@dataclass
class RowStats:
    """Per-row decoding statistics. Counters count emitted tokens only (RACER.md 9.12)."""

    steps: int = 0
    emitted_tokens: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)  # accepted draft length -> steps
    accepted_retrieval: int = 0
    accepted_logits: int = 0
    accepted_both: int = 0
    accepted_other: int = 0
    tree_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    update_ms: float = 0.0
    capacity: int = 1
    keep_steps: bool = False
    step_records: list[StepRecord] = field(default_factory=list)

    def observe_step(self, rec: StepRecord) -> None:
        self.steps += 1
        self.emitted_tokens += rec.emitted
        self.accepted_hist[rec.accepted_length] = self.accepted_hist.get(rec.accepted_length, 0) + 1
        self.accepted_retrieval += rec.accepted_retrieval
        self.accepted_logits += rec.accepted_logits
        self.accepted_both += rec.accepted_both
        self.accepted_other += rec.accepted_other
        self.tree_tokens += rec.tree_size
        self.draft_ms += rec.draft_ms
        self.verify_ms += rec.verify_ms
        self.update_ms += rec.update_ms
        if self.keep_steps:
            self.step_records.append(rec)

    @property
    def mat(self) -> float:
        """Mean accepted tokens: emitted tokens per step (1.0 for autoregressive decoding)."""
        return self.emitted_tokens / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("step_records")
        d.pop("keep_steps")
        d["mat"] = self.mat
        d["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        return d


@dataclass
class GenerationResult:
    """Output of one generation call.

    ``token_ids`` are the emitted tokens (an EOS token that ended generation is included; stop-string
    tokens are included), ``text`` the decoded answer (EOS and the stop string removed).
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    prefill_ms: float
    decode_ms: float
    stats: RowStats = field(default_factory=RowStats)

    @property
    def tokens_per_s(self) -> float:
        total_ms = self.prefill_ms + self.decode_ms
        return self.output_tokens / (total_ms / 1000.0) if total_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "tokens_per_s": self.tokens_per_s,
            "stats": self.stats.to_dict(),
        }
