"""The sampler against hand-computed logits, independent log_softmax / softmax references and
empirical distributions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compute_plane.sampler import SampleOutput, SamplingSpec, sample_on_device
from hetero_proto import compute_pb2 as pb

# Probabilities chosen by hand; the logits are their logs, so softmax(logits) == P.
P = [0.4, 0.25, 0.2, 0.1, 0.05]
LOGITS = [math.log(p) for p in P]
CHI2_DF4_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


def sample(*args: Any) -> SampleOutput:
    """The sampler's output on the host."""
    return sample_on_device(*args).to_host()


def _batch(
    logits: Sequence[Sequence[float]] | torch.Tensor,
    specs: list[SamplingSpec],
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
    pos: list[int] | None = None,
    banned: list[tuple[int, ...]] | None = None,
) -> SampleOutput:
    t = torch.as_tensor(logits, dtype=torch.float32)
    n = t.shape[0]
    return sample(t, specs, prompt or [[]] * n, output or [[]] * n, pos or [0] * n, banned)


def _draws(logits: Sequence[float], spec: SamplingSpec, n: int) -> list[int]:
    """n unseeded draws from one distribution, as one batch."""
    torch.manual_seed(1234)
    return _batch([list(logits)] * n, [spec] * n).token_ids


def _freq(tokens: list[int], vocab: int) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return (counts / len(tokens)).tolist()


