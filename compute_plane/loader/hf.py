"""Load a Hugging Face model folder: config.json + (sharded) safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from compute_plane.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError

# HF `architectures` entry -> (our architecture, q/k/v bias by default, per-head q/k norm)
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}


class ModelFilesError(FileNotFoundError):
    """A file the model needs is missing; the message names it."""


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling dict, from transformers 4 (`rope_scaling`) or 5 (`rope_parameters`)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if rope_type == "default" else {**scaling, "rope_type": rope_type})


def _eos_ids(folder: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFilesError(
            f"{folder}: missing config.json (expected a Hugging Face model folder)"
        )
    cfg = json.loads(path.read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    names = cfg.get("architectures") or []
    known = [n for n in names if n in _ARCHITECTURES]
    if not known:
        raise UnsupportedModelError(
            f"{folder}: unsupported architecture {names or cfg.get('model_type')!r}; "
            f"supported: {', '.join(_ARCHITECTURES)} ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    arch, bias, qk_norm = _ARCHITECTURES[known[0]]
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", bias)),
        qk_norm=qk_norm,
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(folder, cfg),
        name=folder.name,
    )


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for s in shards:
            if not (folder / s).is_file():
                raise ModelFilesError(f"{folder}: shard {s} named in {index.name} is missing")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise ModelFilesError(f"{folder}: no *.safetensors weights (model.safetensors or an index)")
    return found


def load_hf(
    folder: Path, dtype: torch.dtype, progress: bool
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = read_config(folder)
    files = _weight_files(folder)
    weights: dict[str, torch.Tensor] = {}
    with tqdm(desc=f"loading {folder.name}", unit="tensor", disable=not progress) as bar:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    weights[name] = st.get_tensor(name).to(dtype)
                    bar.update()
    return config, weights
