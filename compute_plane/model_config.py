"""Architecture-normalised model configuration shared by the loaders and the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model's architecture or a feature of it is not supported."""


@dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs to know, whatever file format the model came from.

    Weights are always handed over under Hugging Face parameter names
    (`model.layers.{i}.self_attn.q_proj.weight`, ...), so one model implementation
    serves safetensors folders and GGUF files alike.
    """

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head before rotary (Qwen3)
    rope_scaling: dict[str, Any] | None = (
        None  # HF rope_scaling dict, e.g. {"rope_type": "llama3", ...}
    )
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
