"""Model loading: a Hugging Face folder or a GGUF file -> ModelConfig + HF-named weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from compute_plane.loader.gguf_file import load_gguf
from compute_plane.loader.hf import ModelFilesError, load_hf
from compute_plane.model_config import ModelConfig

__all__ = ["LoadedModel", "ModelFilesError", "load_model"]


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face parameter names
    source: str  # "hf" | "gguf"
    path: Path


def load_model(
    path: Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> LoadedModel:
    """Load a model folder (config.json + safetensors) or a .gguf file, with a progress bar."""
    path = Path(path)
    if path.is_dir():
        config, weights = load_hf(path, dtype, progress)
        source = "hf"
    elif path.is_file() and path.suffix == ".gguf":
        config, weights = load_gguf(path, dtype, progress)
        source = "gguf"
    else:
        raise ModelFilesError(
            f"{path}: not a model folder (config.json + safetensors) nor a .gguf file"
        )
    missing = _missing_weights(config, weights)
    if missing:
        raise ModelFilesError(
            f"{path}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return LoadedModel(config, weights, source, path)


def _missing_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> list[str]:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        need.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        need += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        need += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        need += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if cfg.attention_bias:
            need += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            need += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return [n for n in need if n not in weights]
