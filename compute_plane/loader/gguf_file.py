"""Load a GGUF file: metadata -> ModelConfig, tensors dequantised to HF names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from compute_plane.loader import ModelLoadError
from compute_plane.model_config import ModelConfig, UnsupportedModelError
from compute_plane.quant import QuantWeight, from_gguf
from hetero_common.gguf_reader import open_gguf
from hetero_common.vocab import fingerprint

_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's sandwich: its ffn_norm is the pre-MLP norm, post_attention_norm normalises the
# attention's output (Llama's post_attention_layernorm is its pre-MLP norm).
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# What llama.cpp fixes for Gemma 3 rather than writing it into the file.
_GEMMA3_SLIDING_PATTERN = 6  # every 6th layer global, the others sliding
_GEMMA3_LOCAL_THETA = 10000.0
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp ends generation on any of these, as HF does on generation_config's eos list.
_EOG_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
# Control tokens that end a chat turn, which a file may leave out of those keys (Gemma 3's
# names only <eos>, where its HF generation_config lists <end_of_turn> too): llama.cpp
# ends on them by their text, and so do we. Not <|endoftext|>, a document's end, which
# llama.cpp adds as well: SmolLM2's HF config leaves it out.
_TURN_ENDS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")
_CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token
# Tensor types that hold an HF checkpoint's values as they were (bf16 -> f16 aside)
_EXACT = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = (_GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES).get(m[2])
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Llama q/k weights (its rotary layout).

    Within each head HF's rotate_half pairs row j with row j + head_dim/2; llama.cpp
    interleaves them (rows 2j, 2j+1). Its converter maps rows (head, half, j) to
    (head, j, half); swapping the two inner axes back is the inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: Path, dtype: torch.dtype, progress: bool, quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight], frozenset[str]]:
    """Metadata -> ModelConfig; every known tensor oriented as in torch: dequantised and
    cast, or with `quantized` a quantized matrix as a QuantWeight (compute_plane.quant);
    and the names of those the file stores in a quantized type."""
    try:
        reader = open_gguf(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    config = read_config(path, reader)
    n_kv = config.num_kv_heads
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    lossy: set[str] = set()
    bar = tqdm(
        reader.tensors,
        desc=f"loading {path.name}",
        unit="tensor",
        disable=None if progress else True,
    )
    for t in bar:
        name = hf_name(t.name, config.architecture)
        if name is None:
            if t.name == "rope_freqs.weight":
                # Llama 3.1-style per-frequency rope factors: not expressible in rope_scaling.
                raise UnsupportedModelError(f"{path}: rope_freqs.weight is not supported")
            raise UnsupportedModelError(f"{path}: unsupported GGUF tensor {t.name}")
        if t.tensor_type not in _EXACT:
            lossy.add(name)
        # GGUF lists dims fastest-first (ne order): reversed, they are torch's [out, in].
        shape = [int(d) for d in reversed(t.shape)]
        rotary = config.architecture == "llama" and t.name.endswith(
            ("attn_q.weight", "attn_k.weight")
        )
        heads = config.num_attention_heads if "attn_q" in t.name else n_kv
        if quantized and len(shape) == 2:
            rows = unpermute_rotary(np.arange(shape[0]), heads) if rotary else None
            q = from_gguf(t.data, t.tensor_type, shape[0], shape[1], rows=rows)
            if q is not None:
                weights[name] = q
                continue
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        if rotary:
            w = unpermute_rotary(w, heads)
        if config.norm_weight_offset and t.name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norms as offset + w; Hugging Face names hold w.
            w = w - np.float32(config.norm_weight_offset)
        # Copies only unquantised tensors: they are views of the read-only mmap.
        weights[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"])).to(dtype)
    return config, weights, frozenset(lossy)


def read_config(path: Path, reader: GGUFReader) -> ModelConfig:
    """GGUF metadata (`{arch}.*`, `tokenizer.ggml.*`, `general.name`) -> ModelConfig."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: missing GGUF metadata {arch}.{key}")
        return value

    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"{path}: unsupported {arch}.rope.scaling.type {scaling!r}")
    factor = float(meta("rope.scaling.factor")) if scaling == "linear" else 1.0
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[1])
    n_head, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = [_field(reader, f"tokenizer.ggml.{k}") for k in _EOG_KEYS]
    strings: list[str] = tokens.contents() if tokens is not None else []
    if strings and (types := reader.fields.get("tokenizer.ggml.token_type")):
        ends, kinds = set(_TURN_ENDS), types.contents()
        eos += [i for i, t in enumerate(strings) if t in ends and kinds[i] == _CONTROL]
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        n, head_dim = int(meta("block_count")), int(meta("attention.key_length"))
        gemma = {
            "norm_weight_offset": 1.0,
            "embedding_scale": float(hidden) ** 0.5,
            "sandwich_norms": True,
            "hidden_act": "gelu_tanh",
            "attention_scale": float(head_dim) ** -0.5,
            "sliding_window": int(meta("attention.sliding_window")),
            "layer_types": tuple(
                "sliding" if (i + 1) % _GEMMA3_SLIDING_PATTERN else "full" for i in range(n)
            ),
            "rope_local_theta": _GEMMA3_LOCAL_THETA,
        }
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_attention_heads=n_head,
        num_kv_heads=int(meta("attention.head_count_kv", n_head)),
        head_dim=int(meta("attention.key_length", hidden // n_head)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rope_scaling=None if scaling == "none" else {"rope_type": "linear", "factor": factor},
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        name=str(_field(reader, "general.name", path.stem)),
        vocab_fingerprint=fingerprint(strings),
        **gemma,
    )


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()
