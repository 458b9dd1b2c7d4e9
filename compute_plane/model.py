"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3) over a paged KV cache.

One implementation serves every supported architecture; the differences are flags
in ModelConfig: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), rope scaling
(Llama 3.x), tied embeddings. Weights come in under Hugging Face names and are
fused on load (q|k|v and gate|up become one matmul each).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compute_plane.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from compute_plane.decode_cpu import FusedDecode, fused_decode
from compute_plane.model_config import ModelConfig
from compute_plane.quant import QuantWeight, Weight, cat, weight_bytes
from compute_plane.rotary import RotaryEmbedding
from compute_plane.scaled import ScaledWeight, prepare_device


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


Linear = Callable[[torch.Tensor, Weight, torch.Tensor | None], torch.Tensor]
DenseLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear by oneDNN's fp32 matmul rather than MKL's sgemm.

    A decode step multiplies a few rows by every weight of the model, streaming them
    from memory; MKL's sgemm does that at about half of oneDNN's speed on this
    machine's AMD EPYC (1-16 rows: the whole step ~30% faster; 2048-row prefill steps
    unchanged; `python -m benchmarks.decode_step`). Same fp32 arithmetic, so results
    agree with F.linear to rounding (tests/compute/test_parity.py).
    """
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def with_quantized(dense: DenseLinear, activations: str = "int16") -> Linear:
    """A linear that runs a QuantWeight on its own kernels (with `activations`, see
    quant.ACTIVATIONS) and a tensor on `dense`."""

    def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, QuantWeight):
            return w.linear(x, bias, activations)
        if isinstance(w, ScaledWeight):
            return w.linear(x, bias)
        return dense(x, w, bias)

    return linear


def pick_linear(device: torch.device, dtype: torch.dtype) -> DenseLinear:
    """oneDNN on CPU fp32 when this torch build has it (and it computes), else F.linear."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return F.linear
    try:
        probe = onednn_linear(torch.ones(2, 3), torch.ones(4, 3), torch.ones(4))
    except (RuntimeError, AttributeError):
        return F.linear
    return onednn_linear if torch.equal(probe, torch.full((2, 4), 4.0)) else F.linear


@dataclass(frozen=True)
class ModelKernels:
    """The kernels a forward runs; torch's by default, Triton's on CUDA (attention/triton_backend.py)."""

    attention: AttentionBackend
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    rotary: type[RotaryEmbedding]
    # silu(gate) * up over the fused gate|up output in one kernel (None: torch's two ops)
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Small-batch linears with the op before them folded in (kernels/fused_linear.py):
    # (linear(rms_norm(x + residual)) + bias, x + residual), and linear(silu(gate) * up);
    # used for steps of at most Model.fused_rows tokens (None: the separate kernels)
    norm_linear: (
        Callable[
            [
                torch.Tensor,
                torch.Tensor | None,
                torch.Tensor,
                float,
                torch.Tensor,
                torch.Tensor | None,
            ],
            tuple[torch.Tensor, torch.Tensor],
        ]
        | None
    ) = None
    silu_mul_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # and the attention's output projection in the same kernel, nothing folded in
    rows_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Attention over the cache alone, the step's K/V stored there by the rotation
    # (`rotary.rotate_into_cache`: one kernel with the KV write on the Triton path);
    # None: rotation, then `attention.forward` writes K/V and attends.
    attend: (
        Callable[
            [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, int | None],
            torch.Tensor,
        ]
        | None
    ) = None


def torch_kernels(cfg: ModelConfig) -> ModelKernels:
    return ModelKernels(
        TorchPagedAttention(scale=cfg.scale), rms_norm, add_rms_norm, RotaryEmbedding
    )


