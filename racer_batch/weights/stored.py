"""Weights kept as a GGUF file stores them (issue 31): the blocks' bits rearranged once into panels, expanded in
registers by our CPU kernels with the de-quantiser's own operations, so a forward reads 4-8 bits per weight and
gives the float32 copy's results bit for bit.

A GGUF quantised tensor ``[N, K]`` is ``N`` rows of blocks along ``K``. ``pack`` turns one into the layout of
``cpu_kernels.cpp`` (its "GEMM over weights as a GGUF file stores them" section): panels of 16 rows, each a run
of 32-``k`` groups holding the group's integers and the numbers that multiply them. The formats and the GGUF
types they take:

==============  =========================  ==============================================================
format          GGUF types                 one weight (gguf-py's ``dequantize``, which transformers uses)
==============  =========================  ==============================================================
``F16``         F16                        the half converted (exact)
``I8``          Q8_0, Q6_K                 ``scale * q`` (Q8_0: ``d``; Q6_K: ``d * scale_16``, exact in
                                           float32; the product rounded once)
``U4H``         Q4_1                       ``d * q + m`` (``d``, ``m`` fp16; the product is exact, so one
                                           rounding: an FMA gives the same number)
``U4F``         Q4_K                       ``(d * sc) * q - dmin * m`` (both products exact, one rounding)
==============  =========================  ==============================================================

Any other type (Q5_0, Q5_K, Q3_K, the IQ types, ...) is de-quantised to float32 by gguf-py, tensor by tensor, as
the float32 path does; ``StoredWeight.expanded`` gives the float32 tensor of any stored weight (tests, the
eager oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

NR = 16  # rows per panel (cpu_kernels.cpp NR)
GROUP_K = 32  # k per group

# cpu_kernels.cpp STORED_* codes
F16, I8, U4H, U4F = 1, 2, 3, 4
FORMAT_NAMES = {F16: "F16", I8: "I8", U4H: "U4H", U4F: "U4F"}
_GROUP_BYTES = {F16: GROUP_K * NR * 2, I8: 2 * NR * 4 + GROUP_K * NR, U4H: 2 * NR * 2 + GROUP_K * NR // 2,
                U4F: 2 * NR * 4 + GROUP_K * NR // 2}

# GGML type ids (gguf.GGMLQuantizationType) with a stored format
GGML_F32, GGML_F16, GGML_Q4_1, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K = 0, 1, 3, 8, 12, 14
STORED_TYPES = {GGML_F16: F16, GGML_Q4_1: U4H, GGML_Q8_0: I8, GGML_Q4_K: U4F, GGML_Q6_K: I8}
_TYPE_NAMES = {GGML_F16: "F16", GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0", GGML_Q4_K: "Q4_K", GGML_Q6_K: "Q6_K"}
QK_K = 256


@dataclass
class StoredWeight:
    """One weight ``[N, K]`` in a stored format.

    Attributes:
        packed: ``uint8 [ceil(N / 16), K / 32, group bytes]``, the layout ``cpu_kernels.cpp`` reads.
        fmt: ``F16``, ``I8``, ``U4H`` or ``U4F``. source: the GGUF type it came from (e.g. ``Q4_1``).
        n, k: the weight's shape.
    """

    packed: torch.Tensor
    fmt: int
    n: int
    k: int
    source: str

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [R]`` as float32 ``[R, K]`` (an embedding lookup), bit for bit the de-quantised rows."""
        from ..engine.kernels import cpu_ops

        return cpu_ops().stored_rows(self.packed, self.fmt, self.n, ids)

    def expanded(self) -> torch.Tensor:
        """The whole weight as float32 ``[N, K]`` (tests and oracles only: it costs the float32 copy)."""
        return self.rows(torch.arange(self.n, dtype=torch.int64))


