"""Rotary position embedding tables (HF `rotate_half` convention), incl. llama3 scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from compute_plane.model_config import UnsupportedModelError


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair inverse frequencies, rescaled as the model's `rope_scaling` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise UnsupportedModelError(
        f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)"
    )


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
    # band in between interpolated smoothly.
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to `max_positions`, applied by position id."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], positions: [T] -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

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
        """Per-head RMSNorm of q and k (Qwen3, Gemma 3), then the rotation."""
        return self(norm(q, q_weight, eps), norm(k, k_weight, eps), positions)

    def rotate_into_cache(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,  # [N, bs, KVH, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [T] int64
        q_weight: torch.Tensor | None,  # per-head norms (both or neither)
        k_weight: torch.Tensor | None,
        eps: float,
        norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    ) -> torch.Tensor:
        """The rotated q; the rotated k and v stored at `slots` of the caches. (The Triton
        path does this in one kernel; here it is the rotation, then the scatter.)"""
        if q_weight is not None and k_weight is not None:
            q, k = self.norm_rotate(q, k, positions, q_weight, k_weight, eps, norm)
        else:
            q, k = self(q, k, positions)
        kvh, d = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
        v_cache.view(-1, kvh, d).index_copy_(0, slots, v)
        return q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
