"""An as-stored model loaded without transformers' model classes (issue 31, "Memory").

Importing a transformers model family (its config class pulls ``torch.distributed.tensor`` and sympy; its
modeling module ``masking_utils``, torch._dynamo and scipy) costs a process ~130-150 MB before a weight is read,
more than SmolLM2's stored weights (~100 MB). For a family whose whole forward our static runner computes from
the config and the weights' names, none of that is needed: the config is read from ``config.json`` as plain data
(``PlainConfig``), the rotary tables are computed here (``DefaultRotary``, the numbers of HF's default rope), the
weights are named tensors (``weights.stored.read``), and the tokenizer is read by the ``tokenizers`` library
(``weights/tokenizer.py``; not through ``AutoTokenizer``, which imports every config class). The HF model is
built only where something runs HF's forward (``ModelBundle.materialize``: the eager runner, oracles).

Which models load so: ``plain_blocker`` says why not (then the HF classes load as before).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

# Families whose every weight and setting the decoder reads by name from a plain config (engine/decoder.py) and
# that a test holds to the HF classes (tests/unit/test_plain_model.py); others (Gemma's norms and scaled
# embeddings, Phi-3's fused tensors, the MoE routers, Mistral's and Qwen2's window defaults) load their HF classes.
PLAIN_FAMILIES = ("llama",)
_REQUIRED = ("model_type", "hidden_size", "num_attention_heads", "num_hidden_layers", "rms_norm_eps",
             "vocab_size", "max_position_embeddings", "intermediate_size")


class PlainConfig:
    """A model's ``config.json`` as attributes (``cfg.hidden_size``); ``to_dict()`` gives the mapping. Only the
    file's own keys exist: a reader uses ``getattr(cfg, name, default)`` for optional ones, as the decoder does."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @classmethod
    def read(cls, folder: Any) -> "PlainConfig":
        """Raises: OSError (no ``config.json``), ValueError (not JSON)."""
        return cls(json.loads((Path(folder) / "config.json").read_text()))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of ``config`` (transformers 5: ``rope_parameters``; older files: ``rope_scaling`` beside
    ``rope_theta``)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    return params


def plain_blocker(config: PlainConfig) -> Optional[str]:
    """Why ``config``'s model cannot load without its HF classes, or None: a family outside ``PLAIN_FAMILIES``, a
    missing setting, a rope other than the default one (its tables would need HF's scaling code), partial rotary,
    biases the layout does not name, or an activation other than SiLU."""
    mt = getattr(config, "model_type", None)
    if mt not in PLAIN_FAMILIES:
        return f"family {mt!r} reads settings beyond the plain config"
    missing = [k for k in _REQUIRED if getattr(config, k, None) is None]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    rope = rope_parameters(config)
    if any(isinstance(v, dict) for v in rope.values()):
        return "one rope per layer kind"
    if rope.get("rope_type", rope.get("type", "default")) != "default" or "rope_theta" not in rope:
        return f"rope {rope} is not the default rope with a rope_theta"
    if rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        return "partial rotary embedding"
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False) or getattr(config, "sliding_window", None) or \
            getattr(config, "layer_types", None):
        return "MLP biases, a sliding window or per-layer kinds"
    return None


class DefaultRotary:
    """The default rotary embedding (RoFormer, arXiv:2104.09864) of a head size ``dim`` and base ``theta``: called
    as a HF rotary module is, ``rotary(x, positions [1, P])`` gives ``(cos, sin)``, each ``[1, P, dim]`` in
    ``x``'s dtype. The operations are HF's default rope's (``inv_freq = 1 / theta ** (2i / dim)`` from an int64
    range made float32, ``freqs = inv_freq * position`` in float32, the halves repeated, cos and sin, times an
    attention factor of 1), so the tables are bit for bit the module's: tests/unit/test_plain_model.py holds
    them to ``LlamaRotaryEmbedding``."""

    def __init__(self, dim: int, theta: float) -> None:
        self.dim, self.theta = int(dim), float(theta)
        exponent = torch.arange(0, self.dim, 2, dtype=torch.int64).to(dtype=torch.float) / self.dim
        self.inv_freq = 1.0 / (self.theta ** exponent)  # [dim / 2]

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)  # [B, dim/2, 1]
        pos = position_ids[:, None, :].float()  # [B, 1, P]
        freqs = (inv @ pos).transpose(1, 2)  # [B, P, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * 1.0).to(x.dtype), (emb.sin() * 1.0).to(x.dtype)


def rotary_of(config: Any) -> DefaultRotary:
    """The rotary embedding of a config ``plain_blocker`` accepts."""
    heads = int(config.num_attention_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return DefaultRotary(dim, float(rope_parameters(config)["rope_theta"]))


def load_tokenizer(folder: Any) -> Any:
    """The tokenizer saved in ``folder``: a ``weights.tokenizer.PlainTokenizer`` (the ``tokenizers`` library
    alone) where ``plain_tokenizer_blocker`` allows it; else transformers' ``TokenizersBackend`` where
    ``tokenizer_config.json`` names it (what ``AutoTokenizer`` would build, without importing every config
    class); else ``AutoTokenizer``'s."""
    from .tokenizer import PlainTokenizer, plain_tokenizer_blocker

    folder = Path(folder)
    if plain_tokenizer_blocker(folder) is None:
        return PlainTokenizer(folder)
    try:
        cls = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def generation_eos(folder: Any) -> Any:
    """``eos_token_id`` of ``folder``'s ``generation_config.json`` (an id, a list, or None)."""
    try:
        return json.loads((Path(folder) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return None
