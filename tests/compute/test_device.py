"""A compute plane on `cuda:N` makes device N current in the threads that launch its
kernels: torch ops follow their tensors, but Triton launches, CUDA graph capture, events
and CuPy use CUDA's current device, which is per thread and 0 until set. No GPU here, so
torch.cuda.set_device is recorded instead of called."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import compute_plane.engine as engine_module
from compute_plane.config import ComputeConfig
from compute_plane.device import use_device
from compute_plane.engine import Engine, load_for


def test_use_device_sets_a_cuda_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_device(torch.device("cpu"))
    assert calls == []
    use_device(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_a_cuda_device_without_an_index_is_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's set_device refuses `cuda` without an index (a lent H200's start-up
    failed so on 2026-11-27): use_device passes the current device's index instead, and
    `--device auto` resolves to an indexed device."""
    from compute_plane.device import resolve_device

    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    use_device(torch.device("cuda"))
    assert calls == [2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda", 2)


def test_the_engine_makes_its_device_current(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[torch.device] = []
    monkeypatch.setattr(engine_module, "use_device", seen.append)
    config = ComputeConfig(model=str(smollm2_path), kv_cache_bytes=4 << 20)
    engine = Engine(config, load_for(config, smollm2_path))
    assert seen == [engine.device] == [torch.device("cpu")]
