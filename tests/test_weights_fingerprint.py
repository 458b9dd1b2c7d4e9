"""hetero_common.weights: the weights fingerprint by which the control plane refuses a
compute plane whose weights are not the attached ones' (another fine-tune of the same
shape and vocabulary), and never the same weights in another form: an HF folder in f32 or
bf16, a GGUF copy of it (quantized matrices, F32 norms) loaded dense or quantized, with
any --quantization."""

from __future__ import annotations

import copy
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from compute_plane.loader import load_model
from compute_plane.loader.fingerprint import weights_fingerprint
from hetero_common import weights
from tests.conftest import make_tiny_model

_GGUF_NAMES = {  # Hugging Face -> llama.cpp (as convert_hf_to_gguf writes them)
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    _, _, layer, *part, kind = name.split(".")
    return f"blk.{layer}.{_GGUF_NAMES['.'.join(part)]}.{kind}"


def _to_gguf(model: torch.nn.Module, path: Path, matrices: Q) -> Path:
    """A llama.cpp-style GGUF copy of a tiny HF Llama: matrices in `matrices`' type, 1-D
    tensors in F32, q/k rows permuted to llama.cpp's rotary layout (written here with
    gguf-py, independently of our loader)."""
    cfg = model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0)
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        for part, n in heads.items():
            if f".{part}." in name:  # HF's halves -> llama.cpp's interleaved pairs
                a = a.reshape(n, 2, a.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(a.shape)
        if a.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _fingerprint(path: Path, quantized: bool = False) -> bytes:
    return weights_fingerprint(load_model(path, progress=False, quantized=quantized))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny Llama (seed 0) in several forms, and another (seed 1) of the same shape."""
    d = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model("llama", d / "hf")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(d / "hf-bf16")
    other = make_tiny_model("llama", d / "other", seed=1)
    return {
        "hf": d / "hf",
        "hf-bf16": d / "hf-bf16",
        "q8_0": _to_gguf(model, d / "tiny.q8_0.gguf", Q.Q8_0),
        "q4_0": _to_gguf(model, d / "tiny.q4_0.gguf", Q.Q4_0),
        "f16": _to_gguf(model, d / "tiny.f16.gguf", Q.F16),
        "other": d / "other",
        "other-q4_0": _to_gguf(other, d / "other.q4_0.gguf", Q.Q4_0),
    }


@pytest.mark.parametrize("form", ["hf-bf16", "q8_0", "q4_0", "f16"])
def test_the_same_weights_in_another_form_agree(tiny: dict[str, Path], form: str) -> None:
    ref = _fingerprint(tiny["hf"])
    assert weights.difference(ref, _fingerprint(tiny[form])) is None
    assert weights.difference(_fingerprint(tiny[form]), ref) is None


@pytest.mark.parametrize("form", ["q8_0", "q4_0"])
def test_a_gguf_loaded_quantized_or_dense_is_the_same_fingerprint(
    tiny: dict[str, Path], form: str
) -> None:
    """--quantization gguf keeps a GGUF's matrices quantized (QuantWeight, its rows
    dequantized only where sampled); dense, they are dequantized at load: one checkpoint."""
    assert (
        weights.difference(_fingerprint(tiny[form], quantized=True), _fingerprint(tiny[form]))
        is None
    )


@pytest.mark.parametrize("form", ["hf", "hf-bf16", "q8_0", "q4_0", "f16"])
def test_other_weights_of_the_same_shape_differ_in_any_form(
    tiny: dict[str, Path], form: str
) -> None:
    for other in ("other", "other-q4_0"):
        why = weights.difference(_fingerprint(tiny[form]), _fingerprint(tiny[other]))
        assert why is not None and why.startswith("model.embed_tokens.weight differs"), why


@pytest.mark.parametrize(
    "name", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
)
def test_a_fine_tune_that_moved_one_matrix_slightly_differs_between_dense_forms(
    tiny: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """A change of 5% to one matrix (a merged adapter, LoRA's on q_proj too, moves less
    than Q4's error, more than bf16 rounding): told apart between dense forms, and
    knowingly not from a Q4_0 copy (docs/protocol.md says so)."""
    from safetensors.torch import load_file, save_file

    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "config.json").write_bytes((tiny["hf"] / "config.json").read_bytes())
    state = load_file(str(tiny["hf"] / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    state[name] = state[name] * (1 + 0.05 * torch.randn(state[name].shape, generator=gen))
    save_file(state, str(tuned / "model.safetensors"))
    why = weights.difference(_fingerprint(tiny["hf"]), _fingerprint(tuned))
    assert why is not None and why.startswith(f"{name} differs"), why
    assert weights.difference(_fingerprint(tiny["hf-bf16"]), _fingerprint(tuned)) is not None
    assert weights.difference(_fingerprint(tiny["q4_0"]), _fingerprint(tuned)) is None


def test_no_fingerprint_or_an_unreadable_one_says_nothing() -> None:
    """A compute plane that sends none (an older one), or one of another version or a
    broken length: not compared, never an error in the control plane."""
    one = weights.encode([(False, [1.0] * weights.SAMPLES)] * 11)
    assert weights.difference(b"", one) is None and weights.difference(one, b"") is None
    assert weights.difference(bytes([weights.VERSION + 1]) + one[1:], one) is None
    assert weights.difference(one[:-1], one) is None
    assert weights.difference(weights.encode([(False, [1.0] * weights.SAMPLES)] * 3), one) is None
    two_layers = weights.encode([(False, [1.0] * weights.SAMPLES)] * 20)
    assert weights.difference(two_layers, one) == "20 tensors sampled, not 11"
    nan = weights.encode([(False, [float("nan")] * weights.SAMPLES)] * 11)
    assert weights.difference(nan, one) is not None


def test_the_fingerprint_layout() -> None:
    """What docs/protocol.md describes: a version byte, then per tensor of sampled_names a
    flag byte and SAMPLES little-endian float32 values."""
    fp = weights.encode([(True, [0.5] * weights.SAMPLES), (False, [-2.0] * weights.SAMPLES)])
    assert fp[0] == 1 and len(fp) == 1 + 2 * (1 + 4 * weights.SAMPLES)
    assert fp[1] == 1 and struct.unpack_from("<f", fp, 2) == (0.5,)
    assert weights.sampled_names(1) == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]
    assert weights.positions(16 * 100) == sorted(set(weights.positions(16 * 100)))
    assert all(0 <= p < 10 for p in weights.positions(10))
