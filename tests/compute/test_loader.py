"""Model loading: HF folders (single and sharded safetensors) and GGUF, against transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from compute_plane.loader import ModelLoadError, load_model
from compute_plane.loader.gguf_file import unpermute_rotary
from compute_plane.loader.hf import read_config
from compute_plane.model_config import UnsupportedModelError
from tests.conftest import make_tiny_model


def _assert_same_weights(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, w in ref.items():
        assert ours[name].dtype == w.dtype and torch.equal(ours[name], w), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_folder_weights_and_config(arch: str, tmp_path: Path) -> None:
    ref = make_tiny_model(arch, tmp_path, vocab_size=128)
    loaded = load_model(tmp_path, progress=False)
    _assert_same_weights(loaded.weights, ref.state_dict())
    c, hc = loaded.config, ref.config
    assert (c.architecture, loaded.source, loaded.path) == (arch, "hf", tmp_path)
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        hc.num_hidden_layers,
        hc.hidden_size,
        hc.intermediate_size,
        hc.vocab_size,
    )
    # As HF's attention modules compute it (Qwen2Config has no head_dim).
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    assert (c.num_attention_heads, c.num_kv_heads, c.head_dim) == (
        hc.num_attention_heads,
        hc.num_key_value_heads,
        head_dim,
    )
    assert (c.rms_norm_eps, c.rope_theta) == (hc.rms_norm_eps, hc.rope_parameters["rope_theta"])
    assert (c.max_position_embeddings, c.tie_word_embeddings) == (hc.max_position_embeddings, False)
    assert (c.attention_bias, c.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert (c.rope_scaling, c.bos_token_id, c.eos_token_ids) == (None, 1, (2,))


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    ref = make_tiny_model("llama", tmp_path, tie_word_embeddings=True)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.tie_word_embeddings
    expected = ref.state_dict()
    assert torch.equal(expected.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    _assert_same_weights(loaded.weights, expected)


def test_sharded_safetensors(tmp_path: Path) -> None:
    ref = make_tiny_model("qwen2", tmp_path, vocab_size=1024)
    (tmp_path / "model.safetensors").unlink()
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = list(tmp_path.glob("model-*-of-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(shards) > 1
    _assert_same_weights(load_model(tmp_path, progress=False).weights, ref.state_dict())


def test_dtype_conversion(tmp_path: Path) -> None:
    ref = make_tiny_model("llama", tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    expected = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    _assert_same_weights(loaded.weights, expected)


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
    assert (cfg.rope_theta, cfg.rope_scaling) == (500000.0, scaling)


def _write_config(folder: Path, **fields: object) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **fields,
    }
    (folder / "config.json").write_text(json.dumps(cfg))


def test_transformers4_config_and_eos_union(tmp_path: Path) -> None:
    # Old-style keys: top-level rope_theta, rope_scaling with "type"; no kv heads, no head_dim.
    _write_config(
        tmp_path, rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=2
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    cfg = read_config(tmp_path)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1234.0, {"rope_type": "linear", "factor": 2.0})
    assert (cfg.num_kv_heads, cfg.head_dim) == (2, 8)
    assert cfg.eos_token_ids == (2, 7, 9)


def test_unpermute_rotary_inverts_llama_cpp_permute() -> None:
    # One head, head_dim 4: HF rows [a0 a1 b0 b1] pair a_j with b_j; llama.cpp stores them
    # interleaved as [a0 b0 a1 b1].
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_rotary(stored, 1).ravel().tolist() == [0.0, 1.0, 2.0, 3.0]
    # llama.cpp convert_hf_to_gguf.py's permute, as written there.
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in [(4, 8, 5), (3, 64, 2)]:
        w = rng.standard_normal((n_head * head_dim, cols))
        permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
        assert np.array_equal(unpermute_rotary(permuted, n_head), w)


def test_bundled_gguf_config(smollm2_path: Path) -> None:
    loaded = load_model(smollm2_path, dtype=torch.bfloat16, progress=False)
    c = loaded.config
    assert (c.architecture, loaded.source) == ("llama", "gguf")
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (49152, 1e5, True)
    assert (c.bos_token_id, c.eos_token_ids, c.rope_scaling) == (1, (2,), None)
    assert "lm_head.weight" not in loaded.weights
    assert loaded.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert loaded.weights["model.layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)
    assert {w.dtype for w in loaded.weights.values()} == {torch.bfloat16}


@pytest.mark.slow  # transformers' GGUF load alone takes ~40 s of CPU
def test_bundled_gguf_matches_transformers_gguf_loader(smollm2_path: Path, hf_smollm2: Any) -> None:
    loaded = load_model(smollm2_path, progress=False)
    hc = hf_smollm2.config
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (
        hc.num_hidden_layers,
        hc.hidden_size,
        hc.intermediate_size,
    )
    assert (c.rms_norm_eps, c.max_position_embeddings) == (
        pytest.approx(hc.rms_norm_eps),
        hc.max_position_embeddings,
    )
    expected = hf_smollm2.state_dict()
    expected.pop("lm_head.weight")  # tied to the embeddings
    assert set(loaded.weights) == set(expected)
    for name, w in expected.items():
        # q/k rows must come back un-permuted from llama.cpp's rotary layout.
        assert loaded.weights[name].shape == w.shape, name
        assert (loaded.weights[name] - w).abs().max().item() <= 1e-6, name


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}.*config\.json"):
        load_model(tmp_path, progress=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path, progress=False)


def test_no_safetensors(tmp_path: Path) -> None:
    _write_config(tmp_path)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
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
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        load_model(tmp_path, progress=False)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(tmp_path, progress=False)


def test_weight_the_model_would_ignore_is_refused(tmp_path: Path) -> None:
    # Qwen3 with attention_bias also puts a bias on o_proj, which the model does not apply.
    make_tiny_model("qwen3", tmp_path, attention_bias=True)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_model(tmp_path, progress=False)


def test_corrupt_files(tmp_path: Path) -> None:
    _write_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match=r"safetensors"):
        load_model(tmp_path, progress=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        load_model(bad, progress=False)


def test_a_config_json_that_cannot_be_read_names_the_file_and_field(tmp_path: Path) -> None:
    # Each was a JSONDecodeError without the file's name, or a KeyError / AttributeError /
    # ValueError traceback at compute plane start-up.
    config = tmp_path / "config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{config}: not readable as JSON"):
        load_model(tmp_path, progress=False)
    config.write_text("[]")
    with pytest.raises(ValueError, match=rf"{config}: expected a JSON object, got list"):
        load_model(tmp_path, progress=False)
    _write_config(tmp_path)
    cfg = json.loads(config.read_text())
    del cfg["num_attention_heads"]
    config.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=rf"{config}: missing num_attention_heads"):
        load_model(tmp_path, progress=False)
    _write_config(tmp_path, hidden_size="wide")
    with pytest.raises(ModelLoadError, match=rf"{config}: a field of the wrong type"):
        load_model(tmp_path, progress=False)
    _write_config(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": 5}')
    with pytest.raises(ModelLoadError, match=r"index\.json: no weight_map object"):
        load_model(tmp_path, progress=False)


def test_neither_folder_nor_gguf(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"weights\.bin.*not a model folder"):
        load_model(f, progress=False)


def test_quantization_configs_other_than_fp8_are_refused_by_name(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'gptq' is not supported"):
        load_model(tmp_path, progress=False)
