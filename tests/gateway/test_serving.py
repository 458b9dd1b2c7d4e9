"""The gateway's serving classes in-process: FastAPI's TestClient in front, a fake control
link behind (a fake is fine here: the unit under test is the gateway). Expected shapes
are the OpenAI API's documented ones (completions, chat completions, their chunks)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.errors import APIError, from_code
from hetero_proto import control_pb2 as pb
from tests.gateway.fake_link import MODEL, PROMPT_IDS, FakeLink


def _events(text: str) -> list[Any]:
    datas = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_completion(client: TestClient, link: FakeLink) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-request-id"]
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "text": "Hello!",
            "logprobs": None,
            "finish_reason": "length",
            # vLLM's extensions, null unless asked for (its clients read them)
            "stop_reason": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert link.mux.calls[0].text == "Hi" and link.mux.calls[0].params.max_tokens == 3


def test_completion_batch_of_prompts_with_n(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 3}
    )
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt i, choice k -> i * n + k
    assert all(c["text"] == "Hello!" for c in choices)


def test_completion_stream_with_usage(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Hi",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = _events(r.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "Hello!"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6


def test_completion_logprobs_have_text_offsets(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hel", "lo", "!"] and lp["text_offset"] == [0, 3, 5]
    assert lp["token_logprobs"] == [-0.25] * 3


def test_chat(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2},
    )
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["message"] for c in body["choices"]] == [
        {"role": "assistant", "content": "Hello!"}
    ] * 2
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 6


def test_chat_stream_starts_with_the_role(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "logprobs": True,
        },
    )
    chunks = _events(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert content == "Hello!"
    assert chunks[1]["choices"][0]["logprobs"]["content"][0]["token"] == "Hel"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (APIError(400, "bad prompt", param="prompt"), 400),
        (APIError(429, "queue full", type="rate_limit_error"), 429),
        (APIError(503, "no compute plane", type="service_unavailable"), 503),
        (APIError(504, "Deadline Exceeded", type="timeout"), 504),
    ],
)
def test_a_control_plane_error_is_an_openai_error(
    client: TestClient, link: FakeLink, error: APIError, status: int
) -> None:
    link.mux.error = error
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == status
    assert r.json() == {
        "error": {"message": error.message, "type": error.type, "param": error.param, "code": None}
    }
    if status in (429, 503):
        assert r.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (
            "prompt (3 tokens) + max_tokens (4096) = 4099 exceeds the maximum context length "
            "of 2048 tokens",
            "context_length_exceeded",
        ),
        ("prompt: token id 99999 is out of vocabulary", "invalid_argument"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_of_a_batch_is_named(
    client: TestClient, link: FakeLink, message: str, code: str, stream: bool
) -> None:
    """A batch's prompt the control plane refuses is named by its index (param and
    message), as pydantic names a bad token id in it; a single prompt stays `prompt`."""
    link.mux.call_errors = {2: from_code("INVALID_ARGUMENT", message)}
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "stream": stream}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt.2" and error["code"] == code
    assert error["message"] == f"prompt.2: {message.removeprefix('prompt: ')}"
    link.mux.call_errors = {0: from_code("INVALID_ARGUMENT", message)}
    r = client.post("/v1/completions", json={**body, "prompt": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # An error about a field the prompts share names that field, not a prompt.
    link.mux.call_errors = {1: from_code("INVALID_ARGUMENT", "stop_token_ids: token id 7 ...")}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
]
# Two calls in the bundled SmolLM2's format (a list in one block), cut across deltas.
TWO_CALLS = [
    '<tool_call>[{"name": "add", "arguments": {"a": 1}}, ',
    '{"name": "add", "arguments": {"a": 2}}]</tool_call>',
]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}]
)
@pytest.mark.parametrize(
    ("pieces", "args"),
    [
        ([TWO_CALLS[0], '{"name": "add", "arguments": {"a'], ['{"a": 1}', '{"a']),
        (['<tool_call>[{"name": "ad'], [""]),
        (["<tool_call>["], []),
    ],
)
def test_a_forced_call_cut_short_is_its_calls_so_far_not_markup(
    client: TestClient, link: FakeLink, tool_choice: Any, pieces: list[str], args: list[str]
) -> None:
    """A forced call that max_tokens cuts short (finish_reason length) gives the calls
    written so far, the last one's arguments as far as they got (OpenAI and vLLM give a
    truncated call's arguments so), never the call's markup as content; streamed alike."""
    link.mux.pieces = pieces
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "1 + 1, 2 + 2?"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
    }
    (choice,) = client.post("/v1/chat/completions", json=body).json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "length" and message["content"] == ""
    calls = message.get("tool_calls", [])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("add", a) for a in args
    ]
    streamed = _events(client.post("/v1/chat/completions", json=body | {"stream": True}).text)
    chunks = [c["choices"][0] for c in streamed if c["choices"]]
    assert not "".join(c["delta"].get("content") or "" for c in chunks)
    deltas = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    assert [tc["function"]["arguments"] for tc in deltas] == args
    assert chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("pieces", "content", "args"),
    [
        (
            ["Sure. ", TWO_CALLS[0], '{"name": "add", "arguments": {"a'],
            "Sure. ",
            ['{"a": 1}', '{"a'],
        ),
        (['<tool_call>\n{"name": "add", "arguments": {"a": '], None, ['{"a": ']),
        (['Sure. <tool_call>[{"name": "ad'], "Sure. ", []),
    ],
)
def test_an_auto_call_cut_short_is_its_calls_so_far_as_a_forced_one(
    client: TestClient, link: FakeLink, pieces: list[str], content: str | None, args: list[str]
) -> None:
    """tool_choice auto, the model's call cut by max_tokens: finish_reason length, the text
    before the call as content, the calls written so far (the last one's arguments as far
    as they got, as OpenAI returns a truncated call), never the call's markup as content
    (it was: the raw text); streamed alike."""
    link.mux.pieces = pieces
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "1 + 1, 2 + 2?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
    }
    (choice,) = client.post("/v1/chat/completions", json=body).json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "length" and message["content"] == content
    calls = message.get("tool_calls", [])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("add", a) for a in args
    ]
    streamed = _events(client.post("/v1/chat/completions", json=body | {"stream": True}).text)
    chunks = [c["choices"][0] for c in streamed if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == (content or "")
    deltas = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    assert [tc["function"]["arguments"] for tc in deltas] == args
    assert chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ({"type": "object", "properties": []}, '[] is not of type "object" (at properties)'),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "at properties.a.type"),
        ({"type": "object", "required": "a"}, "at required"),
        (
            {"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"a": 5}},
            "at properties.a",
        ),
        ({"type": "string"}, "must be an object schema"),
        ({"type": "object", "properties": {"a": {"maximum": 1e400}}}, "not finite"),
    ],
)
@pytest.mark.parametrize(
    "choice", [None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}}]
)
def test_a_tool_schema_that_is_not_json_schema_is_a_400_whatever_tool_choice_says(
    client: TestClient, link: FakeLink, parameters: dict[str, Any], needle: str, choice: Any
) -> None:
    """As OpenAI: tools.0.function.parameters must be a valid JSON Schema (an object's),
    not only where tool_choice compiles it into a grammar."""
    tools = [
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "f", "parameters": parameters}},
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    text = json.dumps(body).replace("Infinity", "1e400")  # (valid JSON; Python reads inf)
    headers = {"Content-Type": "application/json"}
    r = client.post("/v1/chat/completions", content=text, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools.1.function.parameters"
    assert error["message"].startswith("tools.1.function.parameters: ")
    assert needle in error["message"]
    assert not link.mux.calls


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?!x)"}}},
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        {"$schema": "https://example.com/unknown", "type": "object"},
        {"$schema": "json-schema.org/draft-07/schema#", "type": "object"},  # (not fetched)
        {"$schema": "http://json-schema.org/draft-07/schema", "type": "object"},
    ],
)
def test_valid_json_schema_llguidance_cannot_compile_is_taken_under_auto(
    client: TestClient, link: FakeLink, parameters: dict[str, Any]
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("parallel", "calls"), [(True, 2), (False, 1)])
def test_parallel_tool_calls_false_returns_the_first_call_alone(
    client: TestClient, link: FakeLink, parallel: bool, calls: int
) -> None:
    """With tool_choice auto nothing constrains the model: when it writes two calls,
    parallel_tool_calls false (OpenAI: at most one) gives the first."""
    link.mux.pieces = TWO_CALLS
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "1 + 1, 2 + 2?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": parallel,
    }
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    args = [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]]
    assert args == [{"a": 1}, {"a": 2}][:calls] and message["content"] is None
    streamed = _events(client.post("/v1/chat/completions", json=body | {"stream": True}).text)
    deltas = [tc for c in streamed for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [json.loads(tc["function"]["arguments"]) for tc in deltas] == args
    assert [tc["index"] for tc in deltas] == list(range(calls))
    # Past the role chunk, every chunk's choice has the keys a chunk without tools has
    # (stop_reason was missing).
    keys = {"index", "delta", "logprobs", "finish_reason", "stop_reason"}
    after_role = [c["choices"][0] for c in streamed[1:] if c["choices"]]
    assert after_role and all(set(c) == keys for c in after_role)


def test_wrong_model_is_404(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "other", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_an_unimplemented_field_is_a_400_that_names_it(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "suffix": "the end"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("store", [False, None])
def test_a_chat_asking_that_nothing_be_stored_is_served(client: TestClient, store: Any) -> None:
    """OpenAI's `store` (its default false: the completion is not kept) is what this
    server does anyway; it was a 400 (an unknown field), and some clients send it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "store": store}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello!"


