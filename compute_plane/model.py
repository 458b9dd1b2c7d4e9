"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3) over a paged KV cache.

One implementation serves every supported architecture; the differences are flags
in ModelConfig: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), rope scaling
(Llama 3.x), tied embeddings. Weights come in under Hugging Face names and are
fused on load (q|k|v and gate|up become one matmul each).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compute_plane.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from compute_plane.model_config import ModelConfig
from compute_plane.rotary import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as Hugging Face Llama does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a residual add and the norm after it."""
    h = residual + x
    return rms_norm(h, weight, eps), h


@dataclass(frozen=True)
class ModelKernels:
    """The kernels a forward runs; torch's by default, Triton's on CUDA (attention_triton.py)."""

    attention: AttentionBackend
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    rotary: type[RotaryEmbedding]


def torch_kernels(cfg: ModelConfig) -> ModelKernels:
    return ModelKernels(
        TorchPagedAttention(scale=cfg.head_dim**-0.5), rms_norm, add_rms_norm, RotaryEmbedding
    )


class Layer:
    """One decoder layer's fused weights."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], i: int) -> None:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.input_norm = w[p + "input_layernorm.weight"]
        self.post_norm = w[p + "post_attention_layernorm.weight"]
        self.qkv = torch.cat(
            [w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]
        )
        self.qkv_bias = (
            torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
            if cfg.attention_bias
            else None
        )
        self.o = w[a + "o_proj.weight"]
        self.q_norm = w[a + "q_norm.weight"] if cfg.qk_norm else None
        self.k_norm = w[a + "k_norm.weight"] if cfg.qk_norm else None
        self.gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.down = w[p + "mlp.down_proj.weight"]


class Model:
    """Forward over a flattened ragged batch; KV caches are owned by the caller."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        kernels: ModelKernels | None = None,
    ) -> None:
        self.cfg = cfg
        kernels = kernels or torch_kernels(cfg)
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = (
            w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        )
        self.final_norm = w["model.norm.weight"]
        self.layers = [Layer(cfg, w, i) for i in range(cfg.num_layers)]
        self.rotary = kernels.rotary(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, dtype
        )
        self.attention = kernels.attention
        self.norm = kernels.rms_norm
        self.add_norm = kernels.add_rms_norm
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Returns the final-norm hidden states [T, hidden]; K/V of the new tokens are written."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        self.attention.prepare(meta)
        h = self.embed[input_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = self.norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, cfg.num_attention_heads, cfg.head_dim)
            k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = self.norm(q, layer.q_norm, eps)
                k = self.norm(k, layer.k_norm, eps)
            q, k = self.rotary(q, k, positions)
            o = self.attention.forward(q, k, v, k_cache, v_cache, meta)
            x, h = self.add_norm(
                F.linear(o.reshape(-1, self.q_size), layer.o), h, layer.post_norm, eps
            )
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        return self.norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in fp32."""
        return F.linear(hidden, self.lm_head).float()