def _chi2(tokens: list[int], probs: list[float]) -> float:
    counts = _freq(tokens, len(probs))
    n = len(tokens)
    return sum((c * n - p * n) ** 2 / (p * n) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_greedy_is_argmax_on_fast_and_full_paths() -> None:
    logits = torch.randn(6, 50)
    want = logits.argmax(-1).tolist()
    assert _batch(logits, [SamplingSpec()] * 6).token_ids == want
    # logprobs force the full path; the choice must not change
    assert _batch(logits, [SamplingSpec(logprobs=True)] * 6).token_ids == want


def test_top_k_one_is_greedy_even_at_temperature_one() -> None:
    logits = torch.randn(8, 300)
    specs = [SamplingSpec(temperature=1.0, top_k=1, seed=s if s % 2 else None) for s in range(8)]
    assert _batch(logits, specs).token_ids == logits.argmax(-1).tolist()


def test_seeded_row_ignores_batch_and_order() -> None:
    row = torch.randn(1000)
    spec = SamplingSpec(temperature=1.0, top_p=0.9, seed=42)
    others = [
        SamplingSpec(temperature=0.7),  # unseeded
        SamplingSpec(temperature=1.0, seed=7),
        SamplingSpec(),  # greedy
        SamplingSpec(temperature=1.3, top_k=50, min_p=0.01, seed=42),
    ]
    for pos in range(10):
        alone = _batch(row[None], [spec], pos=[pos]).token_ids[0]
        for at in (0, 2, 4):
            specs = [*others[:at], spec, *others[at:]]
            logits = torch.randn(5, 1000)
            logits[at] = row
            positions = [pos if i == at else 99 - i for i in range(5)]
            assert _batch(logits, specs, pos=positions).token_ids[at] == alone


def test_different_seeds_give_different_sequences() -> None:
    logits = torch.zeros(20, 100)  # uniform: a collision has chance 1/100 per position
    seqs = {
        seed: _batch(
            logits, [SamplingSpec(temperature=1.0, seed=seed)] * 20, pos=list(range(20))
        ).token_ids
        for seed in (1, 2, 3)
    }
    assert len({tuple(s) for s in seqs.values()}) == 3
    assert all(len(set(s)) > 10 for s in seqs.values())  # positions draw afresh


def test_unseeded_distribution_matches_softmax() -> None:
    freq = _freq(_draws(LOGITS, SamplingSpec(temperature=1.0), 20_000), 5)
    assert max(abs(f - p) for f, p in zip(freq, P, strict=True)) < 0.02


def test_seeded_distribution_matches_softmax() -> None:
    n = 4000
    specs = [SamplingSpec(temperature=1.0, seed=s) for s in range(n)]
    assert _chi2(_batch([LOGITS] * n, specs).token_ids, P) < CHI2_DF4_P001


def test_temperature_scales_logits() -> None:
    want = torch.tensor(LOGITS).div(0.5).softmax(-1).tolist()
    tokens = _draws(LOGITS, SamplingSpec(temperature=0.5), 20_000)
    assert _chi2(tokens, want) < CHI2_DF4_P001


def test_top_k_renormalises_the_kept_tokens() -> None:
    want = [p / 0.85 for p in P[:3]] + [0.0, 0.0]
    tokens = _draws(LOGITS, SamplingSpec(temperature=1.0, top_k=3), 20_000)
    assert set(tokens) == {0, 1, 2}
    assert _chi2(tokens, want) < CHI2_DF4_P001


def test_top_k_alone_keeps_each_rows_k_largest_without_a_full_sort() -> None:
    """Rows cutting by top-k only take the top-k path (a selection of the largest k, no
    sort of the vocabulary): each row's distribution is the softmax over its own k
    largest logits / temperature, the others 0, as the full-sort path computes it."""
    from compute_plane.sampler import _filtered_probs

    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    specs = [
        SamplingSpec(temperature=t, top_k=k) for t, k in [(1.0, 1), (0.7, 3), (2.0, 10), (1.0, 49)]
    ]
    got = _filtered_probs(logits, specs)
    for i, spec in enumerate(specs):
        keep = logits[i].argsort(descending=True)[: spec.top_k]
        want = torch.zeros(50)
        want[keep] = (logits[i, keep] / spec.temperature).softmax(-1)
        assert torch.allclose(got[i], want, atol=1e-6), spec
    # With top_p in one row, the sort path: the same top-k rows as before.
    mixed = _filtered_probs(logits, [*specs[:3], SamplingSpec(temperature=1.0, top_p=0.5)])
    assert torch.allclose(mixed[:3], got[:3], atol=1e-6)


def test_each_row_uses_its_own_filter() -> None:
    # P: 0.4, 0.25, 0.2, 0.1, 0.05; cumulative before each token: 0, 0.4, 0.65, 0.85, 0.95
    cases = [
        (SamplingSpec(temperature=1.0, top_p=0.6), {0, 1}),  # 0.4 < 0.6 <= 0.65
        (SamplingSpec(temperature=1.0, top_p=0.7), {0, 1, 2}),
        (SamplingSpec(temperature=1.0, top_p=0.3), {0}),
        (SamplingSpec(temperature=1.0, min_p=0.55), {0, 1}),  # p >= 0.22
        (SamplingSpec(temperature=1.0, min_p=0.45), {0, 1, 2}),  # p >= 0.18
        (SamplingSpec(temperature=1.0, top_k=4, top_p=0.9, min_p=0.2), {0, 1, 2, 3}),
        (SamplingSpec(temperature=1.0), {0, 1, 2, 3, 4}),
    ]
    n = 700
    specs = [spec for spec, _ in cases] * n
    torch.manual_seed(0)
    tokens = _batch([LOGITS] * len(specs), specs).token_ids
    for j, (_, allowed) in enumerate(cases):
        assert set(tokens[j :: len(cases)]) == allowed, cases[j][0]


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.integers(-8, 8).map(lambda x: x / 2), min_size=2, max_size=8),
    temperature=st.sampled_from([0.3, 1.0, 2.0]),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
)
def test_sampled_token_is_in_the_reference_kept_set(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    spec = SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    # Reference in float64 Python, with a little slack at the thresholds for float32 rounding.
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])[: top_k or len(z)]
    e = [math.exp(z[i] - z[order[0]]) for i in order]
    p = [x / sum(e) for x in e]
    kept = {order[j] for j in range(len(order)) if sum(p[:j]) < top_p + 1e-5}
    kept &= {order[j] for j in range(len(order)) if p[j] >= min_p * p[0] - 1e-5}
    # torch may break ties differently: a kept value keeps every token that has it
    kept = {i for i in range(len(z)) if z[i] in {z[k] for k in kept}}
    assert _batch([logits], [spec], pos=[seed % 97]).token_ids[0] in kept


