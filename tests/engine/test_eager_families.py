"""The eager runner (engine/runner.py: the stock transformers forward, our 4D tree mask, explicit positions) held
to the full-sequence forward, family by family, on tiny random models (hidden 64, 2 layers, every weight
re-randomised; no download). Each family runs ``test_static_runner.run_scenario``: prefill, then branching,
wide, root-only and chain trees with ``keep_rows`` between them, every node of every path compared with
``model(input_ids=...).logits``. The prompt (20 tokens) and the trees run past the sliding window (8) of the
families that have one. ``models.EAGER_TESTED_ARCHITECTURES`` is exactly the families here.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_static_runner import _BASE, bundle_of, rand_tokens, run_scenario
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from racer_batch.engine.runner import ModelRunner, check_tree_verify, layer_windows, make_runner
from racer_batch.models import EAGER_TESTED_ARCHITECTURES

WINDOW = 8
# per family: settings on top of the tiny base (a window of 8 where the family has sliding layers; MoE with 4
# experts, 2 per token)
FAMILY_SETTINGS = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 16}, "mistral": {"sliding_window": WINDOW},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": WINDOW, "final_logit_softcapping": 3.0},
    "gemma3_text": {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                    "final_logit_softcapping": 3.0},
    "phi": {}, "phi3": {}, "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "olmo2": {}, "granite": {"logits_scaling": 4.0}, "starcoder2": {}, "stablelm": {}, "cohere": {"logit_scale": 0.5},
    "gpt_neox": {}, "falcon": {}, "gpt2": {},
}


def tiny(family: str, seed: int = 0, **over):
    cfg = dict(_BASE, tie_word_embeddings=False)
    cfg.update(FAMILY_SETTINGS.get(family, {}))
    cfg.update(over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[family](**cfg)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.1 * noise)
    return model


def test_the_tested_list_is_these_families():
    assert set(FAMILY_SETTINGS) == set(EAGER_TESTED_ARCHITECTURES)


@pytest.mark.parametrize("family", sorted(FAMILY_SETTINGS))
def test_eager_tree_verify_equals_the_full_forward(family):
    model = tiny(family)
    runner = ModelRunner(bundle_of(model))
    prompt = rand_tokens(torch.Generator().manual_seed(5), 20)
    run_scenario(runner, model, prompt)


def test_sliding_layers_get_their_window():
    """The masks follow the config: Gemma 3's two kinds, Mistral's window on every layer, Qwen2's window only
    when switched on; without the window in the mask the sliding families above would fail past 8 positions."""
    assert layer_windows(tiny("gemma3_text").config) == {"sliding_attention": WINDOW, "full_attention": None}
    assert layer_windows(tiny("mistral").config) == {"sliding_attention": WINDOW}
    assert layer_windows(tiny("qwen2", sliding_window=WINDOW).config) == {"full_attention": None}
    model = tiny("gemma2")
    runner = ModelRunner(bundle_of(model))
    runner.windows = {"full_attention": None, "sliding_attention": None}  # the window dropped: the check fails
    with pytest.raises(AssertionError):
        run_scenario(runner, model, rand_tokens(torch.Generator().manual_seed(5), 20))


def test_an_untested_family_is_checked_on_the_model_itself(caplog):
    """A family outside the tested list runs after ``check_tree_verify`` passes on the loaded model; a runner
    that gets the logits wrong (Cohere's logit scale left out) is refused with the reason."""
    model = tiny("olmo")
    with caplog.at_level(logging.INFO, logger="racer_batch.engine.runner"):
        runner = make_runner(bundle_of(model), kind="eager")
    assert isinstance(runner, ModelRunner) and "'olmo' has no oracle test" in caplog.text
    broken = ModelRunner(bundle_of(tiny("cohere")))
    assert check_tree_verify(broken) < 1e-3
    broken._transform = None
    with pytest.raises(ValueError, match="'cohere'.*does not match the model's own forward"):
        check_tree_verify(broken)


def test_a_gemma3_folder_loads_and_racer_equals_greedy_past_the_window(tmp_path):
    """The public path on a family the static runner does not take: a Gemma 3 folder (tiny random weights, the
    SmolLM2 tokenizer) through ``load_model`` and ``Engine``: the eager runner is picked, and greedy RACER output
    equals the plain autoregressive reference, the prompt and output running past the sliding window."""
    from transformers import AutoTokenizer

    from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
    from racer_batch.models import load_model, smollm2_folder

    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    model = tiny("gemma3_text", seed=3, vocab_size=len(tok), max_position_embeddings=1024, bos_token_id=1,
                 eos_token_id=2)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    bundle = load_model(str(tmp_path), device="cpu")
    engine = Engine(bundle, DecodingConfig(method="racer", capacity=8))
    assert isinstance(engine.runner, ModelRunner)
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    params = GenerationParams(max_new_tokens=48)
    got = engine.generate(prompt, params)
    want = generate_reference(bundle, prompt, params)
    assert got.token_ids == want.token_ids and len(got.token_ids) == 48 and len(engine.encode(prompt)) > WINDOW
    assert got.stats.steps < 48  # drafts were accepted: the trees did the work, not one token per step
