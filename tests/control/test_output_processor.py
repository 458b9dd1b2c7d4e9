"""The output processor alone: sampled tokens in, each stream's deltas out (text from an
independent decode of the same tokens, stop strings cut, finish reasons, usage, the
stream interval), with no engine, scheduler or gRPC."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from control_plane import metrics
from control_plane.input_processor import InputProcessor, ModelBounds
from control_plane.output_processor import OutputProcessor
from control_plane.outputs import GenerateStream
from control_plane.request import Status
from control_plane.tokenizer import TokenizerWrapper, load_tokenizer
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb

BOUNDS = ModelBounds(max_model_len=256, vocab_size=49152, eos_token_ids=frozenset({2}))
STEP_METRICS = SimpleNamespace(
    generation_tokens=metrics.generation_tokens.labels(model_name="unit"),
    ttft=metrics.ttft.labels(model_name="unit"),
    itl=metrics.itl.labels(model_name="unit"),
)


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_path)


class Harness:
    """An OutputProcessor with a stream of one request, fed tokens as a scheduler would."""

    def __init__(self, tok: TokenizerWrapper, params: pb.GenerationParams, interval: int = 1):
        self.finished: list[tuple[str, Status]] = []
        self.observed: list[GenerateStream] = []
        self.proc = OutputProcessor(
            interval, lambda rid, st: self.finished.append((rid, st)), self.observed.append
        )
        inputs = InputProcessor(tok)
        prompt = tok.encode("Once upon a time", add_special_tokens=False)
        max_tokens = inputs.check(prompt, params, BOUNDS)
        self.stream = inputs.make_stream("s", prompt, params, BOUNDS, max_tokens)
        for c in self.stream.choices:
            c.request.status = Status.RUNNING
        self.proc.add(self.stream)

    def step(
        self, tokens: list[int], end: Status | None = None, accepted: list[int] | None = None
    ) -> None:
        """One step: choice i sampled tokens[i]; `end` is the scheduler's verdict;
        `accepted`: choice 0's accepted proposals before its sampled token."""
        sampled = {}
        for choice, token in zip(self.stream.choices, tokens, strict=True):
            if accepted and choice.index == 0:
                choice.request.token_ids.extend(accepted)
            choice.request.token_ids.append(token)
            if end is not None:
                choice.request.status = end
            sampled[choice.request.request_id] = token
        acc = {self.stream.choices[0].request.request_id: accepted} if accepted else None
        self.proc.process(cpb.StepResult(), sampled, STEP_METRICS, acc)  # type: ignore[arg-type]

    def responses(self) -> list[pb.GenerateResponse]:
        out = []
        while not self.stream.queue.empty():
            item = self.stream.queue.get_nowait()
            assert isinstance(item, pb.GenerateResponse)
            out.append(item)
        return out


