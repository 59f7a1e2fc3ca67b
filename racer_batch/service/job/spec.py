"""Job specification: the YAML a user submits, validated with pydantic (unknown keys rejected).

Precedence, lowest first: field defaults < preset file (``preset:``) < the job file < overrides from
``submit`` flags. Paths in a job file are relative to that file's folder; paths given as overrides are
relative to the current directory. Example::

    input: {path: demo_prompts.jsonl}
    output: {path: ../out/demo, shard_rows: 8}
    model: {name: smollm2-135m}
    preset: racer-cpu            # racer_batch/presets/racer-cpu.yaml supplies decoding settings
    generation: {max_new_tokens: 96}
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from racer_batch.values import DecodingConfig, GenerationParams, weights_conflict

PACKAGE_PRESETS = Path(__file__).resolve().parents[2] / "presets"  # racer_batch/presets: shipped with the package
PRESET_DIRS_ENV = "RACER_BATCH_PRESETS"  # extra folders searched for presets, os.pathsep separated


class SpecError(ValueError):
    """A job spec that cannot be used; the message names the key and the offending value."""


class ColumnMap(BaseModel):
    """Which input column holds each canonical field (missing optional columns are simply absent)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field("id", description="unique row id column (string or integer)")
    prompt: str = Field("prompt", description="single prompt column (string)")
    messages: str = Field("messages", description="chat messages column (list of {role, content})")
    turns: str = Field("turns", description="multi-turn column (list of user turns)")
    route: str = Field("route", description="route label column (string)")
    max_new_tokens: str = Field("max_new_tokens", description="per-row max_new_tokens column")
    temperature: str = Field("temperature", description="per-row temperature column")
    top_p: str = Field("top_p", description="per-row top_p column")
    seed: str = Field("seed", description="per-row seed column")
    stop: str = Field("stop", description="per-row stop strings column (string or list of strings)")
    reference: str = Field(
        "reference", description="optional reference answer column (string, or list of strings: one per turn); "
        "never changes generation, only scored in shadow comparisons (report/shadow.py)"
    )


class InputSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1, description="a Parquet/JSONL file, a folder of them, or a glob")
    format: Literal["auto", "parquet", "jsonl"] = Field("auto", description="file format (auto: by extension)")
    columns: ColumnMap = Field(default_factory=ColumnMap, description="input column mapping")
    prompt_format: Literal["auto", "chat", "raw"] = Field(
        "auto", description="auto: chat where the model has a chat template, else raw (a base model); chat: a "
        "`prompt` becomes one user message under the chat template; raw: plain text"
    )


class OutputSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1, description="output folder (part files + manifest.json)")
    shard_rows: int = Field(64, ge=1, le=1_000_000, description="input rows per shard / part file")


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("smollm2-135m", min_length=1,
                      description="model name, .gguf file, local folder or hub id (see load_model)")
    trust_remote_code: bool = Field(False, description="allow model code from the model folder (worker must allow)")
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(
        None, description="weights' precision; None = float32 on the CPU, bfloat16 on CUDA. Reduced precision changes "
        "outputs: equal to greedy decoding of the same reduced model only up to numerical ties")
    weights: Optional[Literal["as_stored", "float32"]] = Field(
        None, description="a GGUF model's weights: as_stored (kept in the file's quantised blocks, expanded inside "
        "the CPU kernels; bit-identical outputs, a fifth of float32's weight bytes), float32 (de-quantised once), "
        "or None = as_stored where it runs, else float32 (racer_batch.models.load_model). Never changes the output "
        "rows")

    @model_validator(mode="after")
    def _weights_fit(self) -> "ModelSpec":
        """The combinations load_model would refuse on any worker, refused when the spec is read instead of when
        a worker loads the model (a queued job would fail only then)."""
        why = weights_conflict(self.name, self.dtype, self.weights)
        if why is not None:
            raise ValueError(f"model.{why}")
        return self


