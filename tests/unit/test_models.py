"""Model-loading errors name the model, the path and what to do."""

import json

import pytest

from racer_batch.models import ModelLoadError, load_model


def test_unknown_name():
    with pytest.raises(ModelLoadError, match="unknown model 'nope'.*smollm2-135m"):
        load_model("nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 32}))
    with pytest.raises(ModelLoadError, match="missing or unreadable"):
        load_model(str(tmp_path))


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="dtype 'int8'"):
        load_model("smollm2-135m", dtype="int8")