def test_deltas_join_to_the_decoded_text_and_end_with_usage(tok: TokenizerWrapper) -> None:
    tokens = tok.encode(" there was a small red fox.", add_special_tokens=False)
    h = Harness(tok, pb.GenerationParams(max_tokens=len(tokens)))
    for t in tokens[:-1]:
        h.step([t])
    h.step([tokens[-1]], end=Status.FINISHED_LENGTH)
    resps = h.responses()
    assert len(resps) == len(tokens)  # interval 1: a message per token
    assert "".join(r.choices[0].text for r in resps) == tok.decode(tokens, True)
    assert [t for r in resps for t in r.choices[0].token_ids] == tokens
    assert resps[-1].choices[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert (resps[-1].usage.prompt_tokens, resps[-1].usage.completion_tokens) == (
        len(h.stream.prompt_token_ids),
        len(tokens),
    )
    assert h.observed == [h.stream] and not h.proc.streams and not h.proc.choices


def test_a_stop_string_cuts_the_text_and_finishes_the_request(tok: TokenizerWrapper) -> None:
    tokens = tok.encode(" the cat sat on the mat and slept", add_special_tokens=False)
    h = Harness(tok, pb.GenerationParams(max_tokens=50, stop=[" mat"]))
    for t in tokens:
        if h.finished:
            break
        h.step([t])
    text = "".join(r.choices[0].text for r in h.responses())
    assert text == " the cat sat on the"
    assert h.finished == [("s-0", Status.FINISHED_STOPPED)]
    assert h.stream.choices[0].finished and h.stream.done


def _generated() -> float:
    return REGISTRY.get_sample_value("hetero_generation_tokens_total", {"model_name": "unit"}) or 0


@pytest.mark.parametrize("interval", [1, 4])
def test_tokens_after_a_stop_string_are_not_counted_as_generated(
    tok: TokenizerWrapper, interval: int
) -> None:
    # Speculative decoding accepts several tokens in a step (the interval holds several
    # back): those after the stop string are dropped, from the text, usage and the count.
    tokens = tok.encode(" the cat sat on the mat and slept", add_special_tokens=False)
    h = Harness(tok, pb.GenerationParams(max_tokens=50, stop=[" mat"]), interval=interval)
    before = _generated()
    h.step([tokens[0]])
    h.step([tokens[-1]], accepted=tokens[1:-1])  # " mat" is in the accepted run
    (*_, last) = h.responses()
    assert tok.decode(h.stream.choices[0].request.output_token_ids) == " the cat sat on the mat"
    assert last.usage.completion_tokens == tokens.index(tok.encode(" mat")[0]) + 1
    assert _generated() - before == last.usage.completion_tokens


def test_the_stream_interval_holds_tokens_back_but_not_the_first_or_last(
    tok: TokenizerWrapper,
) -> None:
    tokens = tok.encode(" one two three four five six seven", add_special_tokens=False)
    h = Harness(tok, pb.GenerationParams(max_tokens=len(tokens)), interval=3)
    for t in tokens[:-1]:
        h.step([t])
    h.step([tokens[-1]], end=Status.FINISHED_LENGTH)
    sizes = [len(r.choices[0].token_ids) for r in h.responses()]
    assert sizes[0] == 1 and sum(sizes) == len(tokens)
    assert all(s == 3 for s in sizes[1:-1]) and 1 <= sizes[-1] <= 3


def test_n_choices_each_get_their_own_deltas(tok: TokenizerWrapper) -> None:
    a = tok.encode(" red", add_special_tokens=False)[0]
    b = tok.encode(" blue", add_special_tokens=False)[0]
    h = Harness(tok, pb.GenerationParams(n=2, max_tokens=1))
    h.step([a, b], end=Status.FINISHED_LENGTH)
    (resp,) = h.responses()  # both choices in one message
    assert {(c.index, c.text) for c in resp.choices} == {(0, " red"), (1, " blue")}
    assert resp.usage.completion_tokens == 2


def test_a_removed_stream_gets_nothing(tok: TokenizerWrapper) -> None:
    h = Harness(tok, pb.GenerationParams(max_tokens=5))
    assert h.proc.remove(h.stream) and not h.proc.remove(h.stream)
    h.step([tok.encode(" x", add_special_tokens=False)[0]])
    assert h.responses() == []


def test_a_prompt_only_choice_ends_with_no_token_and_its_prompt_logprobs(
    tok: TokenizerWrapper,
) -> None:
    """prompt_only: the token each choice samples when its prompt is computed is no
    output (no text, token, logprob or count), whatever the stream interval; choice 0's
    delta carries the prompt's logprobs; both end by length."""
    params = pb.GenerationParams(prompt_only=True, n=2, logprobs=True, prompt_logprobs=1)
    h = Harness(tok, params, interval=4)
    prompt = h.stream.prompt_token_ids
    result = cpb.StepResult()
    plps = result.prompt_logprobs.add(request_id="s-0", start=1)
    for t in prompt[1:]:
        plps.tokens.add(token_id=t, logprob=-1.5, rank=2)
    sampled = {}
    for c in h.stream.choices:
        result.results.add(request_id=c.request.request_id, token_id=13, logprob=-0.1)
        c.request.token_ids.append(13)  # as the scheduler appends it, then checks it
        c.request.status = c.request.stop_check(13, BOUNDS.max_model_len)  # type: ignore[assignment]
        sampled[c.request.request_id] = 13
    h.proc.process(result, sampled, STEP_METRICS)  # type: ignore[arg-type]
    (resp,) = h.responses()
    assert [(d.index, d.text, list(d.token_ids), len(d.logprobs)) for d in resp.choices] == [
        (0, "", [], 0),
        (1, "", [], 0),
    ]
    assert {d.finish_reason for d in resp.choices} == {pb.FINISH_REASON_LENGTH}
    assert [lp.token_id for lp in resp.choices[0].prompt_logprobs] == prompt[1:]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt), 0)