class GenerationDefaults(BaseModel):
    """Defaults for every row; per-row columns override max_new_tokens, temperature, top_p, seed, stop."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(256, ge=1, le=1_000_000, description="cap on emitted tokens per turn")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, le=1_000_000, description="top-k filter (0 = off)")
    stop: list[str] = Field(default_factory=list, description="stop strings")
    system_prompt: Optional[str] = Field(None, description="system message put first in chat rows (None = none)")


# Resources field -> (lowest, highest) allowed number; the field may also be "auto"
_RESOURCE_RANGES = {"num_actors": (1, 4096), "torch_threads": (1, 512), "gpus_per_actor": (0, 16),
                    "streams_per_actor": (1, 64)}
AUTO_STREAMS = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes ``streams_per_actor: auto`` chooses from on a GPU
# ... and on a CPU, where a verify forward is compute-bound past ~12-16 rows (benchmarks/throughput-*.md), so more
# streams only hold KV-cache slots (94 MB each for SmolLM2-135M at 2,048 positions)
AUTO_STREAMS_CPU = (1, 2, 4, 8, 16)


def auto_streams(device: object) -> tuple[int, ...]:
    """The batch sizes ``streams_per_actor: auto`` chooses from on ``device`` (a torch device or its name)."""
    return AUTO_STREAMS if str(device).startswith("cuda") else AUTO_STREAMS_CPU


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_actors: Union[int, Literal["auto"]] = Field(
        "auto", description="generation actors (auto: one per GPU, else one)"
    )
    cpus_per_actor: float = Field(0, ge=0, le=512, description="CPUs per actor (0 = all CPUs / actors)")
    gpus_per_actor: Union[float, Literal["auto"]] = Field(
        "auto", description="GPUs per actor (auto: 1 when the cluster has GPUs, else 0)"
    )

    torch_threads: Union[int, Literal["auto"]] = Field(
        "auto", description="intra-op torch threads per actor (auto: 1; more actors beat more threads for small models)"
    )
    streams_per_actor: Union[int, Literal["auto"]] = Field(
        1, description="rows an actor decodes at once, their draft trees verified in one forward (1..64; auto: "
        "the engine's measured best of 1, 2, 4, 8, 16 (on a GPU also 32, 64), at most the shard's rows). "
        "Outputs do not depend on it; each "
        "stream holds a KV-cache slot of its own"
    )
    warm_draft_state: bool = Field(
        True, description="save the job's learned draft state (automaton and copy-logit store, scope job) with "
        "each shard's commit, next to the output, and start every later shard, on any actor, and a resumed run "
        "from the latest saved one (docs/method.md 7.1). Outputs do not depend on it"
    )

    @field_validator("streams_per_actor", mode="before")
    @classmethod
    def _streams_value(cls, v: Any) -> Any:
        """An int 1..64 or ``auto`` (any case); a bool, a float or other text is refused in one clear line."""
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        if isinstance(v, str) and v.strip().isdigit():  # a quoted number, as an override or YAML may give it
            return int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"streams_per_actor must be an integer 1..64 or 'auto', got {v!r}")
        return v

    @field_validator("torch_threads", "num_actors", "gpus_per_actor", "streams_per_actor")
    @classmethod
    def _in_range_or_auto(cls, v: Union[int, float, str], info: ValidationInfo) -> Union[int, float, str]:
        lo, hi = _RESOURCE_RANGES[info.field_name]
        if not isinstance(v, str) and not lo <= v <= hi:
            raise ValueError(f"{info.field_name} must be in {lo}..{hi} or 'auto', got {v}")
        return v


class ShadowSpec(BaseModel):
    """Run a deterministic sample of rows a second time with a baseline decoding config (service/results/shadow.py).

    ``config`` is a preset name (only its ``decoding`` section is used: prompts and generation settings stay
    the job's) or an inline decoding config; ``load_spec`` resolves a preset name to the inline config.
    """

    model_config = ConfigDict(extra="forbid")

    config: Union[DecodingConfig, str] = Field(..., description="baseline: preset name or inline decoding config")
    name: Optional[str] = Field(None, max_length=200, description="label in reports (default: the preset name)")
    fraction: float = Field(0.05, gt=0.0, le=1.0, description="share of rows sampled (hash of seed and row id)")
    seed: int = Field(0, ge=0, le=2**62, description="sampling seed")

    def decoding(self) -> DecodingConfig:
        assert isinstance(self.config, DecodingConfig), (
            f"shadow.config = {self.config!r} was not resolved to a decoding config (use load_spec)"
        )
        return self.config

    @property
    def label(self) -> str:
        return self.name or (self.config if isinstance(self.config, str) else self.config.method)


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = Field(None, max_length=200, description="free label shown by `list`")
    preset: Optional[str] = Field(None, description="preset name or file merged under this spec (informational)")
    input: InputSpec
    output: OutputSpec
    model: ModelSpec = Field(default_factory=ModelSpec)
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    generation: GenerationDefaults = Field(default_factory=GenerationDefaults)
    route: str = Field("default", min_length=1, max_length=200, description="route of rows without one")
    resources: Resources = Field(default_factory=Resources)
    priority: int = Field(5, ge=0, le=9, description="queue priority, 9 = first")
    seed: int = Field(0, ge=0, le=2**62, description="job seed; a row's seed = row seed or job seed + row index")
    redis_url: Optional[str] = Field(None, description="Redis URL (else flag, else REDIS_URL); never stored")
    n_samples: int = Field(1, ge=1, le=1024, description="answers per prompt, each with its own recorded seed")
    shadow: Optional[ShadowSpec] = Field(None, description="baseline runs on a sample of rows (see ShadowSpec)")

    @model_validator(mode="after")
    def _relaxed_needs_lossless_shadow(self) -> "JobSpec":
        # Relaxed acceptance changes outputs: only with a lossless shadow comparison on the same rows (issue 8).
        check_relaxed_allowed(self.decoding, self.shadow)
        return self

    def spec_hash(self) -> str:
        """Hash of everything that changes the output rows (not resources, priority, Redis, labels)."""
        exclude = {"name", "preset", "resources", "priority", "redis_url"}
        # Left out at their defaults, so the hash of a spec written before these keys existed is unchanged.
        exclude |= {k for k, default in (("n_samples", 1), ("shadow", None)) if getattr(self, k) == default}
        d = self.model_dump(mode="json", exclude=exclude)
        if d["model"].get("dtype") is None:
            d["model"].pop("dtype", None)
        # the weights' storage never changes a row (as_stored is bit-identical to float32): not hashed, so a job
        # resumed under the other setting keeps its finished shards
        d["model"].pop("weights", None)
        # auto (the default since it existed) answers as chat on every model that has a chat template, as the
        # old default did; hashed as chat so that a folder written before keeps its hash (a base model's rows
        # failed under chat then, so nothing it wrote is reused wrongly)
        if d["input"].get("prompt_format") == "auto":
            d["input"]["prompt_format"] = "chat"
        # The reference column only feeds the shadow analysis, never the output rows: always left out.
        del d["input"]["columns"]["reference"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def row_params(self, overrides: dict[str, Any], *, seed: int) -> GenerationParams:
        """GenerationParams for one row; raises pydantic ValidationError on a bad per-row value."""
        g = self.generation
        base = dict(
            max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
            stop=list(g.stop), seed=seed,
        )
        base.update(overrides)
        return GenerationParams(**base)

    def stored(self) -> dict:
        """The spec as stored in Redis and the manifest: credentials (redis_url) dropped."""
        return self.model_dump(mode="json", exclude={"redis_url"})


_PATH_KEYS = (("input", "path"), ("output", "path"), ("decoding", "corpus_path"))


def _given_by(key: str, labels: dict[str, str]) -> Optional[str]:
    """The flag that set ``key`` (or a section above or a key below it), or None when the file did."""
    for k, label in labels.items():
        if key == k or key.startswith(k + ".") or k.startswith(key + "."):
            return label
    return None


_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt")}


def _fields_at(model: Any, path: tuple) -> list[str]:
    """The field names of the pydantic model section reached from ``model`` along ``path`` (field names), or
    [] where the path leaves the models (a list, a plain value)."""
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        stack, model = [field.annotation], None
        while stack:  # Optional[X], Union[X, str], ...: the first model among the arguments
            t = stack.pop(0)
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            stack.extend(getattr(t, "__args__", ()))
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _unknown_key_reason(err: dict, model: Any) -> str:
    """``unknown key``, with the nearest known key of that section of ``model`` (a pydantic model class) when
    one is close: a near spelling, else a known key that contains the given one."""
    loc = tuple(str(p) for p in err.get("loc", ()))
    names = _fields_at(model, loc[:-1]) if loc else []
    near = (difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.7)
            or [n for n in names if loc[-1] and loc[-1] in n][:1]) if names else []
    return "unknown key" + (f" (did you mean {near[0]!r}?)" if near else "")


def error_reason(err: dict, model: Any = None) -> str:
    """One pydantic error's reason in our words: a validator's own message without the ``Value error, `` /
    ``Assertion failed, `` pydantic puts before it, ``required``, ``must be >= 1`` for a bound, and ``unknown
    key`` with the nearest known key of that section of ``model`` (a pydantic model class) when one is close."""
    kind = err.get("type")
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return _unknown_key_reason(err, model)
    if kind in _BOUNDS and isinstance(err.get("ctx"), dict):
        op, key = _BOUNDS[kind]
        if key in err["ctx"]:
            return f"must be {op} {err['ctx'][key]}"
    msg = str(err.get("msg", ""))
    for head in ("Value error, ", "Assertion failed, "):
        if msg.startswith(head):
            return msg[len(head):]
    return msg


def format_validation_error(err: ValidationError, *, where: str, labels: Optional[dict[str, str]] = None) -> str:
    """One line per error, ``  key = value: reason``; a value that came from the command line says which
    flag gave it (``labels``: dotted key -> flag), and when every error did, the heading says so instead of
    blaming the spec file ``where``."""
    labels = labels or {}
    lines, from_flags = [], 0
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
        if len(shown) > 120:
            shown = shown[:117] + "..."
        flag = _given_by(key, labels)
        from_flags += flag is not None
        given = "" if e.get("type") == "missing" else f" = {shown}"  # a missing key's "input" is its section
        lines.append(f"  {key}{given}: {error_reason(e, JobSpec)}" + (f" (given by {flag})" if flag else ""))
    head = "invalid option (command line):" if from_flags == len(lines) else f"invalid job spec ({where}):"
    return "\n".join([head, *lines])


def deep_merge(base: dict, top: dict) -> dict:
    """Recursive dict merge; values from ``top`` win, nested dicts merge."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    """``set_dotted(d, "decoding.capacity", 16)`` sets d["decoding"]["capacity"] = 16."""
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise SpecError(f"override {dotted}: {p} is not a section")
        cur = nxt
    cur[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"decoding.capacity=16"`` -> ("decoding.capacity", 16); the value is read as a YAML scalar."""
    if "=" not in text:
        raise SpecError(f"override {text!r}: expected KEY=VALUE")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise SpecError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError(f"override {key}: cannot read value {raw!r}: {exc}") from None
    return key, value


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)  # safe_load: no Python tags, nothing executed
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


