"""Choosing an attention backend, and the kernel set the model runs with it.

backend = resolve_attention_backend(config.attention_backend, device, dtype)
model = Model(..., kernels=model_kernels(backend, model_config, device))
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from compute_plane.attention.cpu import CPUPagedAttention, KernelUnavailable, load_kernel
from compute_plane.kernels import interpreted
from compute_plane.model import ModelKernels, add_rms_norm, rms_norm
from compute_plane.model_config import ModelConfig
from compute_plane.rotary import RotaryEmbedding

log = logging.getLogger(__name__)


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto = triton on CUDA; on the CPU the C kernel for fp32 (torch where it can't be built,
    or for other dtypes). triton on the CPU is the interpreter's test mode."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        elif dtype != torch.float32:
            name = "torch"
        else:
            try:
                load_kernel()
                name = "cpu"
            except KernelUnavailable as e:
                log.warning("CPU attention kernel unavailable, using the torch backend: %s", e)
                name = "torch"
    if name == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                f"attention backend 'cpu' runs on the CPU in float32, not {device.type} "
                f"{str(dtype).removeprefix('torch.')}; use --attention-backend torch"
            )
        try:
            load_kernel()
        except KernelUnavailable as e:
            raise ValueError(f"attention backend 'cpu': {e}") from e
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention backend 'triton' needs the triton package "
                "(pip install 'hetero-paged-infer[gpu]')"
            )
        if device.type == "cpu" and not interpreted():
            raise ValueError(
                "attention backend 'triton' on the CPU runs only under the Triton interpreter "
                "(TRITON_INTERPRET=1, a test mode); use --attention-backend cpu or torch"
            )
    return name


def model_kernels(backend: str, cfg: ModelConfig, device: torch.device) -> ModelKernels | None:
    """The kernel set of a resolved backend; None = the model's torch default."""
    if backend == "cpu":
        return ModelKernels(CPUPagedAttention(cfg.scale), rms_norm, add_rms_norm, RotaryEmbedding)
    if backend != "triton":
        return None
    from compute_plane.attention.triton_backend import triton_kernels  # imports triton

    return triton_kernels(cfg, device)
