"""Architecture-normalised model configuration shared by the loaders and the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
HIDDEN_ACTS = ("silu", "gelu_tanh")


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
    # hetero_common.vocab.fingerprint of the tokenizer's strings (b"": none came with it):
    # the control plane checks its tokenizer is this model's
    vocab_fingerprint: bytes = b""
    # Gemma 3. Norm weights are handed over as HF stores them; Gemma's RMSNorm multiplies
    # by (norm_weight_offset + w).
    norm_weight_offset: float = 0.0
    embedding_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # also a norm after attention and after the MLP (Gemma)
    hidden_act: str = "silu"  # the gated MLP's activation (HIDDEN_ACTS)
    attention_scale: float | None = None  # default head_dim ** -0.5
    sliding_window: int | None = None  # keys a "sliding" layer sees: the last N positions
    layer_types: tuple[str, ...] = ()  # "full" or "sliding" per layer; () = all full
    rope_local_theta: float | None = None  # sliding layers' rotary base (default rope_theta)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(
                f"unsupported activation {self.hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}"
            )
        if self.layer_types and (
            len(self.layer_types) != self.num_layers
            or not set(self.layer_types) <= {"full", "sliding"}
            or ("sliding" in self.layer_types and not self.sliding_window)
        ):
            raise UnsupportedModelError(
                f"layer_types must name 'full' or 'sliding' for each of {self.num_layers} layers "
                "(and sliding layers need a sliding_window)"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def window(self, layer: int) -> int | None:
        """How many of the latest positions layer `layer` attends to (None: all)."""
        if self.layer_types and self.layer_types[layer] == "sliding":
            return self.sliding_window
        return None

    @property
    def max_window(self) -> int | None:
        """The longest any layer looks back (None: some layer sees everything)."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return None if None in windows else max(w for w in windows if w is not None)