def _penalised_logprobs(
    spec: SamplingSpec, logits: list[float], prompt: list[int], output: list[int]
) -> list[float]:
    out = _batch([logits], [spec], prompt=[prompt], output=[output])
    assert out.top_ids is not None and out.top_logprobs is not None
    got = dict(zip(out.top_ids[0], out.top_logprobs[0], strict=True))
    return [got[i] for i in range(len(logits))]


def test_penalties_against_hand_computed_logits() -> None:
    spec = SamplingSpec(
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logprobs=True,
        top_logprobs=5,
    )
    # prompt {0, 1}, output {2: twice, 3: once}; token 4 never seen
    want = [
        2.0 / 1.5,  # positive: divided
        -1.0 * 1.5,  # negative: multiplied
        0.5 / 1.5 - 0.3 * 2 - 0.2,
        0.0 * 1.5 - 0.3 * 1 - 0.2,  # zero is not > 0: multiplied (stays 0)
        0.7,
    ]
    lse = math.log(sum(math.exp(x) for x in want))
    got = _penalised_logprobs(spec, [2.0, -1.0, 0.5, 0.0, 0.7], [0, 1], [2, 3, 2])
    assert got == pytest.approx([x - lse for x in want], abs=1e-5)


def test_penalties_flip_the_argmax() -> None:
    def one(
        logits: list[float],
        spec: SamplingSpec,
        prompt: Sequence[int] = (),
        output: Sequence[int] = (),
    ) -> int:
        return _batch([logits], [spec], prompt=[list(prompt)], output=[list(output)]).token_ids[0]

    logits = [2.0, 1.9, -1.0]
    assert one(logits, SamplingSpec()) == 0
    assert one(logits, SamplingSpec(repetition_penalty=1.2), prompt=[0]) == 1  # 1.67 < 1.9
    assert one(logits, SamplingSpec(repetition_penalty=1.2), output=[0]) == 1
    assert one([-1.0, -1.1], SamplingSpec(repetition_penalty=1.2), prompt=[1]) == 0
    assert one([-1.0, -1.1], SamplingSpec(repetition_penalty=0.8), prompt=[1]) == 1  # -0.88
    assert one(logits, SamplingSpec(frequency_penalty=0.06), output=[0, 0]) == 1  # 0.12 > 0.1
    assert one(logits, SamplingSpec(frequency_penalty=0.06), output=[0]) == 0
    assert one(logits, SamplingSpec(presence_penalty=0.15), output=[0, 0, 0]) == 1
    assert one(logits, SamplingSpec(presence_penalty=0.15), prompt=[0]) == 0  # output only


