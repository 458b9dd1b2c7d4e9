"""The loaded weights' fingerprint (hetero_common.weights): a few values of each sampled
tensor, read from the weights in memory (nothing more is read from the file)."""

from __future__ import annotations

import torch

from compute_plane.loader import LoadedModel
from compute_plane.quant import QuantWeight
from compute_plane.scaled import ScaledWeight
from hetero_common import weights as fingerprint


def _values(w: torch.Tensor | QuantWeight | ScaledWeight, flat: list[int]) -> list[float]:
    """The values at row-major positions `flat` of a weight, in fp32."""
    if isinstance(w, torch.Tensor):
        return torch.take(w.detach(), torch.tensor(flat)).to(torch.float32).tolist()
    k = w.shape[1]
    rows = torch.tensor([i // k for i in flat])
    cols = torch.tensor([i % k for i in flat])
    if isinstance(w, QuantWeight):  # (only the rows sampled are dequantized)
        return w.dequantize(rows)[torch.arange(len(flat)), cols].tolist()
    data = w.data[rows, cols].to(torch.float32)  # ScaledWeight: scale per row
    return (data * w.scale[rows].to(torch.float32)).tolist()


def weights_fingerprint(loaded: LoadedModel) -> bytes:
    """hetero_common.weights' fingerprint of the model's weights as loaded (before any
    --quantization of the engine's)."""
    samples = []
    for name in fingerprint.sampled_names(loaded.config.num_layers):
        w = loaded.weights[name]
        numel = w.numel() if isinstance(w, torch.Tensor) else w.shape[0] * w.shape[1]
        samples.append((name in loaded.lossy, _values(w, fingerprint.positions(numel))))
    return fingerprint.encode(samples)