def preset_dirs(spec_dir: Optional[Path]) -> list[Path]:
    """Where a preset name is looked for, first match wins: the folders in ``RACER_BATCH_PRESETS``; the spec's
    folder, its ``configs/`` and its parent's ``configs/``; ``configs/`` and the working folder itself; last the
    presets shipped with the package (``racer_batch/presets``: ar, pld, racer-cpu, racer-paper)."""
    dirs = [Path(p) for p in os.environ.get(PRESET_DIRS_ENV, "").split(os.pathsep) if p]
    if spec_dir is not None:
        dirs += [spec_dir, spec_dir / "configs", spec_dir.parent / "configs"]
    dirs += [Path.cwd() / "configs", Path.cwd(), PACKAGE_PRESETS]
    return dirs


def shipped_presets() -> list[str]:
    """Names of the presets shipped with the package, e.g. ``["ar", "pld", "racer-cpu", "racer-paper"]``."""
    return sorted(p.stem for p in PACKAGE_PRESETS.glob("*.yaml"))


def resolve_preset(name: str, spec_dir: Optional[Path]) -> Path:
    cand = Path(name)
    if cand.suffix in (".yaml", ".yml") and cand.is_file():
        return cand
    for d in preset_dirs(spec_dir):
        for fname in (name, f"{name}.yaml", f"{name}.yml"):
            p = d / fname
            if p.is_file():
                return p
    raise SpecError(f"preset = {name!r}: no such preset (shipped: {', '.join(shipped_presets())}; also looked in "
                    f"the spec's folder, ./configs, the working folder and {PRESET_DIRS_ENV})")


