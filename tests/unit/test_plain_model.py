"""An as-stored model without transformers' model classes (weights/plain.py): the rotary tables are HF's bit for
bit, a ``NamedTree`` reads parameters as modules do, and ``plain_blocker`` lets only what the decoder reads by
name through. The model itself (logits, tokenizer, what a worker imports) is in
tests/integration/test_stored_model.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from racer_batch.weights.plain import DefaultRotary, PlainConfig, plain_blocker, rotary_of
from racer_batch.weights.stored import NamedTree

SMOL = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "num_hidden_layers": 30, "rms_norm_eps": 1e-5, "vocab_size": 49152,
        "max_position_embeddings": 8192, "intermediate_size": 1536, "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


@pytest.mark.parametrize("theta,heads,hidden", [(100000.0, 9, 576), (10000.0, 8, 512), (500000.0, 32, 4096)])
def test_rotary_tables_are_hfs_bit_for_bit(theta, heads, hidden):
    values = {**SMOL, "num_attention_heads": heads, "hidden_size": hidden, "head_dim": hidden // heads,
              "rope_parameters": {"rope_theta": theta, "rope_type": "default"}}
    hf = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in values.items() if k != "model_type"}))
    ours = rotary_of(PlainConfig(values))
    pos = torch.arange(8192).view(1, -1)
    x = torch.zeros(1)
    for a, b in zip(ours(x, pos), hf(x, pos)):
        assert a.shape == b.shape == (1, 8192, hidden // heads)
        assert torch.equal(a, b)


def test_rotary_differs_with_the_base():
    pos = torch.arange(64).view(1, -1)
    a, _ = DefaultRotary(64, 10000.0)(torch.zeros(1), pos)
    b, _ = DefaultRotary(64, 100000.0)(torch.zeros(1), pos)
    assert not torch.equal(a, b)


def test_named_tree_reads_parameters_as_modules_do():
    w = {name: torch.full((2, 2), float(i)) for i, name in enumerate([
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"])}
    tree = NamedTree(w)
    layers = tree.model.layers
    assert len(layers) == 2
    assert layers[0].self_attn.q_proj.weight is w["model.layers.0.self_attn.q_proj.weight"]
    assert layers[0].self_attn.q_proj.bias is w["model.layers.0.self_attn.q_proj.bias"]
    assert layers[1].self_attn.q_proj.bias is None  # a Linear without a bias
    assert not hasattr(layers[0].self_attn, "qkv_proj") and hasattr(layers[0], "self_attn")
    assert not hasattr(tree, "lm_head") and tree.model.norm.weight is w["model.norm.weight"]
    with pytest.raises(AttributeError, match="model.layers.0.mlp"):
        _ = layers[0].mlp


@pytest.mark.parametrize("change,why", [
    ({"model_type": "gemma3_text"}, "family"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, "default rope"),
    ({"rope_parameters": {}}, "default rope"),
    ({"sliding_window": 4096}, "sliding window"),
    ({"hidden_act": "gelu"}, "activation"),
    ({"rms_norm_eps": None}, "lacks rms_norm_eps"),
])
def test_plain_blocker_refuses_what_the_decoder_cannot_read_by_name(change, why):
    assert plain_blocker(PlainConfig(SMOL)) is None
    blocker = plain_blocker(PlainConfig({**SMOL, **change}))
    assert blocker is not None and why in blocker
