"""The sampler against hand-computed distributions and penalties."""

from __future__ import annotations

import math

import pytest
import torch

from compute_plane.sampler import sample
from compute_plane.sampling_params import SamplingSpec


def _one(
    logits: list[float],
    spec: SamplingSpec,
    output: list[int] = (),
    prompt: list[int] = (),
    pos: int = 0,
) -> int:  # type: ignore[assignment]
    return sample(torch.tensor([logits]), [spec], [list(prompt)], [list(output)], [pos]).token_ids[
        0
    ]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50)
    out = sample(logits, [SamplingSpec()] * 6, [[]] * 6, [[]] * 6, list(range(6)))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_distribution_matches_softmax() -> None:
    logits = [1.0, 0.0, -1.0, 0.5, 2.0]
    probs = torch.tensor(logits).softmax(-1)
    spec = SamplingSpec(temperature=1.0, seed=0)
    draws = [_one(logits, SamplingSpec(temperature=1.0, seed=s)) for s in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert (freq - probs).abs().max().item() < 0.03
    assert spec.validate() is None


def test_temperature_sharpens() -> None:
    logits = [1.0, 0.0]
    cold = [_one(logits, SamplingSpec(temperature=0.2, seed=s)) for s in range(500)]
    assert cold.count(0) / 500 > 0.97  # softmax([5, 0]) puts 0.993 on token 0


def test_top_p_top_k_min_p_exclude_the_tail() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0]).log_softmax(-1).tolist()
    p = torch.tensor(logits).exp()
    # top_p 0.8: tokens 0 and 1 hold 0.665 + 0.245 >= 0.8, so 2..4 are never drawn.
    assert p[0] < 0.8 <= p[0] + p[1]
    for s in range(300):
        assert _one(logits, SamplingSpec(temperature=1.0, top_p=0.8, seed=s)) in (0, 1)
        assert _one(logits, SamplingSpec(temperature=1.0, top_k=2, seed=s)) in (0, 1)
        # min_p 0.3: p >= 0.3 * p0 = 0.2 keeps tokens 0 and 1 only.
        assert _one(logits, SamplingSpec(temperature=1.0, min_p=0.3, seed=s)) in (0, 1)


def test_penalties_flip_the_argmax() -> None:
    logits = [2.0, 1.9, -1.0]
    assert _one(logits, SamplingSpec()) == 0
    # repetition 1.2 on token 0 (seen in the prompt): 2.0 / 1.2 = 1.67 < 1.9
    assert _one(logits, SamplingSpec(repetition_penalty=1.2), prompt=[0]) == 1
    # negative logits are multiplied: -1.0 * 1.2 would be smaller still, token 0 stays best
    assert _one([-1.0, -1.1], SamplingSpec(repetition_penalty=1.2), prompt=[1]) == 0
    # frequency 0.06 × 2 occurrences = 0.12 > 0.1 gap
    assert _one(logits, SamplingSpec(frequency_penalty=0.06), output=[0, 0]) == 1
    assert _one(logits, SamplingSpec(frequency_penalty=0.06), output=[0]) == 0
    # presence counts once
    assert _one(logits, SamplingSpec(presence_penalty=0.15), output=[0]) == 1


def test_logprobs_and_top_logprobs() -> None:
    logits = torch.randn(2, 30)
    specs = [
        SamplingSpec(logprobs=True, top_logprobs=4),
        SamplingSpec(temperature=1.0, seed=3, logprobs=True),
    ]
    out = sample(logits, specs, [[], []], [[], []], [0, 0])
    ref = logits.log_softmax(-1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs is not None
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    vals, ids = ref[0].topk(4)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids[0] == ids.tolist()
    assert out.top_logprobs[0] == pytest.approx(vals.tolist(), abs=1e-5)


def test_banned_ids_are_never_sampled() -> None:
    out = sample(torch.tensor([[5.0, 0.0, 0.0]]), [SamplingSpec()], [[]], [[]], [0], [(0,)])
    assert out.token_ids[0] != 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", math.inf),
        ("presence_penalty", 3.0),
        ("top_logprobs", 21),
    ],
)
def test_validate_names_the_field(field: str, value: float) -> None:
    problem = SamplingSpec(**{field: value}).validate()  # type: ignore[arg-type]
    assert problem is not None and field in problem
