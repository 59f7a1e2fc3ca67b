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


def test_the_default_loads_without_transformers_model_classes_and_equals_the_hf_module_path(smol):
    """The CPU default is a plain bundle (weights/plain.py: no HF model until asked for), and a runner over its
    weights by name gives the logits of a runner over the HF model's modules with the same stored weights."""
    from racer_batch import load_model

    assert smol.model is None or smol.stored is not None  # a test before may have asked for the HF model
    plain = load_model("smollm2-135m", device="cpu", dtype="float32")
    assert plain.model is None and plain.config.model_type == "llama" and plain.folder is not None
    assert type(plain.tokenizer).__name__ == "PlainTokenizer" and plain.vocab_size == 49152
    runner = StaticRunner(plain)
    assert runner.matmul == "stored" and runner.weights.rotary.__class__.__name__ == "DefaultRotary"
    modules = load_model("smollm2-135m", device="cpu", dtype="float32")
    modules.materialize()  # the HF model over the same stored weights: DecoderWeights.of reads its modules
    assert modules.model is not None and modules.vocab_size == plain.vocab_size
    other = StaticRunner(modules)
    assert other.matmul == "stored" and other.weights.rotary is modules.model.get_decoder().rotary_emb
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, plain.vocab_size, (150,), generator=gen).tolist()
    tree = flatten_tree(_draft(gen, 12, plain.vocab_size), committed_len=150, device="cpu", dtype=torch.float32)
    got = []
    for r in (runner, other):
        cache = r.new_cache(200)
        logits, top = r.prefill(prompt, cache=cache, topk=4)
        got.append((logits.clone(), top.clone(), r.verify_tree(tree, cache=cache).clone()))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