def test_a_chat_asking_to_be_stored_is_a_400_naming_store(client: TestClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "store": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "store"
    assert error["message"] == "store: true is not supported: this server keeps no completions"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streamed_token_ids_include_those_of_held_back_text(
    client: TestClient, link: FakeLink, route: str
) -> None:
    """A delta whose text the control plane holds back (it may be a stop string) still has
    its token ids; streamed with return_token_ids they come with the next chunk. They were
    dropped with the delta's empty chunk, so the streamed ids missed tokens."""
    link.mux.pieces = ["Hel", "", "", "lo"]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "return_token_ids": True, "n": 2}
    body |= (
        {"prompt": "Hi"}
        if route == "completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    whole = client.post(f"/v1/{route}", json=body).json()["choices"]
    assert [c["token_ids"] for c in whole] == [[100, 101, 102, 103]] * 2
    streamed: dict[int, list[int]] = {0: [], 1: []}
    with client.stream("POST", f"/v1/{route}", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c.get("token_ids") or []
    assert streamed == {0: [100, 101, 102, 103], 1: [100, 101, 102, 103]}


@pytest.mark.parametrize("prompt_ids", [PROMPT_IDS, [11]], ids=["three-tokens", "one-token"])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streamed_prompt_logprobs_are_the_whole_answers(
    client: TestClient, link: FakeLink, route: str, prompt_ids: list[int]
) -> None:
    """Each choice's prompt_logprobs, streamed (its first chunk that has them) and not:
    every choice of a prompt gets them, and a one-token prompt's are [None]. Streamed,
    only choice 0 had them, and a one-token prompt had none."""
    link.mux.prompt_ids = prompt_ids
    body: dict[str, Any] = {"model": MODEL, "n": 2, "prompt_logprobs": 1, "max_tokens": 3}
    if route == "completions":
        body["prompt"] = ["a", "b"]
    else:
        body["messages"] = [{"role": "user", "content": "a"}]
    whole = client.post(f"/v1/{route}", json=body).json()
    if route == "completions":
        expected = {c["index"]: c["prompt_logprobs"] for c in whole["choices"]}
    else:  # (vLLM's chat response has them once, beside the choices)
        expected = {c["index"]: whole["prompt_logprobs"] for c in whole["choices"]}
    assert len(expected) == (4 if route == "completions" else 2)
    assert all(p is not None and p[0] is None for p in expected.values())
    assert all(len(p) == len(prompt_ids) for p in expected.values())
    streamed: dict[int, Any] = {}
    with client.stream("POST", f"/v1/{route}", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if "prompt_logprobs" in c:
                    assert c["index"] not in streamed  # once per choice
                    streamed[c["index"]] = c["prompt_logprobs"]
    assert streamed == expected


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    """echo + logprobs is served: the call asks the control plane for prompt logprobs."""
    from gateway.generation import completion_calls
    from gateway.schemas import CompletionRequest

    body = {"model": MODEL, "prompt": "Hi", "echo": True, "logprobs": 3}
    (call,) = completion_calls(CompletionRequest.model_validate(body))
    assert call.params.HasField("prompt_logprobs") and call.params.prompt_logprobs == 3
    (plain,) = completion_calls(CompletionRequest.model_validate({**body, "echo": False}))
    assert not plain.params.HasField("prompt_logprobs")


def test_echo_with_max_tokens_0_asks_for_the_prompt_alone(
    client: TestClient, link: FakeLink
) -> None:
    """echo + max_tokens 0 (scoring a prompt) is a prompt_only call, not max_tokens 0
    (up to the context); without echo max_tokens 0 is a 400 naming it, as vLLM's."""
    body = {"model": MODEL, "prompt": "Hi", "echo": True, "max_tokens": 0, "logprobs": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    (call,) = link.mux.calls
    assert call.params.prompt_only and call.params.max_tokens == 0
    assert call.params.prompt_logprobs == 1
    r = client.post("/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert len(link.mux.calls) == 1
    client.post("/v1/completions", json={**body, "max_tokens": 1})
    assert not link.mux.calls[-1].params.prompt_only


@pytest.mark.parametrize(("logprobs", "prompt_logprobs"), [(1, 3), (3, 1), (2, None)])
def test_echoed_logprobs_and_prompt_logprobs_each_get_their_own_count(
    client: TestClient, link: FakeLink, logprobs: int, prompt_logprobs: int | None
) -> None:
    """echo + logprobs N + prompt_logprobs M: the control plane is asked for max(N, M)
    alternatives; the echoed tokens' top_logprobs hold N (+ the token), vLLM's
    prompt_logprobs M (+ the token). The echoed ones had M."""
    body = {"model": MODEL, "prompt": "Hi", "echo": True, "logprobs": logprobs}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    for stream in (False, True):
        r = client.post("/v1/completions", json=body | {"stream": stream})
        assert link.mux.calls[-1].params.prompt_logprobs == max(logprobs, prompt_logprobs or 0)
        choices = (
            [c["choices"][0] for c in _events(r.text) if c["choices"]]
            if stream
            else r.json()["choices"]
        )
        first = next(c for c in choices if c["logprobs"])
        echoed = first["logprobs"]["top_logprobs"][: len(PROMPT_IDS)]
        assert echoed[0] is None and [len(x) for x in echoed[1:]] == [logprobs + 1] * 2
        plps = next((c["prompt_logprobs"] for c in choices if c.get("prompt_logprobs")), None)
        if prompt_logprobs is None:
            assert plps is None
        else:
            assert plps[0] is None and [len(x) for x in plps[1:]] == [prompt_logprobs + 1] * 2


def _completion_choices(
    client: TestClient, body: dict[str, Any], stream: bool
) -> list[dict[str, Any]]:
    """A one-prompt completion's choice, streamed (each chunk's) or not."""
    r = client.post("/v1/completions", json=body | {"stream": stream})
    if stream:
        return [c["choices"][0] for c in _events(r.text) if c["choices"]]
    return list(r.json()["choices"])


def test_echoed_offsets_index_the_text_when_its_bos_is_not_in_it(client: TestClient) -> None:
    """A text prompt's echo is the text as sent; the BOS the tokenizer put first (here
    "t11") is not in it, so it takes no characters: every offset indexes the echoed text,
    prompt tokens' as the generated ones' (they were counted from after the BOS, running
    backwards at the first generated token: Gemma 3's 0, 5, ..., 26, 24)."""
    body = {"model": MODEL, "prompt": "p12p13", "echo": True, "logprobs": 0}
    for stream in (False, True):
        choices = _completion_choices(client, body, stream)
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert text == "p12p13Hello!" and tokens == ["t11", "p12", "p13", "Hel", "lo", "!"]
        assert offsets == [0, 0, 3, 6, 9, 11], stream
        assert all(text[o : o + len(t)] == t for t, o in zip(tokens[1:], offsets[1:], strict=True))


def test_echoed_offsets_index_the_text_where_a_character_is_split_between_tokens() -> None:
    """A character split between tokens ("日" as two byte tokens) shows each piece as "�":
    their strings' lengths do not add up to the text. The offsets index the text by bytes
    (a piece's is its character's), so they end within it, never past the first generated
    token's (they ran on to 9 before its 8 on the bundled model's "日本語 🎉 ok")."""
    from gateway.serving import echo_logprobs

    text = "a日本 ok"
    pieces = [b"\xe6\x97", b"\xa5", "本".encode(), b" ok"]
    lps = [
        pb.TokenLogprob(token=b.decode(errors="replace"), token_bytes=b, logprob=-1.0)
        for b in pieces
    ]
    out = echo_logprobs(text, "a", lps, None)
    assert out["tokens"] == ["a", "�", "�", "本", " ok"]
    assert out["text_offset"] == [0, 1, 1, 2, 3]
    assert text[3:] == " ok"  # (the generated tokens start at len(text): 6)
    # A BOS the text lacks takes none of it; a prompt that starts with a piece: its char.
    assert echo_logprobs(text, "<s>", lps[:0], None)["text_offset"] == [0]
    out = echo_logprobs("日 ok", "�", lps[1:2] + lps[3:], None)
    assert out["text_offset"] == [0, 0, 1]


def test_offsets_count_a_character_split_over_tokens_once(
    client: TestClient, link: FakeLink
) -> None:
    """A character whose bytes come in several tokens (Gemma 3's byte fallback spells
    '𓀀' in 4) is one character of the text: each piece starts at it and the next token
    one character on. Each piece's text alone is U+FFFD, and the offsets counted those,
    one a piece: past the text, and echoed, the generated tokens' offsets ran backwards
    from the prompt's (Gemma 3 on 'x 𓀀𓀁': ..., 10, 11, 15, then 9)."""
    link.mux.pieces = ["", "", "", "𓀀", "x"]
    link.mux.piece_bytes = [b"\xf0", b"\x93", b"\x80", b"\x80", b"x"]
    for echo, at in ((False, []), (True, [0, 0, 3])):
        body = {"model": MODEL, "prompt": "p12p13", "echo": echo, "logprobs": 0}
        for stream in (False, True):
            choices = _completion_choices(client, body, stream)
            text = "".join(c["text"] for c in choices)
            offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
            assert text == ("p12p13" if echo else "") + "𓀀x", (echo, stream)
            start = 6 if echo else 0
            assert offsets == [*at, start, start, start, start, start + 1], (echo, stream)
            assert text[offsets[-1]] == "x"


def test_models_and_ready(client: TestClient) -> None:
    model = client.get("/v1/models").json()["data"][0]
    assert model["id"] == MODEL
    # a Unix time: when the gateway started, not 0 (1970 in clients that show it)
    assert time.time() - 3600 < model["created"] <= time.time()
    assert client.get(f"/v1/models/{MODEL}").json()["created"] == model["created"]
    assert client.get("/ready").json() == {"status": "ready", "model": MODEL}
    assert client.get("/health").json() == {"status": "ok"}
    for path in ("/health", "/ready", "/v1/models", f"/v1/models/{MODEL}", "/version"):
        head, get = client.head(path), client.get(path)  # HEAD answers as GET, no body
        assert head.status_code == 200 and head.content == b"", path
        assert head.headers["content-length"] == get.headers["content-length"], path


def test_max_model_len_is_null_before_a_compute_plane_attaches(
    client: TestClient, link: FakeLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The context length is the compute plane's: before one attaches the control plane
    answers 0 for it, which /v1/models and /tokenize give as null (unknown), not as a
    limit of 0 tokens (vLLM's model card and tokenize answer hold an int or null)."""
    model = client.get("/v1/models").json()["data"][0]
    assert model["max_model_len"] == 2048  # (the fake's attached plane)

    async def unattached(timeout: float = 2.0) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(model_name=MODEL, compute_attached=False)

    class Stub:
        async def Tokenize(self, req: pb.TokenizeRequest, timeout: float) -> Any:
            return pb.TokenizeResponse(token_ids=[5, 6], count=2)

    monkeypatch.setattr(link, "info", unattached)
    monkeypatch.setattr(link, "open", Stub)
    assert client.get("/ready").status_code == 503
    for path in ("/v1/models", f"/v1/models/{MODEL}"):
        body = client.get(path).json()
        model = body["data"][0] if "data" in body else body
        assert model["id"] == MODEL and model["max_model_len"] is None, path
    tokens = client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).json()
    assert tokens == {"count": 2, "max_model_len": None, "tokens": [5, 6], "token_strs": None}


def test_generation_config_defaults_fill_only_fields_left_out(
    client: TestClient, link: FakeLink, tmp_path: Path
) -> None:
    from control_plane.server import generation_defaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "bos_token_id": 1}
        )
    )
    link.sampling_defaults = generation_defaults(tmp_path)
    assert link.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert generation_defaults(tmp_path / "missing") == {}
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "top_p": 0.5})
    params = link.mux.calls[-1].params
    assert params.temperature == pytest.approx(0.6) and params.top_k == 20
    assert params.top_p == pytest.approx(0.5)  # the request's own value wins


def test_null_is_a_field_left_out(client: TestClient, link: FakeLink) -> None:
    """OpenAI's optional fields are "or null", and the openai client sends a None it is
    given (temperature=None) as null: the default, or the model's generation_config value,
    as if left out. Where null has a meaning of its own it keeps it (completions'
    max_tokens: up to the context)."""
    link.sampling_defaults = {"temperature": 0.6}
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "echo"))
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": None, **nulls}
    )
    assert r.status_code == 200, r.text
    params = link.mux.calls[-1].params
    assert params.temperature == pytest.approx(0.6) and params.top_p == 1.0
    assert params.n == 1 and params.max_tokens == 0  # (0: up to the context)
    assert r.json()["choices"][0]["text"] == "Hello!"  # (no echo)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        **dict.fromkeys(("logprobs", "parallel_tool_calls", "frequency_penalty", "n")),
        "stream_options": None,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    assert not link.mux.calls[-1].params.logprobs
    body["model"] = None  # a required field is still required
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_positive_values_below_float32_do_not_arrive_as_off(
    client: TestClient, link: FakeLink
) -> None:
    """top_p and repetition_penalty travel as 32-bit floats, where 1e-50 is 0: "off" (1.0)."""
    body = {"model": MODEL, "prompt": "Hi", "top_p": 1e-50, "repetition_penalty": 1e-50}
    assert client.post("/v1/completions", json=body).status_code == 200
    params = link.mux.calls[-1].params
    assert 0 < params.top_p < 1e-37 and 0 < params.repetition_penalty < 1e-37