def test_held_back_tokens_of_a_removed_stream_count_up_to_a_stop_string(
    tok: TokenizerWrapper,
) -> None:
    """An aborted stream's tokens held back by the interval count as generated, but not
    those after a stop string, which interval 1 would not have sent."""
    tokens = tok.encode(" the cat sat on the mat and slept", add_special_tokens=False)
    h = Harness(tok, pb.GenerationParams(max_tokens=50, stop=[" mat"]), interval=len(tokens))
    for t in tokens:
        h.step([t])
    (first,) = h.responses()  # the first token; the rest held back
    assert len(first.choices[0].token_ids) == 1
    assert h.proc.remove(h.stream)
    upto_stop = tokens.index(tok.encode(" mat")[0]) + 1
    assert OutputProcessor.drop_held_back(h.stream) == upto_stop - 1
    assert OutputProcessor.drop_held_back(h.stream) == 0  # dropped


@pytest.mark.parametrize("first", [0, 1])
def test_the_prefix_hit_goes_out_from_the_first_delta_whichever_choice_it_is(
    tok: TokenizerWrapper, first: int
) -> None:
    """n = 2, one choice samples a step before the other. The hit is choice 0's at its
    admission (the scheduler's prefix lookup; choice 1 shares its prompt blocks and
    counts them all); every response with a delta, from the stream's first, carries it
    (protocol.md), and so does the usage."""
    h = Harness(tok, pb.GenerationParams(n=2, max_tokens=3), interval=1)
    prompt_len = len(h.stream.prompt_token_ids)
    hit = prompt_len - 1  # choice 0's lookup found all but the last prompt token cached
    zero, one = (c.request for c in h.stream.choices)
    zero.num_cached_tokens, one.num_cached_tokens = hit, prompt_len
    order = [h.stream.choices[first], h.stream.choices[1 - first]]
    words = [tok.encode(w, add_special_tokens=False)[0] for w in (" a", " b", " c", " d")]

    def step(*chosen: tuple[int, int]) -> None:
        """order[k] samples a token; its third ends it (max_tokens, as the scheduler)."""
        sampled = {}
        for k, token in chosen:
            req = order[k].request
            req.token_ids.append(token)
            if req.num_output_tokens == 3:
                req.status = Status.FINISHED_LENGTH
            sampled[req.request_id] = token
        h.proc.process(cpb.StepResult(), sampled, STEP_METRICS)  # type: ignore[arg-type]

    step((0, words[0]))  # only the `first` choice has a token
    step((0, words[1]), (1, words[2]))
    step((0, words[3]), (1, words[3]))  # the `first` choice ends
    step((1, words[0]))
    resps = h.responses()
    assert [sorted(d.index for d in r.choices) for r in resps] == [
        [first],
        [0, 1],
        [0, 1],
        [1 - first],
    ]
    assert [r.cached_prompt_tokens for r in resps] == [hit] * 4
    assert resps[-1].usage.cached_prompt_tokens == hit
    assert resps[-1].usage.completion_tokens == 6


def test_no_prefix_hit_is_reported_as_none(tok: TokenizerWrapper) -> None:
    h = Harness(tok, pb.GenerationParams(n=2, max_tokens=1))
    zero, one = (c.request for c in h.stream.choices)
    zero.num_cached_tokens, one.num_cached_tokens = 0, len(h.stream.prompt_token_ids)
    h.step([13, 14], end=Status.FINISHED_LENGTH)
    (resp,) = h.responses()
    assert resp.cached_prompt_tokens == 0 and resp.usage.cached_prompt_tokens == 0