def test_logprobs_and_top_logprobs_match_log_softmax() -> None:
    logits = torch.randn(3, 30)
    specs = [
        SamplingSpec(logprobs=True, top_logprobs=4),
        SamplingSpec(temperature=0.5, top_k=5, seed=3, logprobs=True),  # before temperature
        SamplingSpec(),
    ]
    out = _batch(logits, specs)
    ref = logits.double().log_softmax(-1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    vals, ids = ref[0].topk(4)
    assert out.top_ids[0] == ids.tolist()
    assert out.top_logprobs[0] == pytest.approx(vals.tolist(), abs=1e-5)


def test_banned_ids_are_never_sampled() -> None:
    logits = [[5.0, 0.0, 0.0], [5.0, 4.0, 0.0]]
    specs = [SamplingSpec(), SamplingSpec(temperature=1.0, seed=1)]
    for _ in range(20):
        assert _batch(logits, specs, banned=[(0,), (0, 1)]).token_ids == [1, 2]


def test_a_ban_that_would_leave_a_masked_row_nothing_yields_to_the_mask() -> None:
    """A grammar allowing only a stop id that min_tokens bans: the mask wins (the stop id),
    not an argmax over all -inf (token 0, outside the mask, logprob NaN)."""
    spec = SamplingSpec(logprobs=True)
    mask = pb.TokenMask(size=5, ids=[3])
    for row_spec in (spec, SamplingSpec(temperature=1.0, seed=3, logprobs=True)):
        out = sample(torch.tensor([LOGITS]), [row_spec], [[]], [[]], [0], [(3,)], [mask])
        assert out.token_ids == [3]
        assert out.logprobs == [pytest.approx(0.0)]  # the only token the mask allows
    # A ban that leaves something still bans.
    out = sample(torch.tensor([LOGITS]), [spec], [[]], [[]], [0], [(0,)], None)
    assert out.token_ids == [1]


def test_temperatures_below_the_greedy_threshold_are_greedy() -> None:
    """1e-38 divided the logits into inf and the softmax into NaN: token 0 every time."""
    logits = [[0.0, 1.0, 30.0, 2.0]]
    for t in (1e-38, 1e-30, 9e-6):
        spec = SamplingSpec(temperature=t, seed=5, logprobs=True)
        assert spec.greedy
        out = _batch(logits, [spec])
        assert out.token_ids == [2] and out.logprobs is not None
        assert math.isfinite(out.logprobs[0])
    assert not SamplingSpec(temperature=1e-5).greedy


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_a_repetition_penalty_near_zero_gives_finite_logprobs(temperature: float) -> None:
    """Dividing a positive logit by 1e-38 overflowed to inf: NaN logprobs, token 0. The
    penalised logits are bounded, so the seen token wins and everything stays finite."""
    logits = [[0.5, 5.0, 30.0, 2.0]]
    spec = SamplingSpec(
        temperature=temperature, seed=1, repetition_penalty=1e-38, logprobs=True, top_logprobs=2
    )
    out = _batch(logits, [spec], prompt=[[1]])
    assert out.token_ids == [1]  # 5.0 / 1e-38 (past float32's range) beats 30.0
    assert out.logprobs is not None and math.isfinite(out.logprobs[0])
    assert out.top_logprobs is not None and all(math.isfinite(x) for x in out.top_logprobs[0])


def test_from_proto_maps_proto3_zeros_to_off() -> None:
    assert SamplingSpec.from_proto(pb.SamplingParams()) == SamplingSpec()
    assert SamplingSpec.from_proto(pb.SamplingParams(seed=0)).seed == 0
    spec = SamplingSpec.from_proto(pb.SamplingParams(top_p=0.5, repetition_penalty=1.1, top_k=3))
    assert (spec.top_p, spec.repetition_penalty, spec.top_k) == (0.5, pytest.approx(1.1), 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.5),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("min_p", -0.1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", 11.0),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", math.inf),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 3.0),
        ("presence_penalty", math.nan),
        ("top_logprobs", -1),
        ("top_logprobs", 21),
    ],
)
def test_validate_names_the_field(field: str, value: float) -> None:
    problem = SamplingSpec(**{field: value}).validate()  # type: ignore[arg-type]
    assert problem is not None and field in problem


def test_validate_accepts_the_edges() -> None:
    edges = SamplingSpec(top_p=1.0, min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0)
    assert edges.validate() is None
    assert SamplingSpec(top_logprobs=20, repetition_penalty=0.01).validate() is None
    assert SamplingSpec(temperature=2.0, repetition_penalty=10.0).validate() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_tokens_are_the_same_on_cuda() -> None:
    logits = torch.randn(16, 5000)
    specs = [SamplingSpec(temperature=1.0, top_p=0.95, seed=s, logprobs=True) for s in range(16)]
    cpu = _batch(logits, specs, pos=list(range(16)))
    cuda = _batch(logits.cuda(), specs, pos=list(range(16)))
    assert cuda.token_ids == cpu.token_ids


