"""Turn the config's `auto` choices into a device and a dtype (the attention backend:
compute_plane.attention.factory)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """auto = the current CUDA device (with its index) if torch sees one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r}: torch sees no CUDA device (torch {torch.__version__}, "
            "CUDA build: {}); use --device cpu".format(torch.version.cuda or "no")
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device) -> None:
    """Make a CUDA `device` the calling thread's current one. Torch's own ops follow their
    tensors' device, but Triton launches, CUDA graph capture, events and CuPy go to the
    current device, which CUDA keeps per thread (device 0 until set): without this, a
    compute plane on `cuda:1` would launch its kernels on device 0."""
    if device.type == "cuda":  # (torch 2.11 refuses a CUDA device without an index here)
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = float32 on the CPU; bfloat16 on CUDA (float16 where the GPU lacks bf16)."""
    if name != "auto":
        dtype: torch.dtype = getattr(torch, name)
        return dtype
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def resolve_quantization(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """What the weights become (quant.prepare's modes): None (all dense); on the CPU in
    float32, "gguf" (a quantized GGUF's weights stay quantized, the C kernels) or "int8"
    (dense matrices quantized too, per group of 32); elsewhere (GPU, bf16/fp16),
    "checkpoint" (an FP8 checkpoint stays FP8; `auto`), "fp8" or "int8_scaled" (the
    layer matrices quantized per output channel on load: compute_plane.scaled)."""
    from compute_plane.quant import kernels_available

    if name == "none":
        return None
    cpu_kernels = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        if cpu_kernels:
            return "gguf" if kernels_available() else None
        return "checkpoint"
    if name == "fp8":
        return "fp8"
    if not cpu_kernels:
        return "int8_scaled"
    if not kernels_available():
        raise ValueError(f"--quantization {name}: the quantized CPU kernels cannot be built here")
    return name
