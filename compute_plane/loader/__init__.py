"""Model loading: a Hugging Face folder or a GGUF file -> ModelConfig + HF-named weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from compute_plane.model_config import ModelConfig, UnsupportedModelError
from compute_plane.quant import QuantWeight
from compute_plane.scaled import ScaledWeight

__all__ = ["LoadedModel", "ModelLoadError", "load_model"]


class ModelLoadError(ValueError):
    """A model file is missing, unreadable or incomplete; the message names it and the path."""


@dataclass
class LoadedModel:
    config: ModelConfig
    # Hugging Face parameter names, in the requested dtype (or quantized: QuantWeight)
    weights: dict[str, torch.Tensor | QuantWeight | ScaledWeight]
    source: str  # "hf" | "gguf"
    path: Path
    # The weights the file stores lossily (a GGUF quantized type, an FP8 checkpoint's
    # matrices), whatever form they were loaded in: their values are a quantization's
    # (hetero_common.weights compares them more loosely)
    lossy: frozenset[str] = frozenset()


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    quantized: bool = False,
    keep_fp8: bool = False,
) -> LoadedModel:
    """Load a model folder (config.json + safetensors) or a .gguf file.

    `progress`: a progress bar, drawn only where stderr is a terminal (not in pods).
    `quantized`: a GGUF file's quantized matrices come back as QuantWeight, never
    materialised in float (compute_plane.quant).
    `keep_fp8`: an FP8 checkpoint's matrices with a per-tensor or per-channel scale come
    back as ScaledWeight (compute_plane.scaled), not dequantized.

    The weights come back under Hugging Face names, exactly the set the model uses
    (`lm_head.weight` may be absent when `config.tie_word_embeddings`).
    Raises ModelLoadError for missing/unreadable files or weights, and
    UnsupportedModelError for an architecture or feature the model cannot run.
    """
    # Imported here so that the error classes above exist before the loaders import them.
    from compute_plane.loader.gguf_file import load_gguf
    from compute_plane.loader.hf import load_hf

    path = Path(path)
    if path.is_dir():
        config, dense, lossy = load_hf(path, dtype, progress, keep_fp8)
        weights: dict[str, torch.Tensor | QuantWeight | ScaledWeight] = dict(dense)
        source = "hf"
    elif path.is_file() and path.suffix == ".gguf":
        config, gguf_weights, lossy = load_gguf(path, dtype, progress, quantized)
        weights = dict(gguf_weights)
        source = "gguf"
    else:
        raise ModelLoadError(
            f"{path}: not a model folder (config.json + safetensors) nor a .gguf file"
        )
    _check_names(path, config, weights)
    return LoadedModel(config, weights, source, path, lossy)


def _expected_names(cfg: ModelConfig) -> list[str]:
    """Every weight the model reads for `cfg` (lm_head included, even when tied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.sandwich_norms:
            names += [p + f"{x}_feedforward_layernorm.weight" for x in ("pre", "post")]
    return names


def _check_names(path: Path, cfg: ModelConfig, weights: Mapping[str, object]) -> None:
    expected = _expected_names(cfg)
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = [n for n in expected if n not in weights and n not in optional]
    if missing:
        raise ModelLoadError(f"{path}: missing weights {_some(missing)}")
    # A weight the model would not read (an o_proj or MLP bias, ...) means a feature
    # we do not implement: refuse rather than silently compute something else.
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise UnsupportedModelError(f"{path}: unsupported weights {_some(unexpected)}")


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")
