"""The static verify runner (engine/static_runner.py) against its oracle, the stock transformers forward.

Tiny random models (hidden 64, 2 layers, no download) of every family the lean decoder claims: each
prefill / verify / keep_rows sequence is checked against ``model(input_ids=...).logits`` over the full
sequence without a cache, at every node of every root-to-leaf path. Every weight is re-randomised
(biases and norm weights too: HF initialises them to 0 and 1, which would hide a dropped bias or norm).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from racer_batch import DecodingConfig, Engine, GenerationParams, generate_reference
from racer_batch.drafters.base import Draft
from racer_batch.engine import static_runner as sr
from racer_batch.engine.decoder_ops import FastLinear, default_matmul_path
from racer_batch.engine.kernels import cpu_ops
from racer_batch.engine.runner import ModelRunner, make_runner
from racer_batch.engine.static_runner import SlotCache, StaticRunner, describe_unsupported, pick_bucket
from racer_batch.engine.tree import TreeInputs, flatten_tree
from racer_batch.models import ModelBundle
from tests.helpers import CharTokenizer, tiny_bundle

V = 64
ATOL = RTOL = 1e-4
BUCKETS = (1, 2, 4, 8)
PROMPTS = ["abcabcabd", "hello world, hello", "0123012301", "the cat sat on the mat. the cat"]

_BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),  # q/k/v bias, no o bias
    "qwen3": (Qwen3Config, {"head_dim": 32}),  # per-head q/k RMSNorm; head_dim != hidden / heads
    "mistral": (MistralConfig, {"sliding_window": None}),
    "llama_bias": (LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
    "llama3_rope": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "yarn_rope": (LlamaConfig, {"rope_parameters": YARN_ROPE}),
    "tied": (LlamaConfig, {"tie_word_embeddings": True}),
    "llama_mqa": (LlamaConfig, {"num_key_value_heads": 1}),  # one KV head shared by all query heads
    "llama_mha": (LlamaConfig, {"num_key_value_heads": 4}),  # no grouping
    # a window of 16 positions: the 33-token prompts and the trees after them reach past it
    "mistral_window": (MistralConfig, {"sliding_window": 16}),
    "phi3": (Phi3Config, {"pad_token_id": None}),  # its own fused qkv_proj and gate_up_proj
    "phi3_window": (Phi3Config, {"sliding_window": 16}),
    # scaled embeddings, (1 + w) norms, four norms per layer, tanh GELU, query_pre_attn_scalar, q/k norms, sliding
    # and full layers with their own rotary tables (local theta 10,000, global 1,000,000)
    "gemma3_text": (Gemma3TextConfig, {"head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 24,
                                       "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3_moe": (Qwen3MoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "norm_topk_prob": True, "head_dim": 16}),
    "qwen3_moe_dense": (Qwen3MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "norm_topk_prob": False, "mlp_only_layers": [0]}),  # a dense layer first
    "mixtral": (MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def make_model(family: str = "llama", *, seed: int = 0, **over):
    """A tiny random model of ``family`` in eval mode, every parameter re-randomised."""
    cls, extra = FAMILIES[family]
    cfg = dict(_BASE, tie_word_embeddings=False)
    cfg.update(extra)
    cfg.update(over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**cfg)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def bundle_of(model, *, context_length: int = 512) -> ModelBundle:
    return ModelBundle(model=model, tokenizer=CharTokenizer(V), name="tiny-static-test", eos_ids=[2],
                       context_length=context_length, device="cpu", dtype="float32")


@torch.no_grad()
def oracle(model, seq) -> torch.Tensor:
    """HF full-sequence logits ``[len(seq), V]``, no cache."""
    return model(input_ids=torch.tensor([list(seq)])).logits[0].float()


def rand_tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=gen).tolist()


def rand_draft(gen: torch.Generator, size: int) -> Draft:
    """A random tree of ``size`` nodes (node 0 the root; creation order is not breadth-first)."""
    toks = rand_tokens(gen, size)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    return Draft(toks, parents, [0] * size)


def prefilled_chain() -> tuple[StaticRunner, SlotCache, TreeInputs]:
    """A runner (llama) with one stream prefilled with 5 6 7 and the chain 8 9 drafted after it, flattened:
    (runner, the stream's cache, the tree)."""
    runner = StaticRunner(bundle_of(make_model("llama")))
    cache = runner.new_cache(16)
    runner.prefill([5, 6, 7], cache=cache, topk=0)
    return runner, cache, flatten_tree(Draft.chain([8, 9]), committed_len=3, device="cpu", dtype=torch.float32)


def check_tree(runner, cache, model, committed: list[int], draft: Draft):
    """Verify ``draft`` after ``committed`` and compare every path to the oracle; returns (tree, logits)."""
    tree = flatten_tree(draft, committed_len=len(committed), device=runner.device, dtype=runner.dtype)
    logits = runner.verify_tree(tree, cache=cache)
    assert logits.shape == (tree.size, V)
    seen = set()
    for path in tree.paths:
        nodes = [int(n) for n in path if n >= 0]
        seen.update(nodes)
        seq = committed + [int(tree.tokens[n]) for n in nodes]
        want = oracle(model, seq)[len(committed):]
        torch.testing.assert_close(logits[nodes].float(), want, atol=ATOL, rtol=RTOL)
    assert seen == set(range(tree.size))  # every node was checked
    return tree, logits.clone()  # the runner's logits are valid until its next call (a reused buffer)


def run_scenario(runner, model, prompt: list[int], *, seed: int = 0) -> list[torch.Tensor]:
    """Prefill, then four verify / keep_rows steps (branching tree kept along a non-chain path, a wide tree,
    a root-only tree, a chain), every output checked against the oracle. Returns every logits tensor."""
    gen = torch.Generator().manual_seed(100 + seed)
    cache = runner.new_cache(len(prompt) + 20)
    outs = []
    last, top = runner.prefill(prompt, cache=cache, topk=4)
    full = oracle(model, prompt)
    torch.testing.assert_close(last, full[-1], atol=ATOL, rtol=RTOL)
    assert top.shape == (len(prompt), 4)
    assert torch.equal(top, torch.topk(full, 4, dim=-1).indices)
    outs.append(last)
    committed = list(prompt)

    # creation order is not breadth-first: flattening reorders it to [o0, o1, o3, o2, o5, o4]
    t = rand_tokens(gen, 6)
    tree, lg = check_tree(runner, cache, model, committed, Draft(t, [-1, 0, 1, 0, 2, 3], [0] * 6))
    assert tree.parents[1] == 0 and tree.parents[3] == 1 and tree.parents[2] == 0  # [0, 1, 3] skips node 2
    outs.append(lg)
    keep = [0, 1, 3]
    runner.keep_rows(cache, committed_len=len(committed), nodes=keep)
    committed += [int(tree.tokens[n]) for n in keep]

    t = rand_tokens(gen, 5)
    tree, lg = check_tree(runner, cache, model, committed, Draft(t, [-1, 0, 0, 0, 1], [0] * 5))
    outs.append(lg)
    keep = [0, 3]
    runner.keep_rows(cache, committed_len=len(committed), nodes=keep)
    committed += [int(tree.tokens[n]) for n in keep]

    tree, lg = check_tree(runner, cache, model, committed, Draft.root_only(rand_tokens(gen, 1)[0]))
    outs.append(lg)
    runner.keep_rows(cache, committed_len=len(committed), nodes=[0])
    committed += [int(tree.tokens[0])]

    t = rand_tokens(gen, 3)
    tree, lg = check_tree(runner, cache, model, committed, Draft(t, [-1, 0, 1], [0] * 3))
    outs.append(lg)
    runner.keep_rows(cache, committed_len=len(committed), nodes=[0, 1, 2])
    committed += [int(x) for x in tree.tokens]

    tree, lg = check_tree(runner, cache, model, committed, Draft(rand_tokens(gen, 2), [-1, 0], [0, 0]))
    outs.append(lg)
    release = getattr(cache, "release", None)
    if release is not None:
        release()
    return outs


# ---------------------------------------------------------------- 1. logit equivalence per family


@pytest.mark.parametrize("prompt_len", [11, 33])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_and_eager_match_the_hf_forward(family, prompt_len, monkeypatch):
    # 33 tokens in chunks of 16: three prefill forwards, the last one a single token after a prefix
    monkeypatch.setattr(sr, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(sr, "PREFILL_TOPK_CHUNK", 8)
    model = make_model(family, seed=prompt_len)
    bundle = bundle_of(model)
    assert describe_unsupported(model) is None
    prompt = rand_tokens(torch.Generator().manual_seed(prompt_len), prompt_len)
    static = StaticRunner(bundle, buckets=BUCKETS)
    assert static.kind == "static"
    got = run_scenario(static, model, prompt)
    eager = run_scenario(ModelRunner(bundle), model, prompt)
    assert len(got) == len(eager)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_long_prompt_prefill_in_sdpa_sized_chunks(family, monkeypatch):
    """Chunks of >= SDPA_MIN_ROWS rows after a prefix take SDPA with an explicit mask, shorter ones the
    runner's own attention: 300 tokens in chunks of 128 run a causal chunk, a masked SDPA chunk and a short
    tail."""
    monkeypatch.setattr(sr, "PREFILL_CHUNK", 128)
    model = make_model(family, seed=5)
    bundle = bundle_of(model)
    prompt = rand_tokens(torch.Generator().manual_seed(5), 300)
    got = run_scenario(StaticRunner(bundle, buckets=BUCKETS), model, prompt)
    eager = run_scenario(ModelRunner(bundle), model, prompt)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("runner_kind", ["static", "eager"])
def test_prefill_top_k_at_asked_rows_only(runner_kind, monkeypatch):
    """``prefill(rows=...)`` gives the top-k of exactly those positions (those of the full call) and -1 in
    the rest, across prefill chunks and output-layer chunks (40 positions in chunks of 16 and 8), and the same
    last logits."""
    monkeypatch.setattr(sr, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(sr, "PREFILL_TOPK_CHUNK", 8)
    import racer_batch.engine.runner as er

    monkeypatch.setattr(er, "PREFILL_TOPK_CHUNK", 8)
    model = make_model("llama", seed=61)
    bundle = bundle_of(model)
    runner = StaticRunner(bundle, buckets=BUCKETS) if runner_kind == "static" else ModelRunner(bundle)
    prompt = [int(t) for t in torch.randint(3, 20, (40,), generator=torch.Generator().manual_seed(61))]
    from racer_batch.engine.engine import last_positions

    rows = last_positions(prompt)
    assert 0 < len(rows) < len(prompt)  # 17 distinct ids in 40 positions: some rows skipped
    last_full, top_full = runner.prefill(prompt, cache=runner.new_cache(64), topk=4)
    last, top = runner.prefill(prompt, cache=runner.new_cache(64), topk=4, rows=rows)
    assert torch.equal(last, last_full)
    assert top.shape == top_full.shape == (40, 4)
    assert torch.equal(top[rows], top_full[rows])
    skipped = np.setdiff1d(np.arange(40), rows)
    assert (top[skipped] == -1).all()
    _, none = runner.prefill(prompt, cache=runner.new_cache(64), topk=0, rows=rows)
    assert none is None


def test_building_runners_leaves_the_hf_model_unchanged_and_shares_its_weights():
    """The runner fuses q/k/v and gate/up by re-pointing the model's own parameters into one tensor: the HF
    forward must give the same logits afterwards, and a second runner must reuse the fused storage."""
    model = make_model("llama_bias", seed=51)
    prompt = rand_tokens(torch.Generator().manual_seed(51), 17)
    before = oracle(model, prompt)
    r1 = StaticRunner(bundle_of(model), buckets=BUCKETS)
    r2 = StaticRunner(bundle_of(model), buckets=BUCKETS)
    torch.testing.assert_close(oracle(model, prompt), before, atol=1e-6, rtol=1e-6)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert r1.layers[1].qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()  # no copy beside the model's
    assert r1.layers[1].gate_up.weight.data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert r2.layers[1].qkv.weight.data_ptr() == r1.layers[1].qkv.weight.data_ptr()
    assert r2.layers[1].qkv.bias.data_ptr() == r1.layers[1].qkv.bias.data_ptr()
    run_scenario(r2, model, prompt)
    eager = ModelRunner(bundle_of(model))
    last, _ = eager.prefill(prompt, cache=eager.new_cache(), topk=0)
    torch.testing.assert_close(last, before[-1], atol=1e-5, rtol=1e-5)


def test_oracle_check_is_sensitive_to_the_family_details():
    """The re-randomised biases / q-k norms / rope scaling really change the output, so the per-family
    equivalence above would catch a decoder that dropped them."""
    prompt = rand_tokens(torch.Generator().manual_seed(0), 20)
    base = oracle(make_model("llama", seed=0), prompt)
    for family in ("llama_bias", "llama3_rope", "yarn_rope"):
        other = oracle(make_model(family, seed=0), prompt)
        assert (other - base).abs().max() > 1e-2, family
    m = make_model("qwen3", seed=0)
    ref = oracle(m, prompt)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
    assert (oracle(m, prompt) - ref).abs().max() > 1e-2


def _available_matmul_paths():
    paths = ["torch"]
    if cpu_ops() is not None:
        paths.append("small_gemm")
    if torch.backends.mkldnn.is_available():
        paths.append("onednn_packed")
    return paths


@pytest.mark.parametrize("matmul", _available_matmul_paths())
def test_every_matmul_path_matches_the_oracle(matmul, monkeypatch):
    monkeypatch.setattr(sr, "PREFILL_CHUNK", 16)
    model = make_model("llama_bias", seed=7)
    runner = StaticRunner(bundle_of(model), buckets=BUCKETS, matmul=matmul)
    assert runner.matmul == matmul
    runner.warmup([8])
    run_scenario(runner, model, rand_tokens(torch.Generator().manual_seed(7), 37))
    if matmul != "torch":
        assert runner.packed_bytes > 0  # the packed copies were really made and used


@pytest.mark.parametrize("matmul", _available_matmul_paths())
@pytest.mark.parametrize("bias", [False, True])
def test_fast_linear_equals_f_linear_for_every_row_count(matmul, bias):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    lin = FastLinear(w, b, path=matmul)
    for rows in range(1, 12):
        x = torch.randn(rows, 32, generator=gen)
        want = torch.nn.functional.linear(x, w, b)
        torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)


def test_pick_bucket_and_matmul_choice(monkeypatch):
    assert [pick_bucket(t, BUCKETS) for t in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 9]
    monkeypatch.delenv("RACER_MATMUL", raising=False)
    want = "small_gemm" if cpu_ops() is not None else ("onednn_packed", "torch")
    assert default_matmul_path(torch.device("cpu")) in want
    assert default_matmul_path(torch.device("cpu"), torch.bfloat16) in ("onednn_packed", "torch")
    assert default_matmul_path(torch.device("cuda")) == "torch"
    monkeypatch.setenv("RACER_MATMUL", "onednn_packed")
    assert default_matmul_path(torch.device("cpu")) == "onednn_packed"
    monkeypatch.setenv("RACER_MATMUL", "auto")
    with pytest.raises(ValueError, match="RACER_MATMUL"):
        default_matmul_path(torch.device("cpu"))


# ---------------------------------------------------------------- 2. padding


def _poison_beyond(runner: StaticRunner, cache: SlotCache, start: int) -> None:
    """Fill the slot's KV positions from ``start`` on with large garbage: nothing a verify reads may come
    from there (only the committed prefix and the tree's own fresh rows)."""
    gen = torch.Generator().manual_seed(99)
    with torch.inference_mode():  # the KV buffer is an inference tensor
        tail = runner.kv[:, :, cache.slot, :, start:]
        tail.copy_(100.0 * torch.randn(tail.shape, generator=gen))


def test_padded_tree_returns_exactly_the_real_rows():
    model = make_model("llama", seed=11)
    bundle = bundle_of(model)
    prompt = rand_tokens(torch.Generator().manual_seed(11), 13)
    draft = Draft(rand_tokens(torch.Generator().manual_seed(12), 5), [-1, 0, 0, 1, 2], [0] * 5)

    # our CPU kernels take any row count and pad nothing; the other matmul paths (and compiled steps) pad
    padded = StaticRunner(bundle, buckets=BUCKETS, matmul="torch")
    exact = StaticRunner(bundle, buckets=(1, 5), matmul="torch")  # 5 is a bucket here: no padding at all
    results = []
    for runner in (padded, exact):
        cache = runner.new_cache(64)
        runner.prefill(prompt, cache=cache, topk=0)
        _poison_beyond(runner, cache, len(prompt))
        tree, logits = check_tree(runner, cache, model, prompt, draft)
        assert logits.shape == (5, V)  # the 3 padding rows of bucket 8 are dropped
        results.append(logits)
        # the padding rows' KV was written at [13 + 5, 13 + 8); a kept path and the next verify never see it
        runner.keep_rows(cache, committed_len=len(prompt), nodes=[0, 2, 4])
        committed = prompt + [int(tree.tokens[n]) for n in (0, 2, 4)]
        check_tree(runner, cache, model, committed, Draft(rand_tokens(torch.Generator().manual_seed(13), 3),
                                                          [-1, 0, 0], [0] * 3))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_ops() is None, reason="our CPU kernels did not build here (the fallback is tested)")
def test_kernel_path_pads_nothing_and_writes_only_the_trees_rows():
    """On our CPU kernels (the default in float32 on an AVX2 CPU) a tree of 5 nodes is verified as 5 rows: no
    bucket padding, KV rows written at exactly [L, L + 5), the mask block cleared afterwards."""
    model = make_model("qwen3", seed=14)  # q/k norm: the rope_kv_ op with norms
    runner = StaticRunner(bundle_of(model), buckets=BUCKETS)
    assert runner.matmul == "small_gemm" and runner._ops is not None
    prompt = rand_tokens(torch.Generator().manual_seed(14), 13)
    cache = runner.new_cache(64)
    runner.prefill(prompt, cache=cache, topk=0)
    _poison_beyond(runner, cache, len(prompt))
    before = runner.kv[:, :, cache.slot, :, len(prompt) + 5 :].clone()
    draft = Draft(rand_tokens(torch.Generator().manual_seed(15), 5), [-1, 0, 0, 1, 2], [0] * 5)
    check_tree(runner, cache, model, prompt, draft)
    assert torch.equal(runner.kv[:, :, cache.slot, :, len(prompt) + 5 :], before)  # bucket 8 would write 3 more


def test_tree_larger_than_the_largest_bucket_runs_unpadded():
    """A tree above the largest bucket adds the next power-of-two bucket (``add_bucket``) and verifies
    exactly (an engine capacity above the largest bucket, e.g. capacity 100 with the default buckets)."""
    model = make_model("llama", seed=12)
    runner = StaticRunner(bundle_of(model), buckets=(1, 2, 4))
    prompt = rand_tokens(torch.Generator().manual_seed(12), 9)
    cache = runner.new_cache(32)
    runner.prefill(prompt, cache=cache, topk=0)
    draft = Draft(rand_tokens(torch.Generator().manual_seed(13), 6), [-1, 0, 0, 1, 1, 2], [0] * 6)
    check_tree(runner, cache, model, prompt, draft)
    assert runner.buckets == (1, 2, 4, 8)


def test_engine_capacity_above_the_largest_bucket(tiny):
    """DecodingConfig allows capacity up to 1024 and the default runner (auto) is the static one, whose
    default buckets end at 64: the engine's warm-up adds the capacity's power-of-two bucket, and a racer tree
    of more than 64 nodes verifies exactly."""
    prompt = "abcabcabcabd the cat sat on the mat" * 3
    params = GenerationParams(max_new_tokens=60)
    engine = Engine(tiny, DecodingConfig(method="racer", capacity=128))
    assert engine.runner.kind == "static" and engine.runner.buckets[-2:] == (64, 128)
    out = engine.generate(prompt, params, keep_steps=True)
    assert out.token_ids == generate_reference(tiny, prompt, params).token_ids
    assert max(r.tree_size for r in out.stats.step_records) > 64


# ---------------------------------------------------------------- 3. compile on the CPU


def test_compile_on_the_cpu_warns_and_runs_uncompiled(caplog):
    """``compile`` means CUDA graphs on CUDA; asked for on the CPU it logs a warning and the runner runs
    uncompiled (the torch.compile'd CPU step measured ~30x slower and was removed)."""
    model = make_model("llama", seed=21)
    with caplog.at_level(logging.WARNING):
        runner = StaticRunner(bundle_of(model), buckets=(1, 2), compile=True)
    assert not runner.compiled and "compile on the CPU" in caplog.text
    runner.warmup([2])
    run_scenario(runner, model, rand_tokens(torch.Generator().manual_seed(21), 10))


# ---------------------------------------------------------------- 4. KV buffer growth


def test_kv_buffer_grows_preserving_values_and_stays_bounded():
    ctx = 48
    model = make_model("qwen2", seed=31, max_position_embeddings=ctx)
    runner = StaticRunner(bundle_of(model, context_length=ctx), buckets=BUCKETS, slots=2, max_len=1)
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv_heads x head_dim x float32
    start_len = runner.max_len
    assert start_len == BUCKETS[-1] + 1  # the smallest start: one bucket of padding + 1
    assert StaticRunner(bundle_of(model, context_length=ctx), buckets=BUCKETS).max_len == ctx + BUCKETS[-1]
    gen = torch.Generator().manual_seed(31)

    # another row in slot A holds a prefix while slot B's growth reallocates the shared buffer
    a = runner.new_cache(0)
    pa = rand_tokens(gen, 5)
    runner.prefill(pa, cache=a, topk=0)
    assert runner.max_len > start_len  # grew for the prompt
    b = runner.new_cache(0)
    before = runner.max_len
    committed = rand_tokens(gen, 12)
    runner.prefill(committed, cache=b, topk=0)
    assert runner.max_len > before  # grew again for the second, longer prompt
    lens = [runner.max_len]
    while len(committed) + 8 < ctx:
        draft = Draft(rand_tokens(gen, 8), [-1, 0, 1, 2, 3, 0, 5, 6], [0] * 8)
        tree, _ = check_tree(runner, b, model, committed, draft)
        keep = [int(n) for n in tree.paths[0][:4]]  # root + 3 nodes of one branch: not a contiguous chain
        assert keep != [0, 1, 2, 3]
        runner.keep_rows(b, committed_len=len(committed), nodes=keep)
        committed += [int(tree.tokens[n]) for n in keep]
        lens.append(runner.max_len)
    assert lens[-1] > lens[0]  # grew again mid-row, with a committed prefix to carry over
    assert runner.kv.shape[4] == runner.max_len
    assert runner.kv_bytes_per_slot == runner.kv_bytes_per_token * runner.max_len
    assert runner.kv.numel() * runner.kv.element_size() == 2 * runner.kv_bytes_per_slot
    # slot A's prefix survived every reallocation
    check_tree(runner, a, model, pa, Draft(rand_tokens(gen, 3), [-1, 0, 0], [0] * 3))
    # never beyond the context plus one bucket of padding, however much is asked for
    a.release()
    runner.new_cache(10_000)
    assert runner.max_len <= ctx + BUCKETS[-1]
    assert max(lens) <= ctx + BUCKETS[-1]


def test_kv_cache_memory_check_names_the_bytes_and_the_settings(monkeypatch):
    """``reserve_slots`` (engine start-up), a row's growth and the start allocation compare the KV-cache bytes
    with the device's available memory and refuse with a ValueError that names the bytes and what to lower."""
    from racer_batch.engine import kv_cache

    model = make_model("llama", seed=43)
    runner = StaticRunner(bundle_of(model), buckets=BUCKETS, max_len=64)
    slot_bytes = runner.kv_bytes_per_token * 64
    monkeypatch.setattr(kv_cache, "available_bytes", lambda device: 3 * slot_bytes)
    runner.reserve_slots(3)  # fits exactly
    with pytest.raises(ValueError) as err:
        runner.reserve_slots(4)
    msg = str(err.value)
    assert f"{4 * slot_bytes:,} bytes" in msg and f"{3 * slot_bytes:,} bytes" in msg
    assert "resources.streams_per_actor" in msg and "max_new_tokens" in msg
    assert runner.slots == 3 and runner.kv.shape[2] == 3  # nothing changed
    with pytest.raises(ValueError, match="max_new_tokens"):  # a row that needs longer slots than fit
        runner.new_cache(300)
    assert runner.max_len == 64 and sorted(runner._free_slots) == [0, 1, 2]  # the refused row took no slot
    a = runner.new_cache(40)  # a row that fits still runs
    prompt = rand_tokens(torch.Generator().manual_seed(43), 9)
    runner.prefill(prompt, cache=a, topk=0)
    check_tree(runner, a, model, prompt, Draft(rand_tokens(torch.Generator().manual_seed(44), 3), [-1, 0, 0], [0] * 3))
    monkeypatch.setattr(kv_cache, "available_bytes", lambda device: slot_bytes - 1)
    with pytest.raises(ValueError, match="streams_per_actor"):
        StaticRunner(bundle_of(model), buckets=BUCKETS, max_len=64)


def test_engine_start_refuses_more_streams_than_memory_holds(monkeypatch):
    from racer_batch.engine import kv_cache

    bundle = tiny_bundle(context_length=128)
    per_slot = StaticRunner(bundle).kv_bytes_per_slot
    monkeypatch.setattr(kv_cache, "available_bytes", lambda device: 2 * per_slot)
    Engine(bundle, DecodingConfig(method="ar", runner="static"), streams=2)
    with pytest.raises(ValueError, match="streams_per_actor"):
        Engine(bundle, DecodingConfig(method="ar", runner="static"), streams=4)


def test_available_bytes_reads_this_machine():
    from racer_batch.engine.kv_cache import available_bytes

    got = available_bytes(torch.device("cpu"))
    assert got is None or got > 0


# ---------------------------------------------------------------- 5. slots


def test_slots_are_exclusive_and_rows_do_not_disturb_each_other():
    model = make_model("llama", seed=41)
    runner = StaticRunner(bundle_of(model), buckets=BUCKETS, slots=2, max_slots=2)
    a, b = runner.new_cache(40), runner.new_cache(40)
    assert {a.slot, b.slot} == {0, 1}
    with pytest.raises(RuntimeError, match="slots"):
        runner.new_cache(40)

    gen = torch.Generator().manual_seed(41)
    rows = {}
    for cache in (a, b):
        prompt = rand_tokens(gen, 9 if cache is a else 14)
        runner.prefill(prompt, cache=cache, topk=0)
        rows[cache] = prompt
    for step in range(3):  # interleaved: a, b, a, b, ...
        for cache in (a, b):
            committed = rows[cache]
            draft = Draft(rand_tokens(gen, 5), [-1, 0, 0, 1, 2], [0] * 5)
            tree, _ = check_tree(runner, cache, model, committed, draft)
            keep = [0, 2, 4] if step % 2 == 0 else [0, 1]
            runner.keep_rows(cache, committed_len=len(committed), nodes=keep)
            rows[cache] = committed + [int(tree.tokens[n]) for n in keep]
            assert cache.length == len(rows[cache])

    a.release()
    c = runner.new_cache(40)  # the freed slot is handed out again; its old content does not leak
    assert c.slot == a.slot and c.length == 0
    with pytest.raises(RuntimeError):
        runner.new_cache(40)
    prompt = rand_tokens(gen, 6)
    runner.prefill(prompt, cache=c, topk=0)
    check_tree(runner, c, model, prompt, Draft(rand_tokens(gen, 3), [-1, 0, 1], [0] * 3))
    check_tree(runner, b, model, rows[b], Draft(rand_tokens(gen, 3), [-1, 0, 0], [0] * 3))


def test_releasing_a_slot_twice_does_not_hand_it_to_two_rows():
    """A second ``release()`` of the same handle (e.g. an error path plus a finally) must not put the slot
    on the free list twice: two live rows would then share one slot's KV rows."""
    runner = StaticRunner(bundle_of(make_model("llama", seed=42)), buckets=BUCKETS, slots=2, max_slots=2)
    a = runner.new_cache(8)
    a.release()
    a.release()
    x, y = runner.new_cache(8), runner.new_cache(8)
    assert x.slot != y.slot
    with pytest.raises(RuntimeError):
        runner.new_cache(8)


# ---------------------------------------------------------------- 6. describe_unsupported / make_runner


def _unsupported_cases():
    phi3_long = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    return {
        "gelu": (make_model("llama", hidden_act="gelu"), "activation"),
        "dynamic rope": (make_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                              "factor": 2.0}), "rope type"),
        "phi3 longrope": (make_model("phi3", rope_parameters=phi3_long), "rope type"),
        "partial rotary": (make_model("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.5}), "partial rotary"),
        "gemma3 soft-capping": (make_model("gemma3_text", final_logit_softcapping=30.0), "softcapping"),
        "gemma3 bidirectional": (make_model("gemma3_text", use_bidirectional_attention=True), "bidirectional"),
    }


def test_unsupported_models_fall_back_to_eager_and_static_refuses():
    for label, (model, reason) in _unsupported_cases().items():
        why = describe_unsupported(model)
        assert why is not None and reason in why, (label, why)
        bundle = bundle_of(model)
        runner = make_runner(bundle, kind="auto")
        assert isinstance(runner, ModelRunner) and runner.kind == "eager", label
        with pytest.raises(ValueError, match=reason):
            make_runner(bundle, kind="static")
        with pytest.raises(ValueError, match=reason):
            StaticRunner(bundle)


def test_make_runner_kinds():
    # sliding_window >= the context is full attention; a shorter window is the layers' mask (supported)
    for model in (make_model("llama"), make_model("mistral", sliding_window=4096, max_position_embeddings=512),
                  make_model("qwen2", use_sliding_window=False, sliding_window=16),
                  make_model("mistral", sliding_window=16), make_model("gemma3_text")):
        bundle = bundle_of(model)
        assert describe_unsupported(model) is None
        auto = make_runner(bundle, kind="auto")
        assert isinstance(auto, StaticRunner) and auto.kind == "static" and not auto.compiled
        assert not auto.compile_requested  # compile auto: off on the CPU
        assert make_runner(bundle, kind="static").kind == "static"
        assert not make_runner(bundle, kind="static", compile="on").compiled  # CUDA graphs: CUDA only
        assert make_runner(bundle, kind="eager").kind == "eager"
    bundle = bundle_of(make_model("llama"))
    for bad in ("fast", "Static", ""):
        with pytest.raises(ValueError, match="decoding.runner"):
            make_runner(bundle, kind=bad)
    with pytest.raises(ValueError, match="matmul"):
        StaticRunner(bundle, matmul="blas")
    with pytest.raises(ValueError, match="slots"):
        StaticRunner(bundle, slots=0)


# ---------------------------------------------------------------- 7. engine level


def test_greedy_steps_on_our_kernels_take_the_fused_argmax_and_top_k(tiny, monkeypatch):
    """On the static runner with our CPU kernels a greedy RACER step reads its logits once
    (``argmax_and_topk``); the output is the reference's and equals the run on torch's two ops."""
    import racer_batch.engine.step as eng

    calls = []
    real = eng.argmax_and_topk

    def counting(logits, k, ops):
        out = real(logits, k, ops)
        calls.append(out is not None)
        return out

    engine = Engine(tiny, DecodingConfig(method="racer", capacity=8, runner="static"))
    params = GenerationParams(max_new_tokens=40)
    monkeypatch.setattr(eng, "argmax_and_topk", counting)
    fused = [engine.generate(p, params).token_ids for p in PROMPTS]
    assert calls and all(calls) == (cpu_ops() is not None)
    monkeypatch.setattr(eng, "argmax_and_topk", lambda logits, k, ops: None)
    plain = [engine.generate(p, params).token_ids for p in PROMPTS]
    refs = [generate_reference(tiny, p, params).token_ids for p in PROMPTS]
    assert fused == plain == refs


@pytest.mark.parametrize("method", ["ar", "racer", "pld"])
def test_engine_greedy_equals_reference_on_both_runners(tiny, method):
    state_outputs = {}
    refs = [generate_reference(tiny, p, GenerationParams(max_new_tokens=40)) for p in PROMPTS]
    for kind in ("eager", "static"):
        engine = Engine(tiny, DecodingConfig(method=method, capacity=8, runner=kind))
        assert engine.runner.kind == kind
        state = engine.new_state()
        outs = []
        for prompt, ref in zip(PROMPTS, refs):
            out = engine.generate(prompt, GenerationParams(max_new_tokens=40), state=state)
            assert out.token_ids == ref.token_ids, (kind, method, prompt)
            assert out.finish_reason == ref.finish_reason
            outs.append(out)
        engine.free_state(state)
        state_outputs[kind] = outs
        if kind == "static":
            assert engine.runner._free_slots == [0]  # every row gave its slot back
    if method != "ar":  # the static runner really verified drafts (not only roots)
        assert sum(o.stats.emitted_tokens - o.stats.steps for o in state_outputs["static"]) > 0


@pytest.mark.parametrize("method", ["ar", "racer"])
def test_engine_seeded_sampling_identical_on_both_runners(method):
    bundle = tiny_bundle(head_scale=3.0, eos=False)
    p = dict(max_new_tokens=40, temperature=1.0, top_p=0.95, top_k=20)
    tokens = {}
    for kind in ("eager", "static"):
        engine = Engine(bundle, DecodingConfig(method=method, capacity=8, runner=kind))
        tokens[kind] = [engine.generate("abcab", GenerationParams(seed=s, **p)).token_ids for s in (1, 2)]
    assert tokens["eager"] == tokens["static"]
    assert tokens["static"][0] != tokens["static"][1]  # the seeds matter, so the equality is not vacuous


def test_runner_fields_leave_the_default_config_hash_unchanged():
    default = DecodingConfig()
    dump = default.model_dump()
    assert "runner" not in dump and "compile" not in dump
    assert default.config_hash() == "b2cb380b125a1624"  # the hash before the fields existed
    assert DecodingConfig(runner="auto", compile="auto").config_hash() == default.config_hash()
    assert DecodingConfig(method="pld", capacity=8, runner="auto").config_hash() == "c76cd67bac829d81"
    # non-default values are recorded (the dump says how rows were produced)
    static = DecodingConfig(runner="static")
    assert static.model_dump()["runner"] == "static" and "compile" not in static.model_dump()
    assert DecodingConfig(compile="on").model_dump()["compile"] == "on"
    # ... but they are output-neutral: rows from either runner carry the same config hash
    assert static.config_hash() == DecodingConfig(runner="eager", compile="on").config_hash() == default.config_hash()
    assert DecodingConfig(capacity=8).config_hash() != default.config_hash()
    with pytest.raises(ValueError):
        DecodingConfig(runner="fast")
    with pytest.raises(ValueError):
        DecodingConfig(compile="yes")


# ---------------------------------------------------------------- 8. context clipping


@pytest.mark.parametrize("method", ["ar", "racer"])
def test_engine_on_static_runner_stops_at_the_context(method):
    ctx = 64
    bundle = tiny_bundle(context_length=ctx, eos=False)
    prompt = "abcabcabcabcabcabcabcabcabcabcabcabcabca"  # 40 tokens: 24 free positions
    params = GenerationParams(max_new_tokens=100)
    engine = Engine(bundle, DecodingConfig(method=method, capacity=8, runner="static"))
    out = engine.generate(prompt, params)
    ref = generate_reference(bundle, prompt, params)
    assert ref.finish_reason == "context"
    assert out.finish_reason == "context"
    assert out.output_tokens == ctx - len(prompt) and out.token_ids == ref.token_ids
    runner = engine.runner
    assert runner.max_len <= ctx + runner.buckets[-1]
    assert runner.kv.shape[4] == runner.max_len


def test_auto_capacity_on_a_short_context_model_on_the_static_runner():
    """``measure_cost_curve`` prefills 256 context tokens by default; on a model whose context is shorter
    the measurement must still run on the static runner (whose KV buffer is bounded by the context)."""
    ctx = 64
    bundle = tiny_bundle(context_length=ctx, eos=False)
    engine = Engine(bundle, DecodingConfig(method="racer", capacity="auto", auto_capacities=[4, 8],
                                           runner="static"))
    assert set(engine.cost_curve_ms) == {1, 4, 8} | {s for s in engine.runner.step_sizes(8) if s >= 4}
    prompt = "abcabcabcabcabcabcab"
    out = engine.generate(prompt, GenerationParams(max_new_tokens=100))
    ref = generate_reference(bundle, prompt, GenerationParams(max_new_tokens=100))
    assert out.finish_reason == "context" and out.token_ids == ref.token_ids
    assert engine.runner.max_len <= ctx + engine.runner.buckets[-1]


# ---------------------------------------------------------------- 7. the families' own pieces


def test_sliding_window_layers_see_only_their_window():
    """On Gemma 3 and Mistral with a window of 16, a row 40 positions in is unchanged by a change to a token more
    than 16 positions behind it only where every layer is sliding (Mistral); Gemma 3's full layers still see it.
    And a tree longer than the window is refused (its own rows could fall out of the window)."""
    for family, changes in (("mistral_window", False), ("gemma3_text", True)):
        model = make_model(family, seed=2)
        runner = StaticRunner(bundle_of(model), buckets=BUCKETS)
        prompt = rand_tokens(torch.Generator().manual_seed(2), 40)
        a, _ = runner.prefill(prompt, cache=runner.new_cache(48), topk=0)
        other = list(prompt)
        other[3] = 3 if other[3] != 3 else 4  # 36 positions behind the last row: outside a window of 16
        b, _ = runner.prefill(other, cache=runner.new_cache(48), topk=0)
        assert (not torch.equal(a, b)) == changes, family
        torch.testing.assert_close(b, oracle(model, other)[-1], atol=ATOL, rtol=RTOL)
    runner = StaticRunner(bundle_of(make_model("mistral_window")), buckets=(1, 2, 4, 8, 16, 32))
    cache = runner.new_cache(80)
    runner.prefill(rand_tokens(torch.Generator().manual_seed(3), 20), cache=cache, topk=0)
    chain = Draft(list(range(3, 20)), [-1] + list(range(16)), [0] * 17)
    with pytest.raises(ValueError, match="sliding window"):
        runner.verify_tree(flatten_tree(chain, committed_len=20, device=runner.device, dtype=runner.dtype),
                           cache=cache)


def test_moe_experts_dense_and_routed_give_the_same_sums():
    """``moe_forward``'s graph-safe dense form (every expert over every row, weight 0 where not picked) equals the
    routed form (each expert over its picked rows) it stands in for under a CUDA graph, and both equal the
    transformers block; the router really picks different experts for different rows."""
    from racer_batch.engine.decoder_ops import moe_forward

    for family in ("qwen3_moe", "mixtral"):
        model = make_model(family, seed=9)
        runner = StaticRunner(bundle_of(model), matmul="torch")
        block = model.model.layers[1].mlp
        moe = runner.weights.layers[1].moe
        h = torch.randn(12, 64, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            want = block(h.view(1, 12, 64))[0]
            routed = moe_forward(h, moe, runner.ops.linear, "silu")
            dense = moe_forward(h, moe, runner.ops.linear, "silu", dense=True)
            picked = torch.topk(torch.nn.functional.linear(h, moe.router), moe.top_k, dim=-1).indices
        assert len(set(map(tuple, picked.sort(dim=-1).values.tolist()))) > 1, family
        torch.testing.assert_close(routed, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(dense, routed, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe", "phi3"])
def test_engine_greedy_equals_reference_on_the_new_families(family):
    """RACER greedy through the whole engine on the static runner (our kernels where they build) equals the
    transformers reference on Gemma 3, Qwen3-MoE and Phi-3 tiny models, past Gemma's window."""
    model = make_model(family, seed=11)
    bundle = bundle_of(model)
    params = GenerationParams(max_new_tokens=40)
    eng = Engine(bundle, DecodingConfig(method="racer", capacity=8, runner="static"))
    assert eng.runner.kind == "static"
    drafted = 0
    for prompt in PROMPTS:
        want = generate_reference(bundle, prompt, params).token_ids
        got = eng.generate(prompt, params)
        assert got.token_ids == want, (family, prompt)
        drafted += got.stats.emitted_tokens - got.stats.steps
    assert drafted > 0  # drafts were accepted, not only roots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_host_view_is_the_cache_memory_and_follows_a_new_buffer(dtype):
    """``KVCache.host_view`` (what the native commit keeps rows in): the cache's own memory (float32 as is, other
    dtypes as bytes, each position's row the same bytes), the same array while the buffer stays, a new one after
    it grows."""
    from racer_batch.engine.kv_cache import KVCache

    pool = KVCache((2, 3, 4), dtype=dtype, device=torch.device("cpu"), context_length=64, pad=4, slots=2,
                   max_slots=4, start_len=8)
    view = pool.host_view()
    assert view.shape[:5] == tuple(pool.kv.shape[:5]) and view.nbytes == pool.kv.numel() * pool.kv.element_size()
    assert view.ctypes.data == pool.kv.data_ptr() and pool.host_view() is view
    with torch.inference_mode():
        pool.kv[1, 0, 1, 2, 5] = torch.arange(4, dtype=dtype) + 1
    row = view[1, 0, 1, 2, 5]
    assert row.tobytes() == pool.kv[1, 0, 1, 2, 5].contiguous().view(torch.uint8).numpy().tobytes()
    assert pool.grow(40)
    again = pool.host_view()
    assert again is not view and again.ctypes.data == pool.kv.data_ptr() and again.shape[4] == pool.max_len
