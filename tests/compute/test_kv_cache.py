"""The CPU KV pool: zeros that take neither start-up time nor resident memory until its
blocks are written (an anonymous mapping's zero pages), then hold what was written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from compute_plane import host_memory
from compute_plane.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget
from compute_plane.model_config import ModelConfig

CFG = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=192,
    intermediate_size=512,
    num_layers=30,
    num_attention_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)  # SmolLM2-135M's cache shape


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_pool_is_resident_only_where_written() -> None:
    budget = 512 << 20
    n = num_blocks_for_budget(CFG, 16, torch.float32, budget)
    before = _rss()
    cache = KVCache(CFG, n, 16, torch.float32, torch.device("cpu"))
    assert cache.nbytes == n * bytes_per_block(CFG, 16, torch.float32) > budget - (1 << 20)
    assert _rss() - before < 32 << 20  # torch.zeros would have made all 512 MiB resident
    assert len(cache.layers) == CFG.num_layers
    for k, v in cache.layers:
        for t in (k, v):
            assert t.shape == (n, 16, 3, 64) and t.dtype == torch.float32
            assert t.is_contiguous() and t.data_ptr() % 4096 == 0
    k0, v7 = cache.layers[0][0], cache.layers[7][1]
    assert not k0.any() and not v7.any()  # zero pages read as zeros
    k0[n - 1] = 1.5
    v7[1:3] = -2.0
    assert float(k0.sum()) == 1.5 * 16 * 3 * 64 and float(v7.sum()) == -2.0 * 2 * 16 * 3 * 64
    assert not cache.layers[0][1].any() and not cache.layers[7][0].any()  # no aliasing
    # what was written, and the reads' temporaries (~11 MiB each), of 512 MiB
    assert _rss() - before < 96 << 20


def test_a_view_keeps_the_mapping_alive() -> None:
    cache = KVCache(CFG, 64, 16, torch.float32, torch.device("cpu"))
    k = cache.layers[3][0]
    k[5] = 4.0
    del cache
    assert float(k[5].sum()) == 4.0 * 16 * 3 * 64 and not k[6].any()


def test_host_memory_left_by_a_cgroup_v2_and_v1(tmp_path: Path) -> None:
    # The limit less the working set (usage without the inactive page cache).
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("600000\n")
    (tmp_path / "memory.stat").write_text("anon 300000\ninactive_file 200000\n")
    assert host_memory.cgroup_memory_left(tmp_path) == 600000
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory.cgroup_memory_left(tmp_path) is None
    for name in ("memory.max", "memory.current", "memory.stat"):
        (tmp_path / name).unlink()
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("1000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1500000\n")  # over: nothing left
    assert host_memory.cgroup_memory_left(tmp_path) == 0
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    assert host_memory.cgroup_memory_left(tmp_path) is None
    assert host_memory.cgroup_memory_left(tmp_path / "absent") is None
    (tmp_path / "meminfo").write_text("MemTotal: 2048 kB\nMemAvailable: 1024 kB\n")
    assert host_memory.mem_available(tmp_path / "meminfo") == 1 << 20
    assert host_memory.mem_available(tmp_path / "absent") is None


def test_a_kv_budget_past_the_memory_available_names_the_flag_and_both_sizes() -> None:
    available = host_memory.mem_available()
    if available is None:
        pytest.skip("no /proc/meminfo")
    host_memory.check_kv_budget(1 << 20)
    with pytest.raises(ValueError, match=r"--kv-cache-bytes (\d+) \(.* GiB\) is more than") as e:
        host_memory.check_kv_budget(4 * available)
    assert f"--kv-cache-bytes {4 * available} " in str(e.value)


def test_the_weights_count_against_the_memory_with_the_kv_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """serve --compute-planes N: each plane holds the weights and its KV cache; a check of
    N x the KV cache alone passed a serve whose weights then took the room (OOM killer)."""
    gib = 1 << 30
    monkeypatch.setattr(host_memory, "mem_available", lambda: 10 * gib)
    monkeypatch.setattr(host_memory, "cgroup_memory_left", lambda: None)
    host_memory.check_kv_budget(4 * gib, 2, weights=gib)  # 2 x 5 GiB: just fits
    with pytest.raises(ValueError) as e:
        host_memory.check_kv_budget(4 * gib, 2, weights=gib + 1)
    assert str(e.value) == (
        f"--compute-planes 2 x (--kv-cache-bytes {4 * gib} (4.0 GiB) + the weights, "
        f"~{gib + 1} bytes (1.0 GiB: the model files' size, an estimate)) = {10 * gib + 2} "
        f"bytes (10.0 GiB) is more than the memory available, {10 * gib} bytes (10.0 GiB: "
        "MemAvailable in /proc/meminfo); the OOM killer would end the compute plane as the "
        "cache fills: lower --kv-cache-bytes or --compute-planes"
    )
    with pytest.raises(ValueError, match="the weights alone do not fit: a smaller model or"):
        host_memory.check_kv_budget(1, 2, weights=5 * gib)
    with pytest.raises(ValueError, match=r"\+ the weights, ~\d+ bytes .* = \d+ bytes"):
        host_memory.check_kv_budget(6 * gib, 1, weights=5 * gib)


def test_the_weights_estimate_is_the_size_of_the_weight_files(tmp_path: Path) -> None:
    """serve's estimate of a model's weights in memory: a folder's *.safetensors (shards
    too), not its config or tokenizer; a .gguf file's size."""
    from safetensors.torch import save_file

    from hetero_common.model_path import weights_bytes

    save_file({"a": torch.zeros(1000)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3000)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}" + " " * 100_000)
    shards = [p.stat().st_size for p in tmp_path.glob("model-*")]
    assert len(shards) == 2 and min(shards) > 4000
    assert weights_bytes(tmp_path) == sum(shards)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 12345)
    assert weights_bytes(gguf) == 12345
