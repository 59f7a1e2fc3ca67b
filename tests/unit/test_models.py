"""Model-loading errors name the model, the path and what to do."""

import json

import pytest

from racer_batch.models import ModelLoadError, load_model


def test_unknown_name():
    with pytest.raises(ModelLoadError, match="unknown model 'nope'.*smollm2-135m"):
        load_model("nope")


@pytest.mark.parametrize("name", ["/tmp/nope-racer.gguf", "models/missing.GGUF", "./no-such-folder"])
def test_a_path_that_does_not_exist_is_named_as_missing(name):
    """A .gguf name or a local path that is not there is reported as missing, not as an unknown model or a hub
    id (the trial's P2)."""
    with pytest.raises(ModelLoadError, match=r"no such file or folder") as err:
        load_model(name)
    assert "unknown model" not in str(err.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("model_type,reason", [("t5", "is an encoder-decoder model"),
                                               ("vit", "has no causal language model class in transformers")])
def test_architectures_without_a_decoder_only_causal_lm_are_refused(tmp_path, model_type, reason):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    CONFIG_MAPPING[model_type]().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"architecture '{model_type}' {reason}"):
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


# ---------------------------------------------------------------- a .gguf file as the model name


def _smollm2_gguf():
    from racer_batch.models import SMOLLM2_GGUF, _smollm2_gguf_dir

    return _smollm2_gguf_dir() / SMOLLM2_GGUF


def test_a_gguf_file_loads_as_the_same_model_and_is_converted_once(tmp_path, monkeypatch):
    """``load_model(PATH.gguf)``: as stored by default where our kernels run (packed into the cache once: a second
    load reuses the folder), float32 on request (de-quantised into the cache once); either way the same weights
    (as stored: once expanded), tokenizer, chat template and EOS ids as the built-in name over the same file."""
    import torch

    from racer_batch import models
    from racer_batch.engine.kernels import cpu_ops

    builtin = load_model("smollm2-135m", device="cpu", weights="float32")
    monkeypatch.setenv("RACER_BATCH_CACHE", str(tmp_path))
    gguf = _smollm2_gguf()
    got = load_model(str(gguf), device="cpu")
    assert got.weights == ("as_stored" if cpu_ops() is not None else "float32")
    folder = models.stored_folder(gguf) if got.weights == "as_stored" else models.gguf_folder(gguf)
    assert folder.parent == tmp_path / "models" and folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    stamp = (folder / "config.json").stat().st_mtime_ns
    again = load_model(str(gguf), device="cpu")
    assert (folder / "config.json").stat().st_mtime_ns == stamp  # not converted again
    f32 = load_model(str(gguf), device="cpu", weights="float32")
    assert f32.weights == "float32" and models.gguf_folder(gguf).is_dir()
    assert got.eos_ids == builtin.eos_ids == again.eos_ids == f32.eos_ids
    assert got.tokenizer.chat_template == builtin.tokenizer.chat_template
    msgs = [{"role": "user", "content": "Name three prime numbers."}]
    assert got.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True) == \
        builtin.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    b = builtin.model.state_dict()
    for bundle in (got, f32):
        a = bundle.materialize().state_dict()  # as stored: every weight expanded, the float32 copy's numbers
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got.model.lm_head.weight is got.model.model.embed_tokens.weight  # still tied after expanding


def test_a_weights_setting_that_cannot_run_says_why(tmp_path):
    from racer_batch.models import tiny_random_model

    with pytest.raises(ModelLoadError, match="weights 'int4' is not one of as_stored, float32"):
        load_model("smollm2-135m", weights="int4")
    with pytest.raises(ModelLoadError, match="'tiny-random' is a random float32 model"):
        load_model("tiny-random", weights="as_stored")
    with pytest.raises(ModelLoadError, match="as_stored' cannot run: stored weights run on our float32 CPU kernels, "
                                             "not on cpu in bfloat16"):
        load_model("smollm2-135m", dtype="bfloat16", weights="as_stored")
    from transformers import AutoTokenizer

    from racer_batch import models

    tiny_random_model(vocab_size=64).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(models.stored_folder(_smollm2_gguf())).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="as_stored' cannot run: only a GGUF model"):
        load_model(str(tmp_path), weights="as_stored")
    assert load_model(str(tmp_path), weights=None).weights == "float32"  # the default falls back, says so in the log


def test_gguf_names_that_cannot_load_say_what_was_expected(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(fake))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf file: give a GGUF file, a HuggingFace model folder"):
        load_model(str(other))
    folder = tmp_path / "dl"
    folder.mkdir()
    (folder / "m-q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="no config.json.*it holds m-q4.gguf: pass that file's path"):
        load_model(str(folder))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(_smollm2_gguf().read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="transformers cannot read it"):
        load_model(str(truncated))


# ---------------------------------------------------------------- families whose state cannot be rolled back

REFUSED = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "zamba", "zamba2",
           "bamba", "falcon_h1", "qwen3_next", "lfm2", "granitemoehybrid", "nemotron_h", "minimax", "kimi_linear")
ATTENTION_ONLY = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe",
                  "olmo2", "granite", "starcoder2")


def _config(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


@pytest.mark.parametrize("model_type", REFUSED)
def test_recurrent_and_hybrid_families_are_refused_with_the_reason(model_type, tmp_path):
    """transformers' own config of each family, saved as a model folder: refused before any weight is read,
    saying why (the rollback) and naming the families that run."""
    from racer_batch.models import rollback_blocker

    config = _config(model_type)
    assert rollback_blocker(config) is not None
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=rf"architecture '{model_type}' is refused: .*rolls back the rejected "
                                             r"branches.*Families that run: llama"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("model_type", ATTENTION_ONLY)
def test_attention_only_families_are_not_taken_for_recurrent_ones(model_type):
    from racer_batch.models import rollback_blocker

    assert rollback_blocker(_config(model_type)) is None