def _resolve_paths(data: dict, base: Path) -> None:
    for section, key in _PATH_KEYS:
        sec = data.get(section)
        if isinstance(sec, dict) and isinstance(sec.get(key), str) and "://" not in sec[key]:
            p = Path(os.path.expanduser(sec[key]))
            sec[key] = str(p if p.is_absolute() else (base / p).resolve())


def load_spec(path: Optional[str | Path], overrides: Optional[dict[str, Any]] = None, *,
              override_labels: Optional[dict[str, str]] = None) -> JobSpec:
    """Read a job file, merge its preset and ``overrides`` (dotted keys), validate.

    ``path`` may be None when every required key comes from overrides. ``override_labels`` (dotted key ->
    the flag that gave it, e.g. ``{"decoding.capacity": "--capacity"}``) lets an error name the flag rather
    than the file. Raises SpecError.
    """
    labels = dict(override_labels or {})
    data: dict = {}
    spec_dir: Optional[Path] = None
    where = "overrides"
    if path is not None:
        p = Path(path)
        data = _read_yaml(p)
        spec_dir = p.resolve().parent
        _resolve_paths(data, spec_dir)
        where = str(path)
    flat: dict = {}
    for key, value in (overrides or {}).items():
        set_dotted(flat, key, value)
    _resolve_paths(flat, Path.cwd())
    merged = deep_merge(data, flat)
    preset = merged.get("preset")
    if preset is not None:
        if not isinstance(preset, str):
            raise SpecError(f"invalid job spec ({where}):\n  preset = {preset!r}: must be a preset name")
        pdata = _read_yaml(resolve_preset(preset, spec_dir))
        pdata.pop("preset", None)
        merged = deep_merge(pdata, merged)
    _resolve_shadow_preset(merged, spec_dir)
    try:
        return JobSpec.model_validate(merged)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, where=where, labels=labels)) from None


