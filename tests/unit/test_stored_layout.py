"""weights/stored.py: the file order that puts fused groups side by side, and the one-mapping safetensors reader."""

from __future__ import annotations

import pytest
import torch

from racer_batch.weights.stored import file_order, map_safetensors


def test_file_order_puts_fused_groups_side_by_side_in_the_decoders_order():
    names = [f"model.layers.{i}.{m}.{p}.weight" for i in (0, 1, 10)
             for m, p in (("mlp", "down_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("self_attn", "k_proj"),
                          ("self_attn", "o_proj"), ("self_attn", "q_proj"), ("self_attn", "v_proj"))]
    names += ["model.embed_tokens.weight", "lm_head.weight"]
    order = file_order(names)
    assert sorted(order) == sorted(names)
    for i in (0, 1, 10):
        at = {n.split(".")[-2]: order.index(n) for n in order if n.startswith(f"model.layers.{i}.")}
        assert at["k_proj"] == at["q_proj"] + 1 and at["v_proj"] == at["q_proj"] + 2
        assert at["up_proj"] == at["gate_proj"] + 1
    # the ranks as zero-padded keys sort in the same order (safetensors lays out a dtype's tensors by key)
    keys = [f"{rank:06d}:{n}" for rank, n in enumerate(order)]
    assert sorted(keys) == keys


def test_map_safetensors_gives_views_of_one_mapping_equal_to_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {"b": torch.randn(3, 5, generator=gen), "a": torch.randint(0, 255, (7, 2), dtype=torch.uint8),
               "c": torch.randn(4, generator=gen).half(), "d": torch.arange(6, dtype=torch.int64).view(2, 3)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    meta, got = map_safetensors(path)
    want = load_file(str(path))
    assert meta == {"k": "v"} and got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match="does not fit"):
        map_safetensors(path)
    path.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file"):
        map_safetensors(path)
