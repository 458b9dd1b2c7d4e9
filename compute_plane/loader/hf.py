"""Load a Hugging Face model folder: config.json + (sharded) safetensors."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from tqdm import tqdm

from compute_plane.loader import ModelLoadError
from compute_plane.model_config import ModelConfig, UnsupportedModelError
from compute_plane.scaled import FP8, ScaledWeight, from_fp8
from hetero_common import vocab
from hetero_common.model_path import ModelFileError, read_json_object

# HF `architectures` entry -> (our architecture, q/k/v bias unless config says, per-head q/k norm)
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "Gemma3ForCausalLM": ("gemma3", False, True),
}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def load_hf(
    folder: Path, dtype: torch.dtype, progress: bool, keep_fp8: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | ScaledWeight], frozenset[str]]:
    """config.json -> ModelConfig; every tensor of the safetensors file(s), cast to `dtype`
    (an FP8 checkpoint's matrices: see dequantize_fp8 and `keep_fp8`); and the names of
    those stored in FP8."""
    config = read_config(folder)
    files = _weight_files(folder)
    weights: dict[str, torch.Tensor] = {}
    try:
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
            total = sum(len(h.keys()) for h in handles)
            bar = stack.enter_context(
                tqdm(
                    total=total,
                    desc=f"loading {folder.name}",
                    unit="tensor",
                    disable=None if progress else True,
                )
            )
            fp8 = _fp8_config(folder)
            for h in handles:
                for name in h.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                    # Checkpoints from before transformers 4.31 carry this buffer; we recompute it.
                    if not name.endswith("rotary_emb.inv_freq"):
                        t = h.get_tensor(name)
                        weights[name] = t if fp8 is not None else t.to(dtype)
                    bar.update()
    except SafetensorError as e:
        raise ModelLoadError(f"{folder}: unreadable safetensors file: {e}") from e
    if fp8 is not None:
        lossy = frozenset(n for n, t in weights.items() if t.dtype == FP8)
        return config, dequantize_fp8(weights, fp8, dtype, keep_fp8), lossy
    return config, dict(weights), frozenset()


def _fp8_config(folder: Path) -> dict[str, Any] | None:
    """config.json's quantization_config when it is vLLM's "fp8" format, else None;
    another quantization method is refused by name."""
    qc = read_json_object(folder / "config.json").get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(
            f"{folder}: quantization_config quant_method {method!r} is not supported (fp8 is)"
        )
    return dict(qc)


def dequantize_fp8(
    weights: dict[str, torch.Tensor], qc: dict[str, Any], dtype: torch.dtype, keep: bool = False
) -> dict[str, torch.Tensor | ScaledWeight]:
    """An FP8 checkpoint as vLLM loads it (quant_method "fp8"): e4m3 matrices with a scale
    per tensor, per output channel, or per block (`weight_block_size`, the scale then
    named `weight_scale_inv`), dequantized to `dtype`, or with `keep` (per-tensor and
    per-channel scales) kept as ScaledWeight; static activation scales (`input_scale`)
    are dropped (activations are scaled per token when they meet FP8 weights)."""
    block = qc.get("weight_block_size")
    out: dict[str, torch.Tensor | ScaledWeight] = {}
    for name, t in weights.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if t.dtype != FP8:
            out[name] = t.to(dtype)
            continue
        stem = name.removesuffix("weight")
        scale = weights.get(stem + "weight_scale", weights.get(stem + "weight_scale_inv"))
        if scale is None:
            raise ModelLoadError(f"{name}: an fp8 weight without weight_scale")
        if keep and (kept := from_fp8(t, scale)) is not None:
            out[name] = kept
            continue
        w, scale = t.to(torch.float32), scale.to(torch.float32)
        if scale.numel() == 1:
            w = w * scale.reshape(())
        elif block is not None and scale.dim() == 2 and scale.shape[1] > 1:
            b0, b1 = int(block[0]), int(block[1])
            full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
            w = w * full[: w.shape[0], : w.shape[1]]
        elif scale.numel() == w.shape[0]:
            w = w * scale.reshape(-1, 1)  # per output channel
        else:
            raise ModelLoadError(
                f"{name}: weight scale of shape {tuple(scale.shape)} fits no fp8 layout"
            )
        out[name] = w.to(dtype)
    return out


def read_config(folder: Path) -> ModelConfig:
    """Normalise config.json (+ generation_config.json eos ids) into a ModelConfig."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{folder}: missing config.json (expected a Hugging Face model folder)"
        )
    cfg = read_json_object(path)
    try:
        return _model_config(folder, cfg)
    except (ModelLoadError, UnsupportedModelError, ModelFileError):
        raise
    except KeyError as e:  # a field every model has
        raise ModelLoadError(f"{path}: missing {e.args[0]}") from None
    except (TypeError, ValueError, AttributeError) as e:  # int("x"), None.get, ...
        raise ModelLoadError(f"{path}: a field of the wrong type: {e}") from None