def test_a_batch_larger_than_the_waiting_queue_is_refused_before_any_call(
    client: TestClient, link: FakeLink
) -> None:
    link.max_waiting = 2
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2}
    for stream in (False, True):
        r = client.post("/v1/completions", json=body | {"stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
        assert "--max-waiting 2" in r.json()["error"]["message"]
    assert link.mux.calls == []  # nothing was sent to a control plane
    ok = client.post("/v1/completions", json=body | {"prompt": ["a", "b"], "n": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 6
    assert len(link.mux.calls) == 2
    link.max_waiting = 0  # a control plane that does not say: no limit here
    assert client.post("/v1/completions", json=body).status_code == 200


def _receive(
    body: bytes, leave: Callable[[], Awaitable[object]]
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI receive: the request's body, then the client's disconnect once `leave`
    returns."""
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leave()
        return {"type": "http.disconnect"}

    return receive


def _post_scope(path: str, body: bytes) -> dict[str, Any]:
    """The ASGI scope of a JSON POST, for driving the app without a client."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }


def test_a_client_leaving_during_a_send_cancels_its_calls_at_once(link: FakeLink) -> None:
    """The disconnect lands while a chunk is being sent: the stream's calls are cancelled
    before the response returns, not when the garbage collector (off here) or the
    server's shutdown closes the suspended body generator."""
    app = create_app(GatewayConfig(port=8000), link)  # type: ignore[arg-type]
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": True}).encode()
    scope = _post_scope("/v1/completions", body)
    chunks: list[bytes] = []

    async def run() -> list[str]:
        gone = asyncio.Event()
        receive = _receive(body, gone.wait)

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                chunks.append(message["body"])
                gone.set()  # the client leaves while its first chunk is on the way
                await asyncio.sleep(0.05)

        await app(scope, receive, send)
        return list(link.mux.cancelled)  # before asyncio.run closes leftover generators

    gc.disable()
    try:
        cancelled = asyncio.run(run())
    finally:
        gc.enable()
    assert len([c for c in chunks if c]) == 1  # the stream stopped at the disconnect
    assert cancelled == ["r0"]


def test_a_client_leaving_before_its_response_is_a_499_not_an_error(
    link: FakeLink, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-streamed request whose client leaves mid-generation: its calls are
    cancelled, and it is counted under nginx's 499 (client closed request). The metrics
    middleware raised "No response returned" (logged as an ASGI exception, counted 500)."""
    link.mux.hold = True  # the generation goes on until cancelled
    app = create_app(GatewayConfig(port=8000), link)  # type: ignore[arg-type]
    body = json.dumps({"model": MODEL, "prompt": "Tell a story", "max_tokens": 300}).encode()

    def counted(status: str) -> float:
        labels = {"route": "/v1/completions", "status": status}
        return REGISTRY.get_sample_value("hetero_http_requests_total", labels) or 0.0

    before = {status: counted(status) for status in ("499", "500")}

    async def run() -> list[str]:
        receive = _receive(body, lambda: asyncio.sleep(0.05))  # the generation under way

        async def send(message: dict[str, Any]) -> None:
            return None  # nobody is there to read it

        await app(_post_scope("/v1/completions", body), receive, send)
        return list(link.mux.cancelled)

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(run()) == ["r0"]
    assert counted("499") == before["499"] + 1 and counted("500") == before["500"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_leaving_before_its_body_is_sent_is_a_499_not_an_error(
    link: FakeLink, caplog: pytest.LogCaptureFixture
) -> None:
    """The client leaves after part of its body: nothing is generated, and the request is
    counted under 499. The body limit returned no response, so the metrics middleware
    raised "No response returned" (logged as an ASGI exception, counted 500)."""
    app = create_app(GatewayConfig(port=8000), link)  # type: ignore[arg-type]
    body = json.dumps({"model": MODEL, "prompt": "Hi"}).encode()
    messages = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.disconnect"},
    ]

    def counted(status: str) -> float:
        labels = {"route": "other", "status": status}
        return REGISTRY.get_sample_value("hetero_http_requests_total", labels) or 0.0

    before = {status: counted(status) for status in ("499", "500")}

    async def run() -> None:
        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            return None  # nobody is there to read it

        await app(_post_scope("/v1/completions", body), receive, send)

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert link.mux.calls == []
    assert counted("499") == before["499"] + 1 and counted("500") == before["500"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_stream_is_in_flight_until_its_last_byte(link: FakeLink) -> None:
    """hetero_http_requests_in_flight counts a streamed response until it ends, not only
    to its head (the metrics middleware's call_next returns there: streams were never
    counted while they ran)."""
    link.mux.hold = True  # the generation goes on until the client leaves
    app = create_app(GatewayConfig(port=8000), link)  # type: ignore[arg-type]
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": True}).encode()

    def in_flight() -> float:
        return REGISTRY.get_sample_value("hetero_http_requests_in_flight") or 0.0

    before = in_flight()
    seen: list[float] = []

    async def run() -> None:
        started = asyncio.Event()

        async def leave() -> None:
            await started.wait()
            await asyncio.sleep(0.05)  # the stream is under way
            seen.append(in_flight())

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.set()

        await app(_post_scope("/v1/completions", body), _receive(body, leave), send)

    asyncio.run(run())
    assert seen == [before + 1]
    assert in_flight() == before


def test_metrics_answer_head_and_the_format_the_scraper_asks_for(client: TestClient) -> None:
    """/metrics as the planes' prometheus_client servers serve it: OpenMetrics when the
    scraper asks (Prometheus does), plain text else, HEAD as GET; only /metrics itself is
    left out of the HTTP counters, not every path that starts with it."""

    def counted(route: str, status: str) -> float:
        labels = {"route": route, "status": status}
        return REGISTRY.get_sample_value("hetero_http_requests_total", labels) or 0.0

    plain = client.get("/metrics")
    assert plain.headers["content-type"].startswith("text/plain")
    assert "hetero_http_requests_total" in plain.text
    open_metrics = client.get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.rstrip().endswith("# EOF")
    assert client.head("/metrics").status_code == 200
    before = counted("other", "404"), counted("/metrics", "200")
    assert client.get("/metricsXYZ").status_code == 404
    assert (counted("other", "404"), counted("/metrics", "200")) == (before[0] + 1, before[1])


def test_a_big_chats_calls_are_built_off_the_event_loop(
    client: TestClient, link: FakeLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat read in the body lane (gateway.bodies) has its generate call built there too:
    for 50,000 messages that took 0.07-0.1 s, with every other stream held meanwhile."""
    import threading

    from gateway import serving

    where: list[str] = []

    def chat_call(req: Any) -> pb.GenerateRequest:
        where.append(threading.current_thread().name)
        return real(req)

    real = serving.chat_call
    monkeypatch.setattr(serving, "chat_call", chat_call)
    small = [{"role": "user", "content": "Hi"}]
    big = [{"role": "user", "content": "a" * 100}] * 1000  # > OFF_LOOP_BYTES of JSON
    for messages in (small, big, small):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text
    assert len(link.mux.calls) == 3 and len(link.mux.calls[1].chat.messages) == 1000
    loop = where[0]
    assert where[2] == loop and where[1].startswith("body") and where[1] != loop
    r = client.post(  # its errors still reach the client as the small one's would
        "/v1/chat/completions",
        json={"model": MODEL, "messages": big, "continue_final_message": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