def _resolve_shadow_preset(merged: dict, spec_dir: Optional[Path]) -> None:
    """``shadow.config: ar`` -> the ``decoding`` section of the preset ``ar``, inline (workers need no files)."""
    shadow = merged.get("shadow")
    if not isinstance(shadow, dict) or not isinstance(shadow.get("config"), str):
        return
    name = shadow["config"]
    try:
        decoding = _read_yaml(resolve_preset(name, spec_dir)).get("decoding")
    except SpecError as exc:
        raise SpecError(f"shadow.config: {exc}") from None
    if not isinstance(decoding, dict):
        raise SpecError(f"shadow.config = {name!r}: the preset has no decoding section")
    shadow["config"] = decoding
    shadow.setdefault("name", name)


# ---- the service rule on relaxed acceptance (moved from the value types: it is a job-level policy) ----

def _shadow_decoding(shadow: Any) -> DecodingConfig | None:
    """The decoding config of a shadow configuration in any of the shapes check_relaxed_allowed accepts."""
    cand = shadow
    for _ in range(3):  # unwrap spec -> config -> DecodingConfig
        if isinstance(cand, DecodingConfig):
            return cand
        if isinstance(cand, dict):
            if "config" in cand or "decoding" in cand:
                cand = cand.get("config", cand.get("decoding"))
                continue
            try:
                return DecodingConfig(**cand)
            except ValueError:
                return None
        attr = getattr(cand, "decoding", None)
        if callable(attr) and not isinstance(attr, DecodingConfig):
            try:
                attr = attr()
            except AssertionError:  # an unresolved preset name
                attr = None
        cand = attr if attr is not None else getattr(cand, "config", None)
        if cand is None:
            return None
    return cand if isinstance(cand, DecodingConfig) else None


def check_relaxed_allowed(decoding: DecodingConfig, shadow: Any | None) -> None:
    """Refuse relaxed acceptance unless the job also runs a shadow comparison against lossless decoding.

    Relaxed acceptance (``decoding.acceptance`` ``topk`` or ``threshold``) changes outputs, so a job may use it
    only beside a shadow run of the same route whose decoding is lossless, so that the report can show the
    capability difference next to the speed gain. ``shadow`` is the job's shadow configuration: None (no
    shadow run), a ``DecodingConfig``, a shadow spec whose ``decoding()`` method, ``decoding`` attribute or
    ``config`` attribute gives one, or a dict with a ``config`` or ``decoding`` key. Lossless jobs always pass.

    Raises:
        ValueError: relaxed acceptance without a shadow, or with a shadow that is not lossless.
    """
    if decoding.acceptance == "lossless":
        return
    rule = ("top-" + str(decoding.relaxed_topk) if decoding.acceptance == "topk"
            else "p >= " + str(decoding.relaxed_threshold))
    what = f"decoding.acceptance = {decoding.acceptance!r} ({rule})"
    if shadow is None:
        raise ValueError(
            f"{what} changes outputs and is refused unless the job also runs a shadow comparison against "
            "lossless decoding on the same route; add a shadow run with decoding.acceptance = 'lossless' "
            "or use acceptance 'lossless'"
        )
    shadow_dec = _shadow_decoding(shadow)
    if shadow_dec is None:
        raise ValueError(f"{what}: the shadow configuration {shadow!r} has no decoding config to compare against")
    if shadow_dec.acceptance != "lossless":
        raise ValueError(
            f"{what}: the shadow run must decode losslessly, but its decoding.acceptance is {shadow_dec.acceptance!r}"
        )
