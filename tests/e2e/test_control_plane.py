"""Control plane + compute plane as real processes (bundled SmolLM2, CPU)."""

from __future__ import annotations

import queue
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from hetero_common.limits import MAX_GRPC_MESSAGE_BYTES
from hetero_common.packed import packed_responses
from hetero_proto import compute_pb2 as cpb
from hetero_proto import compute_pb2_grpc as cpb_grpc
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.conftest import hf_greedy
from tests.e2e_helpers import generate, greedy
from tests.procs import Stack, control_stack

pytestmark = pytest.mark.slow
MAX_TOKENS = 20


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [3, 250, 17, 64, 1, 130, 40, 9, 200, 33, 77, 5, 150, 21, 90, 12]
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with control_stack(("--kv-cache-bytes", str(96 << 20))) as s:
        yield s


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[pb_grpc.ControlPlaneStub]:
    with grpc.insecure_channel(stack.control) as ch:
        yield pb_grpc.ControlPlaneStub(ch)


@pytest.fixture(scope="module")
def alone(stub: pb_grpc.ControlPlaneStub) -> list[list[int]]:
    """Each prompt's greedy tokens, run one at a time."""
    return [generate(stub, greedy(p, MAX_TOKENS)).tokens[0] for p in _prompts()]


def _concurrently(stub: pb_grpc.ControlPlaneStub) -> list[list[int]]:
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: generate(stub, greedy(p, MAX_TOKENS)), _prompts()))
    return [o.tokens[0] for o in outs]


def _wait_pool_full(stub: pb_grpc.ControlPlaneStub, timeout: float) -> pb.EngineStats:
    deadline = time.monotonic() + timeout
    while True:
        st = stub.ModelInfo(pb.ModelInfoRequest(detailed=True)).stats
        if st.num_free_kv_blocks == st.num_usable_kv_blocks or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_sixteen_concurrent_equal_alone(stub, alone) -> None:  # type: ignore[no-untyped-def]
    assert all(len(t) == MAX_TOKENS for t in alone)
    assert _concurrently(stub) == alone
    st = _wait_pool_full(stub, 2.0)
    assert st.integrity_ok, st.integrity_error
    assert st.num_free_kv_blocks == st.num_usable_kv_blocks


def test_preemption_under_a_tiny_pool_keeps_outputs(alone) -> None:  # type: ignore[no-untyped-def]
    with (
        control_stack(("--kv-cache-bytes", str(96 << 20)), ("--max-num-blocks", "22")) as s,
        grpc.insecure_channel(s.control) as ch,
    ):
        small = pb_grpc.ControlPlaneStub(ch)
        assert _concurrently(small) == alone
        st = _wait_pool_full(small, 2.0)
        assert st.num_preemptions > 0
        assert st.integrity_ok, st.integrity_error
        assert st.num_free_kv_blocks == st.num_usable_kv_blocks == 21