def test_the_plain_tokenizer_is_the_auto_tokenizer(smol):
    """The default's tokenizer over the ``tokenizers`` library alone (weights/tokenizer.py) encodes, renders chats
    (the template's own system prompt, a given one, several turns) and decodes as ``AutoTokenizer`` does, special
    tokens in user text included, and names the same special tokens, ids and vocabulary."""
    from transformers import AutoTokenizer

    from racer_batch.benchdata import smoke_prompts
    from racer_batch.weights.plain import load_tokenizer
    from racer_batch.weights.tokenizer import PlainTokenizer

    folder = load_model_folder()
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, PlainTokenizer)
    assert ours.chat_template == auto.chat_template and ours.special_tokens_map == auto.special_tokens_map
    assert ours.all_special_tokens == auto.all_special_tokens and ours.eos_token_id == auto.eos_token_id
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    for token in ("<|im_end|>", "<|im_start|>", "hello", "no-such-token-here"):
        assert ours.convert_tokens_to_ids(token) == auto.convert_tokens_to_ids(token)
    texts = [t for item in smoke_prompts() for t in item.turns] + ["x <|im_end|> y <|im_start|>", "  tabs\tand\nlines "]
    for i, text in enumerate(texts):
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == \
                auto(text, add_special_tokens=special)["input_ids"]
        chats = [[{"role": "user", "content": text}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
                 [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": texts[i - 1]},
                  {"role": "user", "content": text}]]
        for chat in chats:
            for gen in (True, False):
                assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                    auto.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            a = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
            assert a == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
            for skip in (True, False):
                assert ours.decode(a, skip_special_tokens=skip) == auto.decode(a, skip_special_tokens=skip)
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):  # any ids, the added (special) ones among them
        ids = torch.randint(0, len(auto), (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
        ids[0] = int(torch.randint(0, 17, (1,), generator=gen))
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)


def load_model_folder():
    from racer_batch.models import gguf_source, stored_folder

    return stored_folder(gguf_source("smollm2-135m"))


def test_a_worker_loading_the_default_imports_no_transformers_model_classes():
    """What a generation worker imports to load the default and build its engine: no transformers at all (its
    model families, sympy, torch._dynamo and scipy cost ~130-150 MB of a worker's memory, its tokenizer class
    ~36 MB more than the ``tokenizers`` library alone; benchmarks/memory.py)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import racer_batch.service.execution.actors\n"
        "from racer_batch import load_model\n"
        "from racer_batch.engine import Engine\n"
        "from racer_batch.values import DecodingConfig, GenerationParams\n"
        "b = load_model('smollm2-135m')\n"
        "e = Engine(b, DecodingConfig(method='racer', capacity=4))\n"
        "r = e.generate([{'role': 'user', 'content': 'Count to five.'}], GenerationParams(max_new_tokens=8))\n"
        "assert len(r.token_ids) > 0\n"
        "heavy = [m for m in sys.modules if m.startswith(('transformers.models.llama', 'sympy', 'torch._dynamo',\n"
        "         'scipy', 'transformers.modeling_utils', 'transformers.models.auto'))]\n"
        "print('HEAVY', sorted(heavy)[:8], b.model is None, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HEAVY [] True False" in out.stdout, out.stdout[-2000:]


def test_fused_weights_are_views_of_the_one_file_mapping(smol):
    """Layout 2 (weights/stored.py ``save``): q/k/v and gate/up lie side by side in the file, so the runner's fused
    weights are views of the file's one mapping, not copies (43.5 MB of SmolLM2's weights were copied before)."""
    import os

    from racer_batch import load_model

    plain = load_model("smollm2-135m", device="cpu", dtype="float32")
    size = os.path.getsize(plain.folder / "weights.safetensors")
    runner = StaticRunner(plain)
    fused = [lin.stored for layer in runner.weights.layers for lin in (layer.qkv, layer.gate_up)]
    assert all(len(parts) == 1 for parts in fused)  # one kernel call each
    storages = {p.packed.untyped_storage().data_ptr() for layer in runner.weights.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down) for p in lin.stored}
    assert len(storages) == 1
    one = runner.weights.layers[0].qkv.stored[0].packed.untyped_storage()
    assert one.nbytes() == size


def test_a_folder_of_the_first_layout_reads_to_the_same_weights(smol, tmp_path):
    """A folder written before layout 2 (one file tensor per weight, keyed by its first name; no ``layout`` in
    the metadata) reads to equal weights, and a runner over them gives the same logits."""
    import json
    import shutil

    from safetensors.torch import save_file

    from racer_batch.weights import stored
    from racer_batch.weights.plain import PlainConfig

    folder = load_model_folder()
    new = stored.read(folder)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    tensors, meta, first = dict(new.tensors), {}, {}
    for name, w in new.weights.items():
        owner = first.setdefault(id(w), name)
        if owner == name:
            tensors[name] = w.packed.clone()
        meta[name] = [owner, w.fmt, w.n, w.k, w.source]
    save_file(tensors, str(tmp_path / "weights.safetensors"),
              metadata={"stored": json.dumps(meta), "expanded": json.dumps(new.expanded)})
    old = stored.read(tmp_path)
    assert old.weights.keys() == new.weights.keys() and old.tensors.keys() == new.tensors.keys()
    for name, w in new.weights.items():
        assert torch.equal(old.weights[name].packed, w.packed) and old.weights[name].fmt == w.fmt
    assert old.weights["lm_head.weight"] is old.weights["model.embed_tokens.weight"]
    from racer_batch.models import ModelBundle

    config = PlainConfig.read(folder)
    got = []
    for weights, where in ((new, folder), (old, tmp_path)):
        bundle = ModelBundle(model=None, tokenizer=smol.tokenizer, name="x", eos_ids=smol.eos_ids,
                             context_length=2048, device="cpu", dtype="float32", weights="as_stored",
                             stored=weights, config=config, folder=where)
        r = StaticRunner(bundle)
        cache = r.new_cache(64)
        got.append(r.prefill(list(range(5, 45)), cache=cache, topk=4)[0].clone())
    assert torch.equal(got[0], got[1])


def test_a_cut_cached_copy_is_a_model_load_error_that_says_how_to_rebuild(tmp_path, monkeypatch):
    """A cached as-stored folder whose weights file was cut (disk full, a killed copy) is refused with the
    folder named and the fix (delete it), not an internal error."""
    import shutil

    from racer_batch import models

    src = load_model_folder()
    monkeypatch.setenv("RACER_BATCH_CACHE", str(tmp_path))
    folder = tmp_path / "models" / src.name
    shutil.copytree(src, folder)
    data = (folder / "weights.safetensors").read_bytes()
    (folder / "weights.safetensors").write_bytes(data[: len(data) // 2])
    assert models.stored_folder(models.gguf_source("smollm2-135m")) == folder  # the cut copy is the one used
    with pytest.raises(models.ModelLoadError, match="delete that folder"):
        models.load_model("smollm2-135m", device="cpu", dtype="float32")
