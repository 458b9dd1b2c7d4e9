"""Model loading: HF folders (single and sharded safetensors) and GGUF, against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compute_plane.loader import ModelFilesError, load_model
from compute_plane.model_config import UnsupportedModelError
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_folder_weights_and_config(arch: str, tmp_path: Path) -> None:
    ref = make_tiny_model(arch, tmp_path)
    loaded = load_model(tmp_path, progress=False)
    expected = ref.state_dict()
    assert set(loaded.weights) == set(expected)
    for name, w in expected.items():
        assert torch.equal(loaded.weights[name], w), name
    c, hc = loaded.config, ref.config
    assert c.architecture == arch and loaded.source == "hf"
    assert (c.num_layers, c.hidden_size, c.vocab_size) == (
        hc.num_hidden_layers,
        hc.hidden_size,
        hc.vocab_size,
    )
    assert (c.num_attention_heads, c.num_kv_heads) == (
        hc.num_attention_heads,
        hc.num_key_value_heads,
    )
    assert c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert c.eos_token_ids == (2,)


def test_sharded_safetensors(tmp_path: Path) -> None:
    ref = make_tiny_model("llama", tmp_path, vocab_size=1024)
    # Re-save in shards small enough to need an index.
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path, progress=False)
    for name, w in ref.state_dict().items():
        assert torch.equal(loaded.weights[name], w), name


def test_llama3_rope_scaling_is_read(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    make_tiny_model("llama", tmp_path, rope_scaling=dict(scaling), rope_theta=500000.0)
    cfg = load_model(tmp_path, progress=False).config
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None
    for k, v in scaling.items():
        assert cfg.rope_scaling[k] == v


def test_bundled_gguf_matches_transformers_gguf_loader(smollm2_path: Path, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    loaded = load_model(smollm2_path, progress=False)
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (49152, 1e5, True)
    expected = hf_smollm2.state_dict()
    expected.pop("lm_head.weight")  # tied to the embeddings
    assert set(loaded.weights) == set(expected)
    for name, w in expected.items():
        # q/k rows must come back un-permuted from llama.cpp's rotary layout.
        assert (loaded.weights[name] - w).abs().max().item() <= 1e-6, name


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match=r"config\.json"):
        load_model(tmp_path, progress=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path, progress=False)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFilesError, match=r"model-00002-of-00002\.safetensors"):
        load_model(tmp_path, progress=False)


def test_missing_weights_are_named(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelFilesError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(tmp_path, progress=False)


def test_neither_folder_nor_gguf(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelFilesError, match=r"not a model folder"):
        load_model(f, progress=False)