def test_shared_prefix_computes_only_the_suffix(stack, stub, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(5)
    prefix = [rng.randrange(100, 49000) for _ in range(200)]
    first = prefix + [rng.randrange(100, 49000) for _ in range(10)]
    second = prefix + [rng.randrange(100, 49000) for _ in range(12)]
    generate(stub, greedy(first, 4))
    with grpc.insecure_channel(stack.compute) as ch:
        compute = cpb_grpc.ComputePlaneStub(ch)
        before = compute.Stats(cpb.StatsRequest())
        out = generate(stub, greedy(second, 16))
        after = compute.Stats(cpb.StatsRequest())
    cached = 200 // 16 * 16  # whole blocks of the shared prefix
    computed = after.num_prompt_tokens_computed - before.num_prompt_tokens_computed
    assert computed == len(second) - cached
    assert out.usage is not None and out.usage.cached_prompt_tokens == cached
    assert out.tokens[0] == hf_greedy(hf_smollm2, second, 16)


def test_stop_strings_across_tokens_never_leak(stub) -> None:  # type: ignore[no-untyped-def]
    prompt = "Once upon a time, in a land far away,"
    full = generate(
        stub,
        pb.GenerateRequest(text=prompt, params=pb.GenerationParams(max_tokens=40, ignore_eos=True)),
    )
    text = full.texts[0]
    # A stop string that starts inside one token and ends inside a later one.
    start = len(text) // 3 + 1
    stop = text[start : start + 7]
    later = text[2 * len(text) // 3 : 2 * len(text) // 3 + 5]
    params = pb.GenerationParams(max_tokens=40, ignore_eos=True, stop=[later, stop, "\x00never"])
    out = generate(stub, pb.GenerateRequest(text=prompt, params=params))
    cut = text.index(stop)
    assert out.texts[0] == text[:cut]
    assert "".join(out.deltas[0]) == text[:cut]  # no delta carried a piece of the stop string
    assert out.finish[0] == pb.FINISH_REASON_STOP
    # The stop string is found while the next step already runs: the token that step
    # samples is dropped. Sent and counted are the tokens up to the one completing it.
    sent = out.tokens[0]
    assert sent == full.tokens[0][: len(sent)]
    assert stop not in stub.Detokenize(pb.DetokenizeRequest(token_ids=sent[:-1])).text
    assert stop in stub.Detokenize(pb.DetokenizeRequest(token_ids=sent)).text
    assert out.usage is not None and out.usage.completion_tokens == len(sent)
    st = _wait_pool_full(stub, 2.0)
    assert st.num_free_kv_blocks == st.num_usable_kv_blocks


def test_cancel_mid_stream_frees_the_pool(stub) -> None:  # type: ignore[no-untyped-def]
    call = stub.Generate(greedy(list(range(200, 460)), 500))
    for _ in range(3):
        next(call)
    assert stub.ModelInfo(pb.ModelInfoRequest()).stats.num_running == 1
    call.cancel()
    st = _wait_pool_full(stub, 1.0)
    assert st.num_free_kv_blocks == st.num_usable_kv_blocks
    assert st.integrity_ok, st.integrity_error
    assert st.num_running == 0 and st.num_waiting == 0


def test_prompt_too_long_is_refused(stub) -> None:  # type: ignore[no-untyped-def]
    info = stub.ModelInfo(pb.ModelInfoRequest(detailed=True))
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, greedy([300] * 10, info.max_model_len))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.max_model_len) in e.value.details()


