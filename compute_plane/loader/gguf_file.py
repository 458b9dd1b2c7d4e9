"""Load a GGUF file: metadata -> ModelConfig, tensors dequantised to HF names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from compute_plane.model_config import ModelConfig, UnsupportedModelError

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
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = _LAYER_NAMES.get(m[2])
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Llama q/k weights (its rotary layout).

    llama.cpp writes rows grouped as (head, half, pair); Hugging Face's rotate_half
    wants (head, pair, half). The inverse swaps the two inner axes back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def load_gguf(
    path: Path, dtype: torch.dtype, progress: bool
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise UnsupportedModelError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: llama, qwen2, qwen3)"
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n_head = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_head))
    hidden = int(meta("embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[1])
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_attention_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=int(meta("attention.key_length", hidden // n_head)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(_field(reader, "general.name", path.stem)),
    )

    weights: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        name = hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs: derived from metadata instead
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rotary(w, n_head if "attn_q" in t.name else n_kv)
        weights[name] = torch.from_numpy(np.array(w, order="C")).to(
            dtype
        )  # copy: mmap is read-only
    return config, weights
