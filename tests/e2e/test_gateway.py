"""The OpenAI API through a real three-process stack, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.procs import FullStack, gateway_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[FullStack]:
    with gateway_stack(("--kv-cache-bytes", str(128 << 20))) as s:
        yield s


def _pool(stack: FullStack) -> pb.EngineStats:
    with grpc.insecure_channel(stack.control) as ch:
        return pb_grpc.ControlPlaneStub(ch).ModelInfo(pb.ModelInfoRequest(detailed=True)).stats


def test_chat_answers_paris(client: openai.OpenAI, model: str) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=model,
        messages=msgs,
        temperature=0,
        max_tokens=24,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": " of France?"},
            ],
        }
    ]
    r2 = client.chat.completions.create(model=model, messages=parts, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_completion_stream_equals_plain_and_usage(
    client: openai.OpenAI, model: str, hf_smollm2_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    prompt = "The history of the printing press"
    plain = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=30, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None
    assert plain.usage.completion_tokens == 30
    assert plain.usage.prompt_tokens == len(hf_smollm2_tokenizer(prompt).input_ids)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            temperature=0,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and not chunks[-1].choices
    assert with_usage[0].usage == plain.usage


def test_stop_strings_in_streaming(client: openai.OpenAI, model: str) -> None:
    prompt = "Once upon a time, in a land far away,"
    full = (
        client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=40)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    chunks = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=40, stop=[stop, "zzqx"], stream=True
    )
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == full[: full.index(stop)]
    assert pieces[-1].finish_reason == "stop"


def test_streamed_token_ids_are_the_whole_answers_with_a_stop_string(
    stack: FullStack, model: str
) -> None:
    """Text held back while it may be a stop string kept its token ids out of the stream
    (a delta with no text gave no chunk): the streamed ids missed every held token."""
    body = {
        "model": model,
        "prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3,",
        "temperature": 0,
        "max_tokens": 24,
        "stop": [" 3,"],
        "return_token_ids": True,
    }
    whole = httpx.post(stack.url + "/v1/completions", json=body, timeout=60).json()
    ids = whole["choices"][0]["token_ids"]
    assert whole["choices"][0]["finish_reason"] == "stop" and len(ids) > 2
    streamed: list[int] = []
    with httpx.stream("POST", stack.url + "/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c.get("token_ids") or []
    assert streamed == ids


def test_min_tokens_holds_stop_strings_back(
    stack: FullStack, client: openai.OpenAI, model: str
) -> None:
    """As vLLM: a stop string in the first min_tokens tokens' text does not end the answer;
    the first one after them does. Expected text from the same greedy answer without stop."""
    prompt = "Q: What is 2 + 2?\nA: 4.\nQ: What is 3 + 3?\nA:"
    full = client.completions.create(
        model=model,
        prompt=prompt,
        temperature=0,
        max_tokens=40,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).choices[0]
    ids = full.token_ids  # type: ignore[attr-defined]
    head = httpx.post(stack.url + "/detokenize", json={"tokens": ids[:6]}).json()["prompt"]
    assert full.text.startswith(head) and "." in head  # a stop string inside min_tokens
    for min_tokens, stream in ((0, False), (6, False), (6, True)):
        kw = dict(model=model, prompt=prompt, temperature=0, max_tokens=40, stop=["."])
        r = client.completions.create(
            **kw, stream=stream, extra_body={"min_tokens": min_tokens, "ignore_eos": True}
        )  # type: ignore[call-overload]
        text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
        searched_from = len(head) if min_tokens else 0
        cut = full.text.find(".", searched_from)
        assert text == full.text[:cut], (min_tokens, stream, text, full.text)


def test_n_with_seed_and_logprobs_and_echo(client: openai.OpenAI, model: str) -> None:
    kw = dict(
        model=model, prompt="My favourite animal is", max_tokens=12, temperature=1.0, n=2, seed=123
    )
    a = client.completions.create(**kw)  # type: ignore[call-overload]
    b = client.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # each choice draws its own tokens

    lp = (
        client.completions.create(
            model=model, prompt="Hello", max_tokens=5, temperature=0, logprobs=2
        )
        .choices[0]
        .logprobs
    )
    assert (
        lp is not None
        and lp.tokens
        and lp.token_logprobs
        and lp.top_logprobs
        and lp.text_offset is not None
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)  # type: ignore[operator]
    assert lp.text_offset[0] == 0

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,  # type: ignore[list-item]
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) >= 1
    assert all(len(t.top_logprobs) == 3 and t.bytes is not None for t in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy = most likely

    echo = client.completions.create(
        model=model, prompt="Echo this", max_tokens=3, temperature=0, echo=True
    )
    plain = client.completions.create(model=model, prompt="Echo this", max_tokens=3, temperature=0)
    assert echo.choices[0].text == "Echo this" + plain.choices[0].text


ERROR_CASES = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 10, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "prompt"),  # too long
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
        400,
        "messages",
    ),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["y" * 257]}, 400, "stop"),
    ("/v1/completions", {"prompt": [2**31]}, 400, "prompt.0"),  # the id itself
    ("/v1/completions", {"prompt": [49152]}, 400, "prompt"),  # past the vocabulary
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**31}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": 5, "content": "x"}]},  # any role the template knows is fine
        400,
        "messages.0.role",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50},
        400,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES)
def test_errors_in_openai_schema(
    stack: FullStack, model: str, path: str, body: dict, status: int, param: str | None
) -> None:  # type: ignore[type-arg]
    body = {"model": model, **body}
    r = httpx.post(stack.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if body.get("max_tokens") == 100000:
        limit = httpx.get(stack.url + "/v1/models").json()["data"][0]["max_model_len"]
        assert f"maximum context length of {limit} tokens" in err["message"]
        # OpenAI's code, and the input named (what clients that trim their input look for)
        assert err["code"] == "context_length_exceeded"
        assert err["param"] == ("messages" if "chat" in path else "prompt")
    # The stack keeps serving.
    ok = httpx.post(
        stack.url + "/v1/completions",
        json={"model": model, "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


def test_request_size_limits(stack: FullStack, model: str) -> None:
    limit = httpx.get(stack.url + "/v1/models").json()["data"][0]["max_model_len"]
    url = stack.url + "/v1/completions"

    def error(r: httpx.Response, status: int) -> str:
        assert r.status_code == status, r.text
        return str(r.json()["error"]["message"])

    # Bodies over --max-body-bytes (2 MiB), declared or chunked, are refused unread.
    huge = {"model": model, "prompt": "x" * (3 << 20)}
    assert "larger than" in error(httpx.post(url, json=huge, timeout=60), 413)

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(3 << 10):
            yield b"x" * 1024
        yield b'"}'

    assert "larger than" in error(httpx.post(url, content=chunks(), timeout=60), 413)
    # A prompt that cannot fit is refused from its size alone, before tokenisation.
    big = {"model": model, "prompt": "word " * 400_000, "max_tokens": 1}
    assert f"longer than the maximum context length of {limit}" in error(
        httpx.post(url, json=big, timeout=60), 400
    )
    # /tokenize refuses it alike, naming the input as the generate routes do (param was null)
    r = httpx.post(stack.url + "/tokenize", json={"prompt": big["prompt"]}, timeout=60)
    assert f"longer than the maximum context length of {limit}" in error(r, 400)
    assert r.json()["error"]["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": big["prompt"]}]}
    r = httpx.post(stack.url + "/tokenize", json=chat, timeout=60)
    assert f"longer than the maximum context length of {limit}" in error(r, 400)
    assert r.json()["error"]["param"] == "messages"
    # A prompt that fills the context leaves no room for output.
    full = {"model": model, "prompt": [100] * limit, "max_tokens": None}
    assert f"the prompt has {limit} tokens" in error(httpx.post(url, json=full, timeout=60), 400)
    # Refusals in streaming mode are HTTP statuses, not a 200 with an error event.
    stream = {**full, "stream": True}
    r = httpx.post(url, json=stream, timeout=60)
    assert "maximum context length" in error(r, 400)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    ok = httpx.post(url, json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_openapi_schema_is_served(stack: FullStack) -> None:
    spec = httpx.get(stack.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])


def test_health_and_ready(stack: FullStack) -> None:
    assert httpx.get(stack.url + "/health").status_code == 200
    assert httpx.get(stack.url + "/ready").status_code == 200


def test_gateway_greedy_equals_cli_generate(client: openai.OpenAI, model: str) -> None:
    prompt = "The three primary colors are"
    ours = (
        client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=24)
        .choices[0]
        .text
    )
    cli = subprocess.run(
        [sys.executable, "-m", "hetero_infer.cli", "generate", prompt, "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert cli.stdout.rstrip("\n") == ours


def test_32_concurrent_streams_no_cross_talk(
    stack: FullStack, client: openai.OpenAI, model: str
) -> None:
    subjects = ["cats", "dogs", "rivers", "mountains", "bread", "music", "rain", "trains"]
    prompts = [f"Tell me about {s} number {i}:" for i in range(4) for s in subjects]
    alone = [
        client.completions.create(model=model, prompt=p, temperature=0, max_tokens=8)
        .choices[0]
        .text
        for p in prompts
    ]
    aclient = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)

    async def one(p: str) -> str:
        stream = await aclient.completions.create(
            model=model, prompt=p, temperature=0, max_tokens=8, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == alone


def test_killed_client_frees_blocks_within_a_second(stack: FullStack, model: str) -> None:
    script = textwrap.dedent(
        f"""
        import openai, sys
        c = openai.OpenAI(base_url="{stack.url}/v1", api_key="x", max_retries=0)
        s = c.completions.create(model="{model}", prompt="Write a long story:", max_tokens=2000,
                                 temperature=0, stream=True, extra_body={{"ignore_eos": True}})
        for i, _ in enumerate(s):
            if i == 3:
                print("streaming", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "streaming"
    assert _pool(stack).num_running == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    while time.monotonic() - killed < 1.0:
        st = _pool(stack)
        if st.num_free_kv_blocks == st.num_usable_kv_blocks and st.num_running == 0:
            break
        time.sleep(0.02)
    assert st.num_free_kv_blocks == st.num_usable_kv_blocks, st
    assert st.integrity_ok, st.integrity_error
