"""Value types shared by every layer: generation parameters, decoding configuration, results.

Glossary (docs/architecture.md): the *target model* verifies a *draft tree* whose *root* is the last
committed token; each step appends the accepted draft tokens plus one *bonus token*. MAT (mean accepted
tokens) = emitted tokens / steps, where the prefill forward counts as one step that emits one token, so
plain autoregressive decoding has MAT = 1.0 exactly (docs/method.md section 1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

FinishReason = Literal["eos", "stop", "length", "context", "cancelled"]
Scope = Literal["job", "request", "global"]
Acceptance = Literal["lossless", "topk", "threshold"]
RunnerKind = Literal["auto", "eager", "static"]
CompileMode = Literal["auto", "on", "off"]

if TYPE_CHECKING:
    METHODS: tuple[str, ...]  # the registered decoding methods, read through __getattr__ below


# The registry of decoding methods (racer_batch/drafters/registry.py) installs itself here when it is imported:
# the drafters import this module, so this module imports nothing of theirs (no import cycle). The package's
# __init__ imports the registry before anything can build a DecodingConfig.
_methods_registry: Any = None


def install_registry(registry: Any) -> None:
    """Make ``registry`` (a module or object with ``method_names()`` and ``get_method(name)``) the one
    ``DecodingConfig`` validates ``method`` against; drafters/registry.py calls it with itself at import."""
    global _methods_registry
    _methods_registry = registry


def _registry() -> Any:
    if _methods_registry is None:  # racer_batch/__init__.py imports the registry first; this is a guard
        raise RuntimeError("no decoding-method registry is installed (import racer_batch.drafters.registry)")
    return _methods_registry


def __getattr__(name: str) -> Any:
    """``METHODS``: the names of the registered decoding methods, ``("ar", "pld", ..., "graft")`` plus any added
    by ``register_method``, read from the registry each time it is asked."""
    if name == "METHODS":
        return _registry().method_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Bit flags for where a draft node came from (a node proposed by both carries both bits).
SOURCE_RETRIEVAL = 1
SOURCE_LOGITS = 2
SOURCE_PLD = 4
SOURCE_TEMPLATE = 8  # Token Recycling: adjacency expanded through the static tree template
SOURCE_LASTLOGIT = 16  # LogitSpec: top-k of the last verified node's logits (first layer)
SOURCE_NGRAM = 32  # LogitSpec: n-gram lookup in the context
SOURCE_CORPUS = 64  # REST: corpus datastore
SOURCE_SAM = 128  # SAM-Decoding: suffix automaton chain
SOURCE_NAMES = {
    SOURCE_RETRIEVAL: "retrieval", SOURCE_LOGITS: "logits", SOURCE_PLD: "pld", SOURCE_TEMPLATE: "template",
    SOURCE_LASTLOGIT: "lastlogit", SOURCE_NGRAM: "ngram", SOURCE_CORPUS: "corpus", SOURCE_SAM: "sam",
}


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


AUTO_METHOD = "auto"  # decoding.method: the service picks a lossless method per route (auto_methods)


class DecodingConfig(BaseModel):
    """How drafts are made and verified (docs/method.md section 5 defaults)."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(
        "racer", json_schema_extra=lambda schema: schema.update(enum=list(_registry().method_names())),
        description="drafter: a registered decoding method, one of METHODS (racer_batch/drafters/registry.py; the "
        "JSON schema lists them)",
    )
    capacity: Union[int, Literal["auto"]] = Field(
        64, description="draft tree nodes per step including the root (paper default 64), or 'auto'"
    )
    auto_methods: tuple[str, ...] = Field(
        ("racer", "pld", "ar"),
        description="method auto: the lossless methods each route chooses among by measured tokens/s "
        "(service/execution/auto.py); the first also answers every sampled row",
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
    # ---- literature drafters (issue 8); omitted from dumps and hashes while at their defaults ----
    corpus_path: Optional[str] = Field(
        None, min_length=1,
        description="rest / sam: static corpus, a JSONL file (one object per line with 'text' or 'token_ids') "
        "or a plain text file (one document per blank-line-separated block)",
    )
    corpus_max_tokens: int = Field(
        2_000_000, ge=1_000, le=200_000_000, description="rest / sam: corpus tokens kept (the rest is dropped)"
    )
    rest_learn_outputs: bool = Field(
        True, description="rest: add each finished row (prompt + output) of the scope to a dynamic datastore"
    )
    rest_max_query: int = Field(16, ge=1, le=64, description="rest: longest context suffix used as the query")
    rest_min_query: int = Field(2, ge=1, le=64, description="rest: shortest context suffix used as the query")
    rest_max_occurrences: int = Field(
        512, ge=1, le=100_000, description="rest: most corpus occurrences read per query (most recent first)"
    )
    rest_depth: int = Field(8, ge=1, le=64, description="rest: tokens read after each occurrence")
    sam_min_match: int = Field(
        3, ge=1, le=1024, description="sam: shortest suffix-automaton match (tokens) that drafts a chain"
    )
    sam_num_tokens: int = Field(16, ge=1, le=256, description="sam: most chain tokens drafted from a match")
    logitspec_ngram: int = Field(3, ge=1, le=16, description="logitspec: longest n-gram looked up in the context")
    logitspec_branch_tokens: int = Field(
        12, ge=1, le=128, description="logitspec: tokens copied after the rank-0 branch; rank r gets 1/(r+1) of it"
    )
    graft_threshold: float = Field(
        0.05, ge=0.0, le=1.0,
        description="graft: logits-tree nodes whose calibrated path confidence is below this are pruned",
    )
    # ---- acceptance (issue 8, part 6) ----
    acceptance: Acceptance = Field(
        "lossless",
        description="lossless (exact target output) | topk | threshold; relaxed modes change outputs and are "
        "refused by service.job.spec.check_relaxed_allowed unless a shadow run against lossless decoding is configured",
    )
    relaxed_topk: int = Field(2, ge=1, le=64, description="acceptance=topk: accept a draft in the target's top-k")
    relaxed_threshold: float = Field(
        0.1, gt=0.0, le=1.0, description="acceptance=threshold: accept a draft whose target probability >= this"
    )

    # ---- verify runner (issue 12); output-neutral, so omitted from dumps and hashes at their defaults ----
    runner: RunnerKind = Field(
        "auto",
        description="verify forward: static (our decoder, static KV cache, padded tree shapes), eager (the stock "
        "transformers forward) or auto (static where the architecture allows it, else eager)",
    )
    compile: CompileMode = Field(
        "auto",
        description="static runner: CUDA graphs of the verify step, one per (streams, tree) bucket; auto = on "
        "CUDA; the CPU has no compiled step (on: a warning, runs uncompiled) (docs/architecture.md, 'Verify runner')",
    )

    @model_serializer(mode="wrap")
    def _drop_new_defaults(self, handler: Any) -> dict:
        """Leave fields added after the first release out of dumps while they hold their defaults, so the
        config and job-spec hashes of existing configurations stay byte-identical."""
        d = handler(self)
        for name in _OPTIONAL_FIELDS:
            if name in d and getattr(self, name) == type(self).model_fields[name].default:
                del d[name]
        return d

    @field_validator("capacity")
    @classmethod
    def _capacity_range(cls, v: Union[int, str]) -> Union[int, str]:
        if isinstance(v, int) and not 1 <= v <= 1024:
            raise ValueError(f"capacity must be in 1..1024 or 'auto', got {v}")
        return v

    @field_validator("method")
    @classmethod
    def _registered_method(cls, v: str) -> str:
        if v != AUTO_METHOD:
            _registry().get_method(v)  # ValueError naming the registered methods
        return v

    @field_validator("auto_methods", mode="before")
    @classmethod
    def _auto_candidates(cls, v: Any) -> Any:
        """Distinct registered methods, at least one, ``auto`` not among them."""
        names = [v] if isinstance(v, str) else list(v)
        if not names or len(set(names)) != len(names) or AUTO_METHOD in names:
            raise ValueError(f"auto_methods must list distinct registered methods, got {names}")
        for name in names:
            _registry().get_method(name)
        return tuple(names)

    @model_validator(mode="after")
    def _method_accepts_config(self) -> "DecodingConfig":
        """The method's own check (DecodingMethod.check_config): e.g. rest refuses a config with nothing to retrieve
        from. Method auto: every candidate's, and lossless acceptance (a relaxed rule would make a row's output
        depend on which candidate answered it)."""
        if self.method == AUTO_METHOD:
            if self.acceptance != "lossless":
                raise ValueError("method auto needs acceptance lossless: the candidates must all give the same "
                                 "output")
            for name in self.auto_methods:
                self.for_method(name)
            return self
        check = _registry().get_method(self.method).check_config
        if check is not None:
            check(self)
        return self

    def for_method(self, name: str) -> "DecodingConfig":
        """This config with ``method`` set to ``name`` (a candidate of method auto), validated.

        Raises:
            ValueError / pydantic.ValidationError: ``name`` is not registered or refuses these settings."""
        d = self.model_dump(mode="json")
        d["method"] = name
        return type(self).model_validate(d)

    def config_hash(self) -> str:
        """Short stable hash of the configuration, stamped on every output row. ``runner`` and ``compile`` are
        left out: they choose how the same forward is computed, not what is decoded (both runners are tested
        equal to the transformers forward), so rows from either carry the same hash."""
        d = self.model_dump(mode="json")
        for name in _OUTPUT_NEUTRAL_FIELDS:
            d.pop(name, None)
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_OPTIONAL_FIELDS = (
    "auto_methods", "corpus_path", "corpus_max_tokens", "rest_learn_outputs", "rest_max_query", "rest_min_query",
    "rest_max_occurrences", "rest_depth", "sam_min_match", "sam_num_tokens", "logitspec_ngram",
    "logitspec_branch_tokens", "graft_threshold", "acceptance", "relaxed_topk", "relaxed_threshold",
    "runner", "compile",
)
_OUTPUT_NEUTRAL_FIELDS = ("runner", "compile")


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
    """Per-row decoding statistics. Counters count emitted tokens only (docs/method.md 9.12)."""

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


def weights_conflict(name: str, dtype: Optional[str], weights: Optional[str]) -> Optional[str]:
    """Why ``weights`` cannot go with the other model settings on any machine (None: no conflict), for what checks
    settings before loading (the job spec, the CLI): as_stored runs in float32 only, and ``tiny-random`` has no
    stored blocks. What depends on the machine (our kernels, a GGUF file) is ``models.load_model``'s to say."""
    if weights != "as_stored":
        return None
    if dtype in ("bfloat16", "float16"):
        return (f"weights 'as_stored' runs in float32 on our CPU kernels, not in {dtype}: use weights 'float32' (or "
                "leave it unset) with a reduced dtype")
    if name == "tiny-random":
        return "weights 'as_stored': model 'tiny-random' is a random float32 model with no stored blocks"
    return None