def test_cli_generate_equals_transformers(hf_smollm2, hf_smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = "The three primary colors are"
    ids = hf_smollm2_tokenizer(prompt).input_ids
    expected = hf_smollm2_tokenizer.decode(hf_greedy(hf_smollm2, ids, 24), skip_special_tokens=True)
    out = subprocess.run(
        [sys.executable, "-m", "hetero_infer.cli", "generate", prompt, "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.rstrip("\n") == expected


def test_stream_interval_sends_every_n_tokens_and_cuts_at_stop(alone, stub) -> None:  # type: ignore[no-untyped-def]
    """--stream-interval 4: same tokens as interval 1, in messages of 1, 4, 4, ..., rest."""
    prompt = "Once upon a time, in a land far away,"
    every = generate(
        stub,
        pb.GenerateRequest(text=prompt, params=pb.GenerationParams(max_tokens=40, ignore_eos=True)),
    )
    text = every.texts[0]
    start = len(text) // 2
    stop = text[start : start + 6]
    with (
        control_stack(("--kv-cache-bytes", str(96 << 20)), ("--stream-interval", "4")) as s,
        grpc.insecure_channel(s.control) as ch,
    ):
        batched = pb_grpc.ControlPlaneStub(ch)
        prompts = _prompts()[:4]
        for p, want in zip(prompts, alone, strict=False):
            sizes = []
            got: list[int] = []
            for resp in batched.Generate(greedy(p, MAX_TOKENS)):
                for c in resp.choices:
                    sizes.append(len(c.token_ids))
                    got.extend(c.token_ids)
                    assert bool(c.finish_reason) == (len(got) == MAX_TOKENS)
            assert got == want
            # The first token at once, then every 4, the remainder with the finish.
            assert sizes == [1, 4, 4, 4, 4, 3]

        # A stop token mid-interval ends the stream there, as with interval 1.
        want = alone[0]
        stop_id = want[6]
        by_token = greedy(prompts[0], MAX_TOKENS, stop_token_ids=[stop_id])
        out, ref = generate(batched, by_token), generate(stub, by_token)
        assert out.tokens[0] == ref.tokens[0] == want[: want.index(stop_id) + 1]
        assert out.texts[0] == ref.texts[0]
        assert out.finish[0] == ref.finish[0] == pb.FINISH_REASON_STOP

        params = pb.GenerationParams(max_tokens=40, ignore_eos=True, stop=[stop])
        out = generate(batched, pb.GenerateRequest(text=prompt, params=params))
        cut = text.index(stop)
        assert out.texts[0] == text[:cut]
        assert out.finish[0] == pb.FINISH_REASON_STOP
        # Tokens sampled after the one that completed the stop string are dropped, and
        # usage counts what the client got.
        assert out.tokens[0] == every.tokens[0][: len(out.tokens[0])]
        assert len(out.tokens[0]) < 40
        assert out.usage is not None and out.usage.completion_tokens == len(out.tokens[0])
        done = stub.Detokenize(pb.DetokenizeRequest(token_ids=out.tokens[0]))
        before = stub.Detokenize(pb.DetokenizeRequest(token_ids=out.tokens[0][:-1]))
        assert stop in done.text and stop not in before.text

        # Logprobs travel with their held-back tokens and are cut with them.
        params = pb.GenerationParams(
            max_tokens=40, ignore_eos=True, stop=[stop], logprobs=True, top_logprobs=2
        )
        request = pb.GenerateRequest(text=prompt, params=params)
        for client in (batched, stub):
            tokens, lps = [], []
            for resp in client.Generate(request):
                for c in resp.choices:
                    assert len(c.logprobs) == len(c.token_ids)
                    tokens.extend(c.token_ids)
                    lps.extend(c.logprobs)
            assert tokens == out.tokens[0]
            assert [lp.token_id for lp in lps] == tokens
            # Greedy: the sampled token is the most likely one.
            assert all(lp.top_logprobs[0].token_id == lp.token_id for lp in lps)
            assert all(lp.logprob == pytest.approx(lp.top_logprobs[0].logprob) for lp in lps)


class _ManyCall:
    """A GenerateMany call driven from a test: send starts and cancels, read messages."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub) -> None:
        self._out: queue.Queue[pb.GenerateManyRequest | None] = queue.Queue()
        self.call = stub.GenerateMany(iter(self._out.get, None), timeout=300)

    def start(self, rid: str, request: pb.GenerateRequest, packed: bool = False) -> None:
        start = pb.GenerateManyRequest(start=request, accept_packed=packed)
        start.start.request_id = rid
        self._out.put(start)

    def cancel(self, rid: str) -> None:
        self._out.put(pb.GenerateManyRequest(cancel=rid))

    def close(self) -> None:
        self._out.put(None)

    def read(self) -> pb.GenerateManyResponse:
        return next(self.call)  # type: ignore[no-any-return]


def test_generate_many_interleaves_requests_on_one_call(stub, alone) -> None:  # type: ignore[no-untyped-def]
    """Sixteen requests on one GenerateMany call: each gets what Generate gives it alone,
    with its messages in Generate's order, and a step's deltas share one message."""
    many = _ManyCall(stub)
    prompts = _prompts()
    for i, p in enumerate(prompts):
        many.start(f"r{i}", greedy(p, MAX_TOKENS), packed=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    admitted: set[str] = set()
    ended: set[str] = set()
    messages = responses = packed = 0
    cached: dict[str, int] = {}  # the prefix-cache hit each request's deltas announced
    while len(ended) < len(prompts):
        msg = many.read()
        assert not msg.errors, msg.errors
        messages += 1
        packed += len(msg.packed.request_ids)
        for resp in [*msg.responses, *packed_responses(msg.packed)]:  # the order to read
            responses += 1
            rid = resp.request_id
            assert rid not in ended, f"{rid}: a message after its last"
            if resp.prompt_token_ids:
                assert rid not in admitted and not tokens[rid]  # admission comes first, once
                admitted.add(rid)
                assert list(resp.prompt_token_ids) == prompts[int(rid[1:])]
            else:
                assert rid in admitted
            for c in resp.choices:
                tokens[rid].extend(c.token_ids)
                assert bool(c.finish_reason) == (len(tokens[rid]) == MAX_TOKENS)
            if resp.cached_prompt_tokens:
                assert (
                    cached.setdefault(rid, resp.cached_prompt_tokens) == resp.cached_prompt_tokens
                )
            if resp.HasField("usage"):
                assert resp.usage.completion_tokens == MAX_TOKENS
                assert resp.usage.cached_prompt_tokens == cached.get(rid, 0)
                ended.add(rid)
    many.close()
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == alone
    # 16 admissions + 16 x 20 tokens; sent a message per response, this would be 336.
    assert responses == len(prompts) * (MAX_TOKENS + 1)
    assert messages < responses // 2, (messages, responses)
    # Every delta but the last (finish_reason, usage) is plain text and tokens: packed;
    # but the first after a prefix-cache hit, which carries cached_prompt_tokens.
    assert cached  # (the prompts ran alone before: their blocks are cached)
    assert packed == len(prompts) * (MAX_TOKENS - 1) - len(cached), packed
    st = _wait_pool_full(stub, 2.0)
    assert st.integrity_ok, st.integrity_error
    assert st.num_free_kv_blocks == st.num_usable_kv_blocks


def test_generate_many_errors_and_cancels_touch_only_their_request(stub, alone) -> None:  # type: ignore[no-untyped-def]
    info = stub.ModelInfo(pb.ModelInfoRequest(detailed=True))
    many = _ManyCall(stub)
    many.start("long", greedy(list(range(200, 460)), 500))
    many.start("good", greedy(_prompts()[0], MAX_TOKENS))
    many.start("bad", greedy([info.vocab_size + 5], 4))
    many.start("too-long", greedy([300] * 10, info.max_model_len))
    many.start("good", greedy([5], 4))  # the id of an unfinished request
    many.start("", greedy([5], 4))
    errors: dict[str, pb.RequestError] = {}
    tokens: list[int] = []
    cancelled = False
    long_after_cancel = 0
    while len(tokens) < MAX_TOKENS or not cancelled or len(errors) < 4:
        msg = many.read()
        assert not msg.packed.request_ids  # not asked for: every delta is a response
        for e in msg.errors:
            assert e.request_id not in errors or e.request_id == "good"
            errors.setdefault(e.request_id, e)
        for resp in [*msg.responses, *packed_responses(msg.packed)]:
            if resp.request_id == "good":
                tokens.extend(t for c in resp.choices for t in c.token_ids)
            elif resp.request_id == "long" and resp.choices:
                if cancelled:
                    long_after_cancel += 1
                elif stub.ModelInfo(pb.ModelInfoRequest()).stats.num_running >= 1:
                    many.cancel("long")
                    cancelled = True
    assert tokens == alone[0]
    assert set(errors) == {"bad", "too-long", "good", ""}
    assert {e.code for e in errors.values()} == {"INVALID_ARGUMENT"}
    assert str(info.vocab_size - 1) in errors["bad"].message
    assert str(info.max_model_len) in errors["too-long"].message
    assert "request_id" in errors["good"].message
    # A cancel takes effect within the step in flight: at most one message more.
    assert long_after_cancel <= 1
    st = _wait_pool_full(stub, 2.0)
    assert st.num_free_kv_blocks == st.num_usable_kv_blocks and st.num_running == 0

    # Ending the call aborts what it still runs.
    many.start("left", greedy(list(range(200, 460)), 500))
    while not many.read().responses:
        pass
    many.call.cancel()
    st = _wait_pool_full(stub, 2.0)
    assert st.num_free_kv_blocks == st.num_usable_kv_blocks
    assert st.integrity_ok, st.integrity_error
    assert st.num_running == 0 and st.num_waiting == 0


def test_an_oversized_message_is_refused_alone(stub, alone) -> None:  # type: ignore[no-untyped-def]
    """A start over the 4 MiB request limit (gRPC's default) gets its own RESOURCE_EXHAUSTED
    RequestError: gRPC refusing it would end the whole GenerateMany call, and every other
    request on it. Generate, Tokenize and Detokenize refuse such a message as before."""
    huge = "x" * (MAX_GRPC_MESSAGE_BYTES + 1000)
    many = _ManyCall(stub)
    many.start("before", greedy(_prompts()[0], MAX_TOKENS))
    many.start("huge", pb.GenerateRequest(text=huge, params=pb.GenerationParams(max_tokens=2)))
    many.start("after", greedy(_prompts()[0], MAX_TOKENS))
    tokens: dict[str, list[int]] = {"before": [], "after": []}
    errors: list[pb.RequestError] = []
    ended: set[str] = set()
    while len(ended) < 2 or not errors:
        msg = many.read()
        errors.extend(msg.errors)
        for resp in msg.responses:
            tokens[resp.request_id].extend(t for c in resp.choices for t in c.token_ids)
            if resp.HasField("usage"):
                ended.add(resp.request_id)
    many.close()
    assert tokens == {"before": alone[0], "after": alone[0]}
    assert [(e.request_id, e.code) for e in errors] == [("huge", "RESOURCE_EXHAUSTED")]
    assert str(MAX_GRPC_MESSAGE_BYTES) in errors[0].message
    for call, request in [
        (stub.Generate, pb.GenerateRequest(text=huge)),
        (stub.Tokenize, pb.TokenizeRequest(text=huge)),
        (stub.Detokenize, pb.DetokenizeRequest(token_ids=[40000] * (2 << 20))),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            reply = call(request, timeout=60)
            if isinstance(reply, Iterator):
                list(reply)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert str(MAX_GRPC_MESSAGE_BYTES) in (e.value.details() or "")


def _full(
    stub: pb_grpc.ControlPlaneStub, request: pb.GenerateRequest
) -> tuple[list[int], str, pb.Usage]:
    tokens: list[int] = []
    text = ""
    usage = pb.Usage()
    for resp in stub.Generate(request, timeout=120):
        for c in resp.choices:
            tokens += c.token_ids
            text += c.text
        if resp.HasField("usage"):
            usage = resp.usage
    return tokens, text, usage


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0, "frequency_penalty": 0.7, "presence_penalty": 0.3},
        {"temperature": 0.9, "seed": 5, "top_k": 40},
        {"temperature": 0.0, "structured": pb.StructuredOutput(regex="[a-z ,]{60,200}")},
    ],
    ids=["penalties", "seeded", "grammar"],
)
def test_resumed_output_continues_exactly(stub: pb_grpc.ControlPlaneStub, params: dict) -> None:  # type: ignore[type-arg]
    """num_resumed_output_tokens: the input's last N ids are output the client has (a
    gateway continuing after a control plane failed). The rest equals the uninterrupted
    run's token for token and text for text, with output-only state (penalties, the
    grammar) and usage as if nothing had happened."""
    prompt = [504, 3426, 284, 260, 1345, 282, 4649, 314, 216, 30, 7, 19, 46]
    p = pb.GenerationParams(max_tokens=24, ignore_eos=True, **params)
    tokens, text, usage = _full(
        stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=p)
    )
    assert len(tokens) == 24 and usage.completion_tokens == 24  # the grammar is not done
    for cut in (1, 9, 17):
        resumed = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt + tokens[:cut]),
            params=p,
            num_resumed_output_tokens=cut,
        )
        rest, rest_text, rest_usage = _full(stub, resumed)
        assert rest == tokens[cut:], cut
        head = stub.Detokenize(  # (as Generate's text: skip_special_tokens unset is true)
            pb.DetokenizeRequest(token_ids=tokens[:cut], skip_special_tokens=True)
        )
        assert head.text + rest_text == text, cut
        assert (rest_usage.prompt_tokens, rest_usage.completion_tokens) == (len(prompt), 24)


def test_bad_resumed_output_is_refused(stub: pb_grpc.ControlPlaneStub) -> None:
    p = pb.GenerationParams(max_tokens=8)
    cases = {
        "needs a token_ids input": pb.GenerateRequest(
            text="Hello", params=p, num_resumed_output_tokens=1
        ),
        "must be in 0..2": pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]), params=p, num_resumed_output_tokens=3
        ),
        "needs n = 1": pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            params=pb.GenerationParams(max_tokens=8, n=2),
            num_resumed_output_tokens=1,
        ),
        "leaves nothing of max_tokens": pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            params=pb.GenerationParams(max_tokens=2),
            num_resumed_output_tokens=2,
        ),
        # (an empty input is named as such, before the resumed count's range blames it)
        "the prompt is empty": pb.GenerateRequest(text="", params=p),
        "breaks the grammar": pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            params=pb.GenerationParams(
                max_tokens=8, structured=pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes"]))
            ),
            num_resumed_output_tokens=1,
        ),
    }
    for needle, request in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
        assert needle in (e.value.details() or ""), (needle, e.value.details())
