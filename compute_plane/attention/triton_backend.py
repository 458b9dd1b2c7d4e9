"""The Triton backend: paged attention, RMSNorm and rotary as Triton kernels, KV writes by CuPy.

Chosen automatically on CUDA (`--attention-backend auto`). On a CPU it runs only under
the Triton interpreter (`TRITON_INTERPRET=1`), which is how CI drives the CUDA path of
the engine through the engine's own call sites.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from compute_plane.attention.torch_backend import AttentionMetadata
from compute_plane.kernels import cache_ops
from compute_plane.kernels.activation import silu_and_mul
from compute_plane.kernels.decode_attention import choose_num_splits, paged_decode_attention
from compute_plane.kernels.fused_linear import norm_linear, rows_linear, silu_mul_linear
from compute_plane.kernels.prefill_attention import paged_prefill_attention
from compute_plane.kernels.rms_norm import add_rms_norm, rms_norm
from compute_plane.kernels.rotary import apply_rotary, rotate_into_cache
from compute_plane.model import ModelKernels
from compute_plane.model_config import ModelConfig
from compute_plane.rotary import RotaryEmbedding


class TritonPagedAttention:
    """Decodes in one split-K flash-decoding launch, prefill chunks in one causal launch."""

    name = "triton"

    def __init__(self, scale: float, num_kv_heads: int, num_sms: int) -> None:
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms  # 0 (CPU): never split

    def prepare(self, meta: AttentionMetadata) -> None:
        """Device copies of the step's lengths (unless the model runner staged them), and
        the decode split count."""
        dev = meta.slot_mapping.device
        if meta.seq_lens_tensor is None:
            meta.seq_lens_tensor = torch.tensor(meta.seq_lens, dtype=torch.int32, device=dev)
        d = meta.num_decodes
        if d:
            longest = max(meta.seq_lens[:d])
            meta.num_splits = choose_num_splits(d, self.num_kv_heads, longest, self.num_sms)
        if d < len(meta.seq_lens) and meta.query_start_loc is None:
            starts = [0, *itertools.accumulate(meta.query_lens[d:])]
            meta.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [N, bs, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        cache_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, window)

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [N, bs, KVH, D], the step's K/V already written
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` without the KV write (the rotary kernel stored them: rotate_into_cache);
        into `out` where given (piecewise CUDA graphs: the buffer their next piece reads)."""
        lens = meta.seq_lens_tensor
        assert lens is not None, "prepare() first"
        q = q.contiguous()
        if out is None:
            out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            paged_decode_attention(
                q[:d], k_cache, v_cache, meta.block_tables[:d], lens[:d], self.scale,
                meta.num_splits, out=out[:d], window=window,
            )  # fmt: skip
        if d < len(meta.seq_lens):
            assert meta.query_start_loc is not None, "prepare() first"
            paged_prefill_attention(
                q[d:], k_cache, v_cache, meta.block_tables[d:], lens[d:], meta.query_start_loc,
                max(meta.query_lens[d:]), self.scale, out=out[d:], window=window,
            )  # fmt: skip
        return out


class TritonRotaryEmbedding(RotaryEmbedding):
    """The same tables as the torch path, applied to q and k by one Triton kernel (with
    the per-head norms before it, when the model has them)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, positions, self.cos, self.sin)

    def norm_rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, positions, self.cos, self.sin, q_weight, k_weight, eps)

    def rotate_into_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    ) -> torch.Tensor:
        return rotate_into_cache(
            q, k, v, positions, self.cos, self.sin, k_cache, v_cache, slots, q_weight, k_weight,
            eps,
        )  # fmt: skip


def triton_kernels(cfg: ModelConfig, device: torch.device) -> ModelKernels:
    """The Triton kernel set for a model of `cfg` on `device` (CUDA, or CPU when interpreted)."""
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 0
    )
    attention = TritonPagedAttention(cfg.scale, cfg.num_kv_heads, num_sms)
    return ModelKernels(
        attention=attention,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        rotary=TritonRotaryEmbedding,
        silu_and_mul=silu_and_mul,
        attend=attention.attend,
        norm_linear=norm_linear,
        silu_mul_linear=silu_mul_linear,
        rows_linear=rows_linear,
    )