def fuse_stored(parts: list[StoredWeight]) -> Optional[StoredWeight]:
    """One weight of ``parts`` (``[n_i, K]`` each) stacked along the output features (fused q/k/v, gate/up), or
    None where one kernel call cannot run them (formats or K differ, or a part but the last has ``n_i`` not a
    multiple of 16, so its rows would share a panel with the next part's). Like ``decoder_ops.fuse_params``, the
    parts are re-pointed at their panels of the result, so fusing costs no memory; parts already consecutive
    panels of one storage (a second runner over the same model) are reused."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(p.fmt != first.fmt or p.k != first.k for p in parts) or any(p.n % NR for p in parts[:-1]):
        return None
    n = sum(p.n for p in parts)
    source = "+".join(dict.fromkeys(p.source for p in parts))
    offset, consecutive = first.packed.storage_offset(), True
    for p in parts:
        consecutive = consecutive and p.packed.is_contiguous() and p.packed.storage_offset() == offset and \
            p.packed.untyped_storage().data_ptr() == first.packed.untyped_storage().data_ptr()
        offset += p.packed.numel()
    panels = sum(p.packed.shape[0] for p in parts)
    if consecutive:
        packed = first.packed.as_strided((panels, *first.packed.shape[1:]), first.packed.stride())
        return StoredWeight(packed, first.fmt, n, first.k, source)
    fused = torch.cat([p.packed for p in parts], dim=0)
    row = 0
    for p in parts:
        p.packed = fused[row : row + p.packed.shape[0]]
        row += p.packed.shape[0]
    return StoredWeight(fused, first.fmt, n, first.k, source)


def can_store(ggml_type: int, shape: tuple[int, int]) -> bool:
    """Whether a GGUF tensor of this type and ``[N, K]`` shape runs as stored (a 2-D weight, K a multiple of 32)."""
    return ggml_type in STORED_TYPES and len(shape) == 2 and shape[1] % GROUP_K == 0


def pack(raw: np.ndarray, ggml_type: int, n: int, k: int, row_order: Optional[np.ndarray] = None) -> StoredWeight:
    """Rearrange a GGUF tensor's blocks into the kernels' panels.

    Args:
        raw: the tensor's bytes as GGUF keeps them, ``uint8 [N, bytes per row]`` (F16: ``[N, K]`` halves, any
            view of them).
        ggml_type: its GGML type id (``STORED_TYPES``).
        n, k: its shape ``[N, K]`` (``K`` a multiple of 32).
        row_order: ``[N]`` GGUF row of each output row (a loader's row permutation, e.g. Llama's q/k heads), or
            None.
    Raises:
        ValueError: a type without a stored format, or a shape that does not match the bytes.
    """
    if ggml_type not in STORED_TYPES or k % GROUP_K:
        raise ValueError(f"GGML type {ggml_type} with K={k} has no stored format")
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    if row_order is not None:
        raw = raw[np.asarray(row_order)]
    fmt = STORED_TYPES[ggml_type]
    g = k // GROUP_K
    if ggml_type == GGML_F16:
        if raw.shape[1] != 2 * k:
            raise ValueError(f"F16 tensor [{n}, {k}] has {raw.shape[1]} bytes per row")
        parts = [_panel_k(raw.view(np.uint16).reshape(n, g, GROUP_K), n)]
    elif ggml_type in (GGML_Q4_1, GGML_Q4_K):
        a, c, q = _q4_1(raw, n, k) if ggml_type == GGML_Q4_1 else _q4_k(raw, n, k)
        parts = [_panel_rows(a, n), _panel_rows(c, n), _nibbles(q, n)]
    else:
        scale, q = _q8_0(raw, n, k) if ggml_type == GGML_Q8_0 else _q6_k(raw, n, k)
        parts = [_panel_rows(scale, n), _panel_k(q, n)]
    packed = np.concatenate([p.reshape(*p.shape[:2], -1).view(np.uint8) for p in parts], axis=2)
    assert packed.shape[2] == _GROUP_BYTES[fmt], (packed.shape, fmt)
    return StoredWeight(torch.from_numpy(np.ascontiguousarray(packed)), fmt, n, k, _TYPE_NAMES[ggml_type])


def _blocks(raw: np.ndarray, n: int, k: int, per: int, nbytes: int, name: str) -> np.ndarray:
    if raw.shape[1] * per != k * nbytes:
        raise ValueError(f"{name} tensor [{n}, {k}] has {raw.shape[1]} bytes per row, not {k // per * nbytes}")
    return raw.reshape(n, k // per, nbytes)


def _q4_1(raw, n, k):
    """Q4_1 block (32): d fp16, m fp16, 16 bytes (elements 0-15 low nibbles, 16-31 high). -> a, c fp16 [N, G]
    and q uint8 [N, G, 32]."""
    b = _blocks(raw, n, k, 32, 20, "Q4_1")
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
    qs = b[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return d, m, q


def _q4_k(raw, n, k):
    """Q4_K super-block (256): d, dmin fp16, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (per 64
    elements: 32 bytes, low nibbles first). -> a = d * sc, c = -(dmin * m) float32 [N, G], q [N, G, 32]."""
    b = _blocks(raw, n, k, QK_K, 144, "Q4_K")
    nb = b.shape[1]
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)  # [N, nb, 1]
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16).astype(np.float32)
    s = b[..., 4:16].reshape(n, nb, 3, 4)
    sd, sm, smd = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = np.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1)  # [N, nb, 8]
    mn = np.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
    a = (d * sc.astype(np.float32)).reshape(n, nb * 8)
    c = -(dmin * mn.astype(np.float32)).reshape(n, nb * 8)
    qs = b[..., 16:144].reshape(n, nb, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb * 8, 32)
    return a, c, q


def _q8_0(raw, n, k):
    """Q8_0 block (32): d fp16, 32 int8. -> scale float32 [N, G, 2] (the same d for k 0-15 and 16-31), q int8."""
    b = _blocks(raw, n, k, 32, 34, "Q8_0")
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)  # [N, G, 1]
    return np.repeat(d, 2, axis=2), np.ascontiguousarray(b[..., 2:34]).view(np.int8)


def _q6_k(raw, n, k):
    """Q6_K super-block (256): 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales (per 16 elements),
    d fp16. -> scale = d * scale_16 float32 [N, G, 2], q = 6-bit value - 32 int8 [N, G, 32]."""
    b = _blocks(raw, n, k, QK_K, 210, "Q6_K")
    nb = b.shape[1]
    ql = b[..., 0:128].reshape(n, nb, 2, 1, 64)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # [N, nb, 16]
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16).astype(np.float32)  # [N, nb, 1]
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, nb, 8, 32)
    hi = np.concatenate([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=3).reshape(n, nb, 8, 32)
    q = ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).reshape(n, nb * 8, 32)
    return (d * sc).reshape(n, nb * 8, 2), q


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    rows = -(-n // NR) * NR
    if rows == n:
        return x
    return np.concatenate([x, np.zeros((rows - n, *x.shape[1:]), dtype=x.dtype)])


def _panel_rows(v: np.ndarray, n: int) -> np.ndarray:
    """``[N, G(, s)]`` per-row numbers -> ``[P, G, (s,) 16]``."""
    v = _pad(v, n)
    p = v.shape[0] // NR
    v = v.reshape(p, NR, *v.shape[1:])
    return np.ascontiguousarray(np.moveaxis(v, 1, -1))


def _panel_k(q: np.ndarray, n: int) -> np.ndarray:
    """``[N, G, 32]`` -> ``[P, G, 32, 16]``."""
    return _panel_rows(q, n)


def _nibbles(q: np.ndarray, n: int) -> np.ndarray:
    """``[N, G, 32]`` 4-bit values -> ``[P, G, 16 pairs, 16]`` bytes (k = 2i low nibble, 2i + 1 high)."""
    t = _panel_rows(q.astype(np.uint8), n)  # [P, G, 32, 16]
    return np.ascontiguousarray(t[:, :, 0::2, :] | (t[:, :, 1::2, :] << 4))


# ---- a GGUF file's tensors into a HF model skeleton, the quantised ones kept as stored ----

# transformers' GGUF tensor processors whose ``process`` only permutes a weight's rows (Llama's q/k heads) or
# changes 1-D tensors (Gemma's norms): a stored weight takes the permutation as its ``row_order``. Another
# processor (MoE expert splitting, Bloom's reshapes, ...) refuses as-stored loading.
_ROW_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor")


class StoredUnsupported(ValueError):
    """A GGUF file whose tensors cannot be kept as stored (the message says why); it loads as float32."""


@dataclass
class StoredModel:
    """What ``load_gguf`` put into a model: ``weights`` maps the name of each parameter kept as stored (a meta
    tensor in the model until ``materialize``; tied names share one weight) to its weight; ``expanded`` names the
    GGUF tensors of a quantised type without a stored format, de-quantised to float32 instead (their GGUF
    type names); ``tensors`` (from ``read``): every other parameter by name, float32, as the file holds it."""

    weights: dict[str, StoredWeight]
    expanded: dict[str, str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in {id(w): w for w in self.weights.values()}.values())

    def tree(self, prefix: str = "") -> "NamedTree":
        """The parameters below ``prefix`` as attributes (``NamedTree``): stored ones as ``StoredWeight``."""
        return NamedTree({**self.tensors, **self.weights}, prefix)


class NamedTree:
    """Parameters named as a HF model names them (``model.layers.0.self_attn.q_proj.weight``), read by attribute
    as from the model's modules: ``tree.layers[0].self_attn.q_proj.weight``. A path no name starts with raises
    AttributeError (so ``hasattr`` tells a layout apart), except a missing ``bias``, which is None as on a HF
    ``Linear`` without one; ``layers`` gives the list of numbered sub-trees. Lets ``engine.decoder.DecoderWeights``
    read an as-stored model's weights without building its HF module tree (transformers' modeling code costs a
    worker ~130 MB of memory; issue 31)."""

    def __init__(self, params: dict[str, Any], prefix: str = "") -> None:
        self._params, self._prefix = params, prefix

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        path = self._prefix + name
        if path in self._params:
            return self._params[path]
        if name == "layers":
            n = 0
            while any(k.startswith(f"{path}.{n}.") for k in self._params):
                n += 1
            if n:
                return [NamedTree(self._params, f"{path}.{i}.") for i in range(n)]
        if any(k.startswith(path + ".") for k in self._params):
            return NamedTree(self._params, path + ".")
        if name == "bias":
            return None
        raise AttributeError(f"no parameter named {path!r} or below it")


def empty_model(config: Any) -> Any:
    """A causal LM of ``config`` with every parameter on the meta device (no memory) and its buffers (rotary
    tables, Gemma's embedding scale) computed on the CPU, in float32, in eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def load_gguf(path: Any, model: Any) -> StoredModel:
    """Fill ``model`` (``empty_model``) with the tensors of the GGUF file ``path``, as transformers' GGUF loader
    names and transforms them (``get_gguf_hf_weights_map`` and the family's tensor processor): each 2-D weight
    of a type with a stored format (``STORED_TYPES``) is packed as stored and its parameter stays on the meta
    device; every other tensor is de-quantised by gguf-py and set as a float32 parameter, bit for bit what the
    float32 path loads.

    Raises:
        StoredUnsupported: the family's tensor processor does more than permute rows, or a tensor's shape
            disagrees with the model's parameter.
    """
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(str(path))
    arch = read_field(reader, "general.architecture")[0]
    cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if cls.__name__ not in _ROW_PROCESSORS:
        raise StoredUnsupported(f"GGUF architecture {arch!r} loads through transformers' {cls.__name__}, which "
                                "changes tensors beyond a row permutation")
    processor = cls(config=model.config.to_dict())
    names = _weights_map(model, processor, get_gguf_hf_weights_map)
    params = dict(model.named_parameters(remove_duplicate=False))
    stored: dict[str, StoredWeight] = {}
    expanded: dict[str, str] = {}
    for tensor in reader.tensors:
        hf = names.get(tensor.name)
        if hf is None or hf not in params:
            continue
        param = params[hf]
        shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))  # GGUF lists dimensions innermost first
        if tuple(param.shape) != shape:
            raise StoredUnsupported(f"GGUF tensor {tensor.name} has shape {shape}, the model's {hf} "
                                    f"{tuple(param.shape)}")
        gtype = int(tensor.tensor_type)
        if len(shape) == 2 and can_store(gtype, shape):
            n, k = shape
            order = processor.process(weights=np.arange(n, dtype=np.int64).reshape(n, 1), name=tensor.name).weights
            order = np.asarray(order).reshape(-1)
            if not np.array_equal(np.sort(order), np.arange(n)):
                raise StoredUnsupported(f"{cls.__name__} changes {tensor.name} beyond a row permutation")
            stored[hf] = pack(tensor.data, gtype, n, k, None if np.array_equal(order, np.arange(n)) else order)
            continue
        if gtype not in (GGML_F32, GGML_F16) and len(shape) == 2:
            expanded[tensor.name] = tensor.tensor_type.name
        w = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
        value = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(shape)
        _set_param(model, hf, value)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # lm_head is embed_tokens again (the skeleton was built untied)
    params = dict(model.named_parameters(remove_duplicate=False))
    for hf, param in params.items():  # a tied parameter follows what its twin became
        if param.is_meta and hf not in stored:
            twin = [h for h in stored if params[h] is param]
            if not twin:
                raise StoredUnsupported(f"the GGUF file has no tensor for the model's {hf}")
            stored[hf] = stored[twin[0]]
    del reader
    return StoredModel(stored, expanded)


