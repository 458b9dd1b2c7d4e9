"""Shared fixtures: the bundled model, its independent HF reference, tiny random HF models."""

from __future__ import annotations

import importlib.metadata
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetero_common.model_path import bundled_gguf

TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "mistral")


def installed(*distributions: str) -> bool:
    """Whether every one of these packages is installed (for skipping tests on a machine,
    such as a lent GPU one, that lacks a bundled model's package)."""
    try:
        for name in distributions:
            importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture
def ctrl_c_delivered() -> Iterator[None]:
    """SIGINT acts as a terminal's Ctrl-C in this process and the ones it starts, however
    pytest was launched: a shell without job control starts a background command with
    SIGINT ignored, which its children inherit, and Python then raises no
    KeyboardInterrupt (nor does a child die of it) where a user's Ctrl-C would."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return bundled_gguf()


@pytest.fixture(scope="session")
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file with gguf-py's GGUFReader for the config, again for
    the weights and again for the tokenizer; each parse of Gemma 3's 262k-token vocabulary
    takes ~20 s here. While this fixture is up, gguf.GGUFReader hands back the reader it
    already made for the same unchanged file, so each file is parsed once, and parses over
    an ndarray view of the file. What transformers does with the reader (its
    dequantisation, config, tokenizer) is unchanged."""
    import gguf
    import numpy as np

    readers: dict[tuple[str, int, int, str], Any] = {}

    def key(path: str | os.PathLike[str], mode: str) -> tuple[str, int, int, str]:
        st = os.stat(path)
        return os.path.realpath(path), st.st_mtime_ns, st.st_size, mode

    class ParsedOnce(gguf.GGUFReader):  # subclasses of it (none yet) parse as before
        def __new__(cls, path: str | os.PathLike[str], mode: str = "r") -> Any:
            if cls is ParsedOnce and key(path, mode) in readers:
                return readers[key(path, mode)]
            return super().__new__(cls)

        def __init__(self, path: str | os.PathLike[str], mode: str = "r") -> None:
            if type(self) is ParsedOnce and readers.get(key(path, mode)) is self:
                return
            super().__init__(path, mode)  # type: ignore[arg-type]
            if type(self) is ParsedOnce:
                readers[key(path, mode)] = self

        def _build_fields(self, *args: Any, **kwargs: Any) -> Any:
            # gguf-py's own parse, over a plain ndarray view of its mmap: slicing np.memmap
            # is ~5x slower, and the same bytes come out.
            self.data = self.data.view(np.ndarray)
            return super()._build_fields(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", ParsedOnce)
        yield


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path, gguf_parsed_once: None):  # type: ignore[no-untyped-def]
    """transformers' own GGUF loader: an independent dequantisation of the bundled model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


def make_tiny_model(arch: str, out: Path, *, seed: int = 0, **overrides: object):  # type: ignore[no-untyped-def]
    """A randomly initialised HF model of `arch`, saved as safetensors in `out`; returns it."""
    import torch
    import transformers

    common: dict[str, object] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    if arch in ("qwen3", "gemma3"):
        common.setdefault("head_dim", 16)
    if arch == "gemma3":
        # Two sliding-window (local) layers and a global one, a window shorter than the
        # prompts, the two rotary bases, and a query scale that is not head_dim's.
        common.update(num_hidden_layers=3, tie_word_embeddings=True, query_pre_attn_scalar=24)
        common.setdefault("sliding_window", 6)
        common.setdefault(
            "layer_types", ["sliding_attention", "sliding_attention", "full_attention"]
        )
        common.setdefault(
            "rope_parameters",
            {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    torch.manual_seed(seed)
    model = cls[1](cls[0](**common)).eval()
    # HF initialises biases to 0 and norm weights to 1; perturb them so they matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path: Path, gguf_parsed_once: None):  # type: ignore[no-untyped-def]
    """transformers' GGUF tokenizer (splits digits differently from the model: use digit-free text)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' greedy `generate`, EOS ignored so exactly max_new_tokens come back."""
    return hf_greedy_batch(model, [prompt], max_new_tokens)[0]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """transformers' greedy `generate` for all the prompts in one batch, left-padded under
    an attention mask where their lengths differ (as transformers batches prompts of
    different lengths), EOS ignored.
    A step reads the weights once for every prompt, where `hf_greedy` reads them once per
    prompt: Gemma 3 270M's 4 x 32 tokens take 5.4 s rather than 14.3 (its 262k-row
    lm_head dominates), SmolLM2's 2.9 rather than 7.9; the tokens were the same for both
    models' test prompts."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = None  # no padding: generate's own causal mask
    if any(len(p) < width for p in prompts):
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [[int(t) for t in row[width:]] for row in out]