# ------------------------------------------------------------ token masks (structured output)
def _mask_forms(allowed: list[int], size: int) -> list[pb.TokenMask]:
    """The same allowed set in each wire form, built here independently of the encoder."""
    bits = bytearray((size + 7) // 8)
    for t in allowed:
        bits[t // 8] |= 1 << (t % 8)
    banned = [t for t in range(size) if t not in allowed]
    return [
        pb.TokenMask(size=size, bitmask=bytes(bits)),
        pb.TokenMask(size=size, ids=allowed),
        pb.TokenMask(size=size, ids=banned, invert=True),
    ]


@pytest.mark.parametrize("form", [0, 1, 2])
def test_mask_greedy_takes_best_allowed_token(form: int) -> None:
    mask = _mask_forms([2, 4], 5)[form]
    out = sample(
        torch.tensor([LOGITS, LOGITS]),
        [SamplingSpec()] * 2,
        [[]] * 2,
        [[]] * 2,
        [0, 0],
        None,
        [mask, None],
    )
    assert out.token_ids == [2, 0]  # the masked row's best allowed; the free row untouched


def test_mask_shorter_than_vocab_bans_the_rest() -> None:
    # A mask covers the tokenizer's vocabulary; the model's padded ids beyond it are banned.
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 9.0]])
    mask = pb.TokenMask(size=3, ids=[0, 1], invert=True)  # allows 2 of 0..2
    out = sample(logits, [SamplingSpec()], [[]], [[]], [0], None, [mask])
    assert out.token_ids == [2]


def test_mask_logprobs_renormalise_over_allowed_tokens() -> None:
    spec = SamplingSpec(logprobs=True, top_logprobs=3)
    mask = pb.TokenMask(size=5, ids=[1, 3])
    out = sample(torch.tensor([LOGITS]), [spec], [[]], [[]], [0], None, [mask])
    total = P[1] + P[3]
    assert out.token_ids == [1]
    assert out.logprobs is not None and out.logprobs[0] == pytest.approx(math.log(P[1] / total))
    assert out.top_ids is not None and out.top_ids[0][:2] == [1, 3]
    assert out.top_logprobs is not None
    assert out.top_logprobs[0][1] == pytest.approx(math.log(P[3] / total), abs=1e-6)
    assert out.top_logprobs[0][2] == -math.inf


def test_masked_sampling_distribution_is_the_renormalised_one() -> None:
    allowed = [0, 2, 4]
    mask = pb.TokenMask(size=5, ids=allowed)
    n = 20000
    torch.manual_seed(7)
    t = torch.tensor([LOGITS] * n)
    out = sample(
        t, [SamplingSpec(temperature=1.0)] * n, [[]] * n, [[]] * n, [0] * n, None, [mask] * n
    )
    total = sum(P[i] for i in allowed)
    probs = [P[i] / total if i in allowed else 0.0 for i in range(5)]
    assert set(out.token_ids) <= set(allowed)
    assert _chi2(out.token_ids, probs) < 13.82  # 2 degrees of freedom, p = 0.001


@pytest.mark.parametrize(
    "changed",
    [
        {"temperature": 0.7},
        {"repetition_penalty": 1.2},
        {"frequency_penalty": 0.5},
        {"presence_penalty": -0.5},
        {"logit_bias": ((3, 1.0),)},
        {"min_tokens": 2, "banned_until_min": (2,)},
        {"logprobs": True},
        {"top_logprobs": 2},
    ],
)
def test_only_plain_greedy_rows_skip_the_sampler(changed: dict[str, object]) -> None:
    """The model runner takes the argmax without the sampler only when every row is
    plain greedy: any field that changes the token or asks for more turns that off."""
    assert SamplingSpec().plain_greedy
    assert SamplingSpec(temperature=1.0, top_k=1).plain_greedy  # top-k 1 is greedy
    assert SamplingSpec(min_tokens=3).plain_greedy  # nothing banned: nothing to mask
    assert not SamplingSpec(**changed).plain_greedy  # type: ignore[arg-type]