def _model_config(folder: Path, cfg: dict[str, Any]) -> ModelConfig:
    names = cfg.get("architectures") or [cfg.get("model_type")]
    known = [n for n in names if n in _ARCHITECTURES]
    if not known:
        raise UnsupportedModelError(
            f"{folder}: unsupported architecture {', '.join(map(str, names))}; "
            f"supported: {', '.join(_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{folder}: mlp_bias=true is not supported")
    arch, bias, qk_norm = _ARCHITECTURES[known[0]]
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    gemma = _gemma3(folder, cfg) if arch == "gemma3" else _windows(cfg, arch)
    if arch == "gemma3":
        theta, scaling = _rope(cfg, "full_attention")
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
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        # Qwen2 has no such field (its q/k/v always carry a bias); Llama/Qwen3 say so in config.
        attention_bias=bool(cfg.get("attention_bias", bias)),
        qk_norm=qk_norm,
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(folder, cfg),
        name=folder.name,
        vocab_fingerprint=_vocab_fingerprint(folder),
        **gemma,
    )


def _windows(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Sliding-window layers of Mistral (every layer, when config.json has a window) and
    Qwen2 (use_sliding_window: the layers from max_window_layers on), as transformers."""
    n, window = int(cfg["num_hidden_layers"]), cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window"):
        window = None
    types = cfg.get("layer_types")
    if not window:
        return {}
    if types:
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    elif arch == "qwen2":
        first = int(cfg.get("max_window_layers", n))
        kinds = tuple("sliding" if i >= first else "full" for i in range(n))
    else:
        kinds = ("sliding",) * n
    return {"sliding_window": int(window), "layer_types": kinds} if "sliding" in kinds else {}


def _gemma3(folder: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's ModelConfig fields from its config.json (text model)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedModelError(f"{folder}: {key} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{folder}: use_bidirectional_attention is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{folder}: unsupported hidden_activation {act!r}")
    n = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    local_theta, local_scaling = _rope(cfg, "sliding_attention")
    if local_scaling is not None:
        raise UnsupportedModelError(f"{folder}: rope scaling on sliding layers is not supported")
    return {
        "norm_weight_offset": 1.0,
        "embedding_scale": float(cfg["hidden_size"]) ** 0.5,
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
        "attention_scale": float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]) ** -0.5,
        "sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        "layer_types": tuple("sliding" if t == "sliding_attention" else "full" for t in types),
        "rope_local_theta": float(cfg.get("rope_local_base_freq") or local_theta),
    }


def _rope(
    cfg: dict[str, Any], layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and an HF-style scaling dict (None for plain rotary).

    transformers 4 writes `rope_theta` + `rope_scaling`; transformers 5 writes one
    `rope_parameters` dict holding both, per layer type where they differ (Gemma 3).
    """
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        return float(cfg.get("rope_local_base_freq") or 10000.0), None
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **scaling}


def _vocab_fingerprint(folder: Path) -> bytes:
    """The fingerprint of the folder's tokenizer.json; b"" without one, or with one the
    tokenizers library cannot read (the compute plane does not tokenize: not its error)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return b""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # tokenizers raises a bare Exception for a bad file
        return b""
    return vocab.tokenizer_fingerprint(tok)


def _eos_ids(folder: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids (each an int or a list)."""
    sources = [cfg]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(read_json_object(gen))
    ids: dict[int, None] = {}  # ordered set
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            ids[int(i)] = None
    return tuple(ids)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / _INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map object")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(
                f"{folder}: shard {', '.join(missing)} named in {_INDEX} is missing"
            )
        return [folder / s for s in shards]
    if (folder / _SINGLE).is_file():
        return [folder / _SINGLE]
    raise ModelLoadError(f"{folder}: no weights: neither {_SINGLE} nor {_INDEX}")