def _weights_map(model: Any, processor: Any, weights_map: Any) -> dict[str, str]:
    """transformers' GGUF -> HF tensor names of ``model`` (``get_gguf_hf_weights_map``), with gguf-py's name
    table built once instead of once per submodule (~10 s for a 30-layer model)."""
    import functools
    from unittest import mock

    import gguf

    cached = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "get_tensor_name_map", cached):
        return weights_map(model, processor)


# Weights the decoder runs as one kernel call (engine/decoder.py: fused q/k/v, fused gate/up), in its order. ``save``
# writes each group's panels next to each other in that order, so ``read`` gives views ``fuse_stored`` joins in
# place: no copy of them in the process (43.5 MB of SmolLM2's 102 MB were copied when each was its own tensor).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
LAYOUT = 2  # 1: one file tensor per weight, named by it; 2: keys "<rank>:<name>" in FUSED_GROUPS order


def file_order(names: list[str]) -> list[str]:
    """``names`` (dotted parameter names) ordered so that each module's ``FUSED_GROUPS`` members are adjacent and in
    group order: ``[..."l0.self_attn.o_proj.weight", "l0.self_attn.q_proj.weight", "l0.self_attn.k_proj.weight",
    "l0.self_attn.v_proj.weight"]``."""
    def key(name: str) -> tuple:
        parts = name.split(".")
        parent, leaf = ".".join(parts[:-2]), parts[-2] if len(parts) >= 2 else name
        for g, group in enumerate(FUSED_GROUPS):
            if leaf in group:
                return (parent, group[0], g, group.index(leaf), name)
        return (parent, leaf, -1, 0, name)
    return sorted(names, key=key)


