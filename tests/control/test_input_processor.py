"""The input processor alone: each bad field refused with a message that names it, and a
good request turned into one scheduler Request per choice (no engine, no gRPC)."""

from __future__ import annotations

from pathlib import Path

import pytest

from control_plane.input_processor import InputProcessor, ModelBounds
from control_plane.scheduler import AdmissionError
from control_plane.tokenizer import TokenizerWrapper, load_tokenizer
from hetero_common.limits import MAX_N, MAX_STOPS
from hetero_proto import control_pb2 as pb

BOUNDS = ModelBounds(max_model_len=64, vocab_size=49152, eos_token_ids=frozenset({2}))


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def inputs(tok: TokenizerWrapper) -> InputProcessor:
    return InputProcessor(tok)


@pytest.mark.parametrize(
    ("prompt", "params", "names"),
    [
        ([1, 2], pb.GenerationParams(n=MAX_N + 1), "n must be in 1..16"),
        ([1, 2], pb.GenerationParams(max_tokens=-1), "max_tokens"),
        ([1, 2], pb.GenerationParams(stop=["x"] * (MAX_STOPS + 1)), "stop strings"),
        ([1, 2], pb.GenerationParams(stop=["x" * 257]), "256 characters"),
        ([], pb.GenerationParams(), "empty"),
        ([1] * 64, pb.GenerationParams(), "64 tokens"),
        ([1, 49152], pb.GenerationParams(), "0..49151"),
        ([1, -1], pb.GenerationParams(), "0..49151"),
        ([1, 2], pb.GenerationParams(max_tokens=3, min_tokens=4), "min_tokens (4)"),
        ([1, 2], pb.GenerationParams(temperature=-0.5), "temperature"),
        # The gateway's bounds (docs/api.md), for gRPC and OfflineLLM too:
        ([1, 2], pb.GenerationParams(temperature=2.5), "temperature must be in [0, 2]"),
        (
            [1, 2],
            pb.GenerationParams(repetition_penalty=11),
            "repetition_penalty must be in (0, 10]",
        ),
        ([1, 2], pb.GenerationParams(top_p=1.5), "top_p"),
        ([1, 2], pb.GenerationParams(frequency_penalty=3.0), "frequency_penalty"),
        ([1, 2], pb.GenerationParams(top_logprobs=21), "top_logprobs"),
        # Values that would be silently ignored or misread:
        ([1, 2], pb.GenerationParams(top_logprobs=2), "top_logprobs needs logprobs"),
        ([1, 2], pb.GenerationParams(stop=["x", ""]), "stop strings must not be empty"),
        ([1, 2], pb.GenerationParams(top_k=-5), "top_k must be 0 or -1 (off) or > 0, got -5"),
        (
            [1, 2],
            pb.GenerationParams(prompt_only=True, max_tokens=4),
            "prompt_only generates nothing: max_tokens must be 0, got 4",
        ),
        ([1, 2], pb.GenerationParams(prompt_only=True, min_tokens=1), "min_tokens (1)"),
        (
            [1, 2],
            pb.GenerationParams(structured=pb.StructuredOutput(json_object=False)),
            "json_object must be true when set",
        ),
    ],
)
def test_a_bad_field_is_refused_by_name(
    inputs: InputProcessor, prompt: list[int], params: pb.GenerationParams, names: str
) -> None:
    with pytest.raises(AdmissionError) as e:
        inputs.check(prompt, params, BOUNDS)
    assert names in str(e.value)


@pytest.mark.parametrize(
    "params",
    [
        pb.GenerationParams(top_k=-1),
        pb.GenerationParams(top_k=1),
        pb.GenerationParams(temperature=2.0, repetition_penalty=10.0),
        pb.GenerationParams(logprobs=True),
        pb.GenerationParams(logprobs=True, top_logprobs=2),
        pb.GenerationParams(stop=["x"]),
        pb.GenerationParams(structured=pb.StructuredOutput(json_object=True)),
    ],
)
def test_the_values_next_to_refused_ones_are_accepted(
    inputs: InputProcessor, params: pb.GenerationParams
) -> None:
    assert inputs.check([1, 2], params, BOUNDS) == 62


def test_max_tokens_defaults_to_what_the_context_leaves(inputs: InputProcessor) -> None:
    assert inputs.check([5] * 10, pb.GenerationParams(), BOUNDS) == 54
    assert inputs.check([5] * 10, pb.GenerationParams(max_tokens=7), BOUNDS) == 7


def test_prompt_only_generates_nothing_whatever_the_context_leaves(
    inputs: InputProcessor,
) -> None:
    """prompt_only's max_tokens 0 is no output, not "up to the context"; each choice
    samples once, when its prompt is computed, and drops that token."""
    params = pb.GenerationParams(prompt_only=True, n=2, prompt_logprobs=3)
    max_tokens = inputs.check([5] * 63, params, BOUNDS)  # (one position short of the context)
    assert max_tokens == 0
    stream = inputs.make_stream("s", [5] * 63, params, BOUNDS, max_tokens)
    reqs = [c.request for c in stream.choices]
    assert [(r.prompt_only, r.max_tokens, r.max_num_tokens) for r in reqs] == [(True, 1, 64)] * 2
    assert inputs.check([1, 2], pb.GenerationParams(), BOUNDS) == 62  # unset: as before


def test_a_good_request_becomes_one_request_per_choice(
    inputs: InputProcessor, tok: TokenizerWrapper
) -> None:
    prompt = tok.encode("Hello there", add_special_tokens=False)
    params = pb.GenerationParams(
        n=3, max_tokens=8, min_tokens=2, seed=41, stop=["!"], stop_token_ids=[7], temperature=0.7
    )
    max_tokens = inputs.check(prompt, params, BOUNDS)
    stream = inputs.make_stream("abc", prompt, params, BOUNDS, max_tokens, client_id="c")
    reqs = [c.request for c in stream.choices]
    assert [r.request_id for r in reqs] == ["abc-0", "abc-1", "abc-2"]
    assert all(r.prompt_token_ids == prompt and r.max_tokens == 8 for r in reqs)
    assert [r.sampling.seed for r in reqs] == [41, 42, 43]  # distinct, reproducible
    # EOS and the stop token are masked until min_tokens tokens exist.
    assert all(list(r.sampling.min_tokens_banned_ids) == [2, 7] for r in reqs)
    assert (
        reqs[0].stop_token_ids == frozenset({7}) and reqs[0].eos_token_ids == BOUNDS.eos_token_ids
    )
    assert [c.index for c in stream.choices] == [0, 1, 2] and stream.client_id == "c"


def test_ignore_eos_leaves_eos_unmasked(inputs: InputProcessor) -> None:
    params = pb.GenerationParams(max_tokens=8, min_tokens=2, ignore_eos=True, stop_token_ids=[9])
    sampling = inputs.sampling(params, 0, BOUNDS)
    assert list(sampling.min_tokens_banned_ids) == [9]
    assert inputs.sampling(pb.GenerationParams(seed=2**64 - 1), 1, BOUNDS).seed == 0  # wraps
