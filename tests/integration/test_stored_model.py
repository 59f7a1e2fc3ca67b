"""The default model as stored (issue 31): SmolLM2-135M's Q4_1 GGUF weights kept in their blocks give the float32
path's logits bit for bit, prefill and draft-tree verify, one stream and a flat batch of four; the bundle loads
as stored by default on the CPU with the float32 path's tokenizer, EOS ids and weights (expanded), at under a
fifth of its weight bytes. Output equality with HF generate on the 24 smoke prompts at B = 1 .. 16 is in
test_equivalence.py, which runs on this same default."""

from __future__ import annotations

import pytest
import torch

from racer_batch.engine.kernels import cpu_ops
from racer_batch.engine.static_runner import StaticRunner
from racer_batch.engine.tree import FlatTrees, flatten_tree

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(cpu_ops() is None, reason="stored weights run on our CPU kernels, absent here")]


def test_the_cpu_default_is_as_stored_with_the_float32_paths_tokenizer_and_weights(smol, smol_f32):
    assert smol.weights == "as_stored" and smol_f32.weights == "float32" and smol_f32.stored is None
    assert smol.eos_ids == smol_f32.eos_ids and smol.context_length == smol_f32.context_length
    assert smol.tokenizer.chat_template == smol_f32.tokenizer.chat_template
    msgs = [{"role": "user", "content": "Name three prime numbers."}]
    assert smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True) == \
        smol_f32.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    dense = sum(p.numel() * 4 for p in smol_f32.model.parameters())
    assert smol.stored.nbytes < dense / 5  # Q4_1 / Q8_0 blocks, not float32
    assert {w.source for w in smol.stored.weights.values()} == {"Q4_1", "Q8_0"}  # token_embd (tied head) is Q8_0
    want = smol_f32.model.state_dict()
    for name, w in smol.stored.weights.items():
        assert torch.equal(w.expanded().reshape(want[name].shape), want[name]), name


def _draft(gen: torch.Generator, size: int, vocab: int):
    """A random draft tree of ``size`` nodes over the model's vocabulary."""
    from racer_batch.drafters.base import Draft

    toks = torch.randint(3, vocab, (size,), generator=gen).tolist()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    return Draft(toks, parents, [0] * size)


def test_prefill_and_tree_verify_logits_are_bit_identical_to_the_float32_path(smol, smol_f32):
    """The same prompts and random draft trees through a StaticRunner over each bundle: every logit equal, a
    prompt's prefill (its top-k too), one stream's tree at a time and four streams in one flat verify (1 .. 66
    rows, so both GEMM row blockings and the tied Q8_0 output layer run)."""
    runners = {"stored": StaticRunner(smol), "f32": StaticRunner(smol_f32)}
    assert runners["stored"].matmul == "stored" and runners["f32"].matmul == "small_gemm"
    assert runners["stored"].packed_bytes == 0  # no float32 panels beside the blocks
    vocab = smol.vocab_size
    out: dict[str, list[torch.Tensor]] = {}
    for name, runner in runners.items():
        gen = torch.Generator().manual_seed(0)
        got: list[torch.Tensor] = []
        trees, caches = [], []
        for n, t in zip([37, 5, 120, 300], [9, 1, 40, 16]):
            cache = runner.new_cache(n + 64)
            logits, top = runner.prefill(torch.randint(3, vocab, (n,), generator=gen).tolist(), cache=cache, topk=4)
            got += [logits.clone(), top.clone()]
            trees.append(flatten_tree(_draft(gen, t, vocab), committed_len=n, device="cpu", dtype=torch.float32))
            caches.append(cache)
        for tree, cache in zip(trees, caches):
            got.append(runner.verify_tree(tree, cache=cache).clone())
        got.append(runner.verify_flat(FlatTrees.of(list(zip(trees, caches)))).clone())
        out[name] = got
    assert out["stored"][-1].shape == (66, vocab)
    for i, (a, b) in enumerate(zip(out["stored"], out["f32"], strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), i