def save(folder: Any, model: Any, stored: StoredModel) -> None:
    """Write the weights of a ``load_gguf`` model to ``folder/weights.safetensors``: each stored weight's panels
    once (tied names share them) under the key ``"<rank>:<name>"`` (safetensors lays tensors of one dtype out by
    key, so the ranks of ``file_order`` put fused groups side by side), every float32 parameter by its name, and
    what ``read`` needs in the metadata (per name: its key, format, shape, source)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, list] = {}
    key_of: dict[int, str] = {}
    first: dict[int, str] = {}  # each weight object by the first name that holds it (tied names share one)
    for name, w in stored.weights.items():
        first.setdefault(id(w), name)
    for rank, name in enumerate(file_order(list(first.values()))):
        w = stored.weights[name]
        key_of[id(w)] = f"{rank:06d}:{name}"
        tensors[key_of[id(w)]] = w.packed.contiguous()
    for name, w in stored.weights.items():
        meta[name] = [key_of[id(w)], w.fmt, w.n, w.k, w.source]
    for name, p in model.named_parameters():
        if not p.is_meta:
            tensors[name] = p.detach()
    save_file(tensors, str(Path(folder) / "weights.safetensors"),
              metadata={"stored": json.dumps(meta), "expanded": json.dumps(stored.expanded),
                        "layout": str(LAYOUT)})


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def map_safetensors(path: Any) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of a safetensors file, every tensor a view of one private, lazily read mapping of
    the whole file (``torch.from_file``): tensors next to each other in the file are next to each other in one
    storage. Format: an 8-byte little-endian header length, a JSON header of ``{name: {dtype, shape,
    data_offsets}}`` and ``__metadata__``, then the data (offsets relative to its start).

    Raises:
        ValueError: a cut or malformed file, or a dtype not in ``_DTYPES``.
    """
    import json
    import os
    import struct

    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: header of {n} bytes does not fit in a {size}-byte file")
        header = json.loads(fh.read(n))
    whole = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        begin, end = info["data_offsets"]
        if dtype is None or base + end > size:
            raise ValueError(f"{path}: tensor {name}: dtype {info['dtype']} or offsets {begin}..{end} not readable")
        raw = whole[base + begin: base + end]
        tensors[name] = (raw.view(dtype) if dtype is not torch.uint8 else raw).view(info["shape"])
    return meta, tensors