class Layer:
    """One decoder layer's fused weights."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Weight], i: int) -> None:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        dense = functools.partial(_tensor, w)
        self.window = cfg.window(i)  # sliding-window layers see only the latest positions
        self.input_norm = dense(p + "input_layernorm.weight")
        # The norm before the MLP: Llama calls it post_attention_layernorm. Gemma's
        # "sandwich" has that name on the norm of the attention's output, another before
        # the MLP and one on the MLP's output.
        self.attn_out_norm = self.mlp_out_norm = None
        if cfg.sandwich_norms:
            self.attn_out_norm = dense(p + "post_attention_layernorm.weight")
            self.mlp_norm = dense(p + "pre_feedforward_layernorm.weight")
            self.mlp_out_norm = dense(p + "post_feedforward_layernorm.weight")
        else:
            self.mlp_norm = dense(p + "post_attention_layernorm.weight")
        self.qkv = cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        self.qkv_bias = (
            torch.cat(
                [dense(a + "q_proj.bias"), dense(a + "k_proj.bias"), dense(a + "v_proj.bias")]
            )
            if cfg.attention_bias
            else None
        )
        self.o = w[a + "o_proj.weight"]
        self.q_norm = dense(a + "q_norm.weight") if cfg.qk_norm else None
        self.k_norm = dense(a + "k_norm.weight") if cfg.qk_norm else None
        self.gate_up = cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.down = w[p + "mlp.down_proj.weight"]


def _tensor(w: dict[str, Weight], name: str) -> torch.Tensor:
    """A weight that is always dense (a norm, a bias)."""
    t = w[name]
    assert isinstance(t, torch.Tensor), f"{name} must be dense"
    return t


def _place(w: Weight, device: torch.device, dtype: torch.dtype) -> Weight:
    """On its device in `dtype`; a QuantWeight stays as it is only on the CPU in fp32, a
    ScaledWeight (FP8/INT8) keeps its 8-bit values on any device."""
    if isinstance(w, ScaledWeight):
        w = w.to(device)
        prepare_device(w, device, dtype)
        return w
    if isinstance(w, QuantWeight):
        if device.type == "cpu" and dtype == torch.float32:
            return w
        w = w.dequantize()
    return w.to(device=device, dtype=dtype)


def _offset_norms(w: dict[str, Weight], offset: float) -> dict[str, Weight]:
    """Gemma's RMSNorm multiplies by (offset + w): fold the offset into the norm weights."""
    if not offset:
        return w
    return {
        k: v + offset if k.endswith("norm.weight") and isinstance(v, torch.Tensor) else v
        for k, v in w.items()
    }


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class Model:
    """Forward over a flattened ragged batch; KV caches are owned by the caller."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Weight],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        kernels: ModelKernels | None = None,
        activations: str = "int16",
    ) -> None:
        self.cfg = cfg
        self.activations = activations  # quantized decode matmuls (quant.ACTIVATIONS)
        kernels = kernels or torch_kernels(cfg)
        w = _offset_norms(
            {k: _place(v, device, dtype) for k, v in weights.items()}, cfg.norm_weight_offset
        )
        self.weight_bytes = weight_bytes(w)  # what the weights take on the device
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = (
            w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        )
        self.final_norm = _tensor(w, "model.norm.weight")
        self.device, self.dtype = device, dtype
        self.dense_linear = pick_linear(device, dtype)
        self.linear = with_quantized(self.dense_linear, activations)
        self.layers = [Layer(cfg, w, i) for i in range(cfg.num_layers)]
        self.rotary = kernels.rotary(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, dtype
        )
        # Sliding-window layers may rotate with their own base (Gemma 3: 10k vs 1M).
        self.rotary_local = (
            self.rotary
            if cfg.rope_local_theta is None
            else kernels.rotary(
                cfg.head_dim, max_positions, cfg.rope_local_theta, None, device, dtype
            )
        )
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.silu_and_mul = kernels.silu_and_mul if cfg.hidden_act == "silu" else None
        self.embedding_scale = (
            None
            if cfg.embedding_scale is None
            else torch.tensor(cfg.embedding_scale, dtype=dtype, device=device)
        )
        self.attention = kernels.attention
        self.attend = kernels.attend
        self.fused_norm_linear = kernels.norm_linear
        self.fused_silu_linear = kernels.silu_mul_linear if self.silu_and_mul else None
        self.rows_linear = kernels.rows_linear
        # Steps of at most this many tokens use the fused linears (0: never): chosen by the
        # engine at start-up on CUDA, where they measure faster (fused_rows_faster).
        self.fused_rows = 0
        self.norm = kernels.rms_norm
        self.add_norm = kernels.add_rms_norm
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # Decode-only steps in one C call where it applies (CPU, quantized; decode_cpu.py).
        self.fused: FusedDecode | None = fused_decode(self)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Returns the final-norm hidden states [T, hidden]; K/V of the new tokens are written."""
        fused = self.fused
        if fused is not None and meta.num_decodes == len(meta.seq_lens) <= fused.max_rows:
            return fused(input_ids, positions, meta, kv_caches)
        self.attention.prepare(meta)
        embed = self.embed
        assert not isinstance(embed, ScaledWeight), "embeddings are never FP8/INT8 here"
        h = embed.dequantize(input_ids) if isinstance(embed, QuantWeight) else embed[input_ids]
        if self.embedding_scale is not None:
            h = h * self.embedding_scale
        eps = self.cfg.rms_norm_eps
        small = input_ids.shape[0] <= self.fused_rows
        m = None  # the last MLP's output, added to the residual by the next norm
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            gate_up, h = self._attention(layer, h, m, positions, meta, k_cache, v_cache, small)
            if (
                small
                and self.fused_silu_linear is not None
                and isinstance(layer.down, torch.Tensor)
            ):
                m = self.fused_silu_linear(gate_up, layer.down)
            else:
                if self.silu_and_mul is not None:
                    act = self.silu_and_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    act = self.act(gate) * up
                m = self.linear(act, layer.down, None)
            if layer.mlp_out_norm is not None:
                m = self.norm(m, layer.mlp_out_norm, eps)
        if m is None:
            return self.norm(h, self.final_norm, eps)
        return self.add_norm(m, h, self.final_norm, eps)[0]

    def _attention(
        self,
        layer: Layer,
        h: torch.Tensor,
        m: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        small: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's attention block on the residual stream h (+ the last layer's MLP
        output m, added in the input norm's kernel), and the MLP's gate|up projection:
        (gate|up, the residual stream)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        x, residual = (h, None) if m is None else (m, h)
        qkv, h = self._norm_linear(x, residual, layer.input_norm, layer.qkv, layer.qkv_bias, small)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        rotary = self.rotary if layer.window is None else self.rotary_local
        if self.attend is not None:
            q = rotary.rotate_into_cache(
                q, k, v, positions, k_cache, v_cache, meta.slot_mapping, layer.q_norm,
                layer.k_norm, eps, self.norm,
            )  # fmt: skip
            o = self.attend(q, k_cache, v_cache, meta, layer.window)
        else:
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = rotary.norm_rotate(
                    q, k, positions, layer.q_norm, layer.k_norm, eps, self.norm
                )
            else:
                q, k = rotary(q, k, positions)
            o = self.attention.forward(q, k, v, k_cache, v_cache, meta, layer.window)
        o = o.reshape(-1, self.q_size)
        if small and self.rows_linear is not None and isinstance(layer.o, torch.Tensor):
            o = self.rows_linear(o, layer.o)
        else:
            o = self.linear(o, layer.o, None)
        if layer.attn_out_norm is None:
            return self._norm_linear(o, h, layer.mlp_norm, layer.gate_up, None, small)
        h = h + self.norm(o, layer.attn_out_norm, eps)
        return self._norm_linear(h, None, layer.mlp_norm, layer.gate_up, None, small)

    def _norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None,
        small: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(rms_norm(x + residual)), x + residual); with no residual, x alone. One
        kernel for a small step with a dense weight where the kernel set has it."""
        eps = self.cfg.rms_norm_eps
        fused = self.fused_norm_linear
        if small and fused is not None and isinstance(weight, torch.Tensor):
            return fused(x, residual, norm_weight, eps, weight, bias)
        if residual is None:
            normed, h = self.norm(x, norm_weight, eps), x
        else:
            normed, h = self.add_norm(x, residual, norm_weight, eps)
        return self.linear(normed, weight, bias), h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in fp32."""
        return self.linear(hidden, self.lm_head, None).float()