def read(folder: Any) -> StoredModel:
    """The weights ``save`` wrote to ``folder``, without a model: the stored weights by parameter name (tied
    names share one) and every other parameter in ``StoredModel.tensors``. The file is memory-mapped once
    (``map_safetensors``): a tensor's pages are read when first used. Reads both layouts (``LAYOUT``)."""
    import json
    from pathlib import Path

    info, loaded = map_safetensors(Path(folder) / "weights.safetensors")
    meta = json.loads(info["stored"])
    by_key: dict[str, StoredWeight] = {}
    weights: dict[str, StoredWeight] = {}
    for name, (key, fmt, n, k, source) in meta.items():
        if key not in by_key:
            by_key[key] = StoredWeight(loaded[key], int(fmt), int(n), int(k), source)
        weights[name] = by_key[key]
    for key in by_key:
        loaded.pop(key, None)
    return StoredModel(weights, json.loads(info.get("expanded", "{}")), loaded)


def restore(folder: Any, model: Any, stored: Optional[StoredModel] = None) -> StoredModel:
    """Fill ``model`` (``empty_model`` of the same config) from what ``save`` wrote to ``folder`` (``stored``:
    what ``read`` already gave for it).

    Raises:
        StoredUnsupported: the file does not match the model (a parameter missing or of another shape).
    """
    stored = stored if stored is not None else read(folder)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in stored.tensors.items():
        if name not in params or tuple(params[name].shape) != tuple(value.shape):
            raise StoredUnsupported(f"{folder}: tensor {name} {tuple(value.shape)} does not fit the model")
        _set_param(model, name, value)
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and name not in stored.weights:
            raise StoredUnsupported(f"{folder} has no weight for the model's {name}")
    return stored


def _set_param(model: Any, name: str, value: torch.Tensor) -> None:
    """Set parameter ``name`` of ``model`` to ``value``, keeping tied twins tied (a parameter object shared by
    several modules is replaced in each)."""
    old = model.get_parameter(name)
    new = torch.nn.Parameter(value, requires_grad=False)
    for _, mod in model.named_modules(remove_duplicate=False):
        for pname, p in list(mod._parameters.items()):
            if p is old:
                mod._parameters[pname] = new


def materialize(model: Any, stored: StoredModel) -> None:
    """Replace every stored parameter of ``model`` by its float32 expansion (the float32 path's numbers), so the
    HF forward runs (the eager runner, HF ``generate``, oracles); the stored weights stay usable."""
    for name, param in dict(model.named_parameters(remove_duplicate=False)).items():
        if name in stored.weights and model.get_parameter(name).is_meta:  # a tied twin is replaced with it
            _set_param(model, name, stored.weights[name].expanded().reshape(param.shape))
