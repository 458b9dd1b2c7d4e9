"""Every error the gateway returns is OpenAI's error object, whatever broke: the route,
the method, the bytes, the JSON, a type, a lone surrogate (no control plane needed:
these are refused before any is asked)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.errors import APIError, from_code
from gateway.generation import structured_output
from gateway.schemas import ChatCompletionRequest, CompletionRequest

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(GatewayConfig(port=8000, control="127.0.0.1:9")))


def _error(r: object, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    body = r.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def test_unknown_route_and_wrong_method(client: TestClient) -> None:
    assert _error(client.post("/v1/nope", json={}), 404)["code"] == "not_found"
    r = client.get("/v1/completions")
    assert _error(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"


@pytest.mark.parametrize(
    "raw",
    [b'\xff\xfe{"model": "m"}', b"[" * 10_000 + b"]" * 10_000, b'{"model": 9', b"{,}"],
    ids=["invalid-utf8", "deep", "truncated", "malformed"],
)
def test_unreadable_bodies(client: TestClient, raw: bytes) -> None:
    err = _error(client.post("/v1/completions", content=raw, headers=JSON), 400)
    assert err["param"] is None  # never a byte offset
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content_type", "needle"),
    [
        ("application/x-www-form-urlencoded", "(not application/x-www-form-urlencoded)"),
        ("text/plain", "(not text/plain)"),
        (None, "(not none)"),
    ],
)
def test_a_body_not_sent_as_json_says_so(
    client: TestClient, content_type: str | None, needle: str
) -> None:
    """`curl -d` sends the JSON as a form: the error says what to send instead."""
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"model": "m", "prompt": "x"}'
    err = _error(client.post("/v1/completions", content=body, headers=headers), 400)
    assert "Content-Type: application/json" in str(err["message"]) and needle in str(err["message"])
    err = _error(client.post("/v1/completions", json=[1, 2]), 400)
    assert err["message"] == "the body must be a JSON object", err


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "16"), ("n", "2"), ("stream", "yes"), ("seed", True), ("temperature", "0")],
)
def test_types_are_strict(client: TestClient, field: str, value: object) -> None:
    body = {"model": "m", "prompt": "hi", field: value}
    assert _error(client.post("/v1/completions", json=body), 400)["param"] == field


USER = '{"role": "user", "content": "hi"}'
TOOLS = (
    '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
    '"properties": {"a": {"type": "string", "description": "\\ud800"}}}}}]'
)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", '{"model": "m", "prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", '{"model": "\\udfff", "prompt": "a"}', "model"),
        ("/v1/completions", '{"model": "m", "prompt": "a", "stop": ["\\ud800x"]}', "stop"),
        (
            "/v1/chat/completions",
            '{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        # Free-form JSON: its keys and strings, however deep (they reached the tokenizer,
        # which raised: a 500 that quoted it)
        ("/v1/chat/completions", f'{{"model": "m", "messages": [{USER}], {TOOLS}}}',
         "tools.0.function.parameters"),
        ("/v1/chat/completions",
         f'{{"model": "m", "messages": [{USER}], "chat_template_kwargs": {{"x": [{{"\\udc00": 1}}]}}}}',
         "chat_template_kwargs"),
        ("/v1/chat/completions",
         f'{{"model": "m", "messages": [{USER}], "documents": [{{"\\ud800": "text"}}]}}',
         "documents.0"),
        ("/v1/completions", '{"model": "m", "prompt": "a", "guided_json": {"enum": ["\\ud800"]}}',
         "guided_json"),
        # tool-call arguments are JSON text: an escaped surrogate is one once parsed
        ("/v1/chat/completions",
         f'{{"model": "m", "messages": [{USER}, {{"role": "assistant", "tool_calls": [{{"id": "c", '
         '"function": {"name": "f", "arguments": "{\\"a\\": \\"\\\\ud800\\"}"}}]}]}',
         "messages.1.tool_calls.0.function.arguments"),
        # /tokenize names the chat body's field (not the prompt it has no need of)
        ("/tokenize", f'{{"messages": [{USER}], {TOOLS}}}', "tools.0.function.parameters"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages.0.content"),
    ],
    ids=["prompt", "model", "stop", "content", "tool-parameters", "template-kwargs-key",
         "document-key", "guided-json", "tool-call-arguments", "tokenize-tools",
         "tokenize-content"],
)  # fmt: skip
def test_lone_surrogates_are_a_400(client: TestClient, route: str, body: str, param: str) -> None:
    err = _error(client.post(route, content=body.encode(), headers=JSON), 400)
    assert str(err["param"]).startswith(param) and "surrogate" in str(err["message"])
    # The connection stays usable (no dropped keep-alive): the next request is answered.
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "arguments", ['{"a": "\\u00e9\\ud83d\\ude00"}', "not JSON \\ud800", "[" * 5000]
)
def test_tool_call_arguments_of_text_or_not_json_are_taken(arguments: str) -> None:
    """Escaped text (a surrogate pair is text) passes; arguments that are not JSON go to
    the template as sent, so their escapes are no surrogates."""
    call = {"id": "c", "function": {"name": "f", "arguments": arguments}}
    message = {"role": "assistant", "tool_calls": [call]}
    ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        # token ids in ASCII digits only: "²" and "١٢" are digits to str.isdigit, and int()
        # of "²" raised (a 500); 5000 digits are past int()'s limit
        ("chat/completions", {"logit_bias": {"²": 1}}, "logit_bias"),
        ("chat/completions", {"logit_bias": {"١٢": 1}}, "logit_bias"),
        ("chat/completions", {"logit_bias": {"--5": 1}}, "logit_bias"),
        ("chat/completions", {"logit_bias": {"7" * 5000: 1}}, "logit_bias"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        (
            "chat/completions",
            {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
        ),
        ("completions", {"prompt": ""}, "prompt"),
        # a batch's empty prompt is named by its index, as a refused one is
        ("completions", {"prompt": ["a", ""]}, "prompt.1"),
        ("completions", {"prompt": [[1], []]}, "prompt.1"),
        ("completions", {"prompt": [[1], [2], []]}, "prompt.2"),
        # a system, user or tool turn needs content (OpenAI's rule); null or left out
        ("chat/completions", {"messages": [{"role": "user", "content": None}]},
         "messages.0.content"),
        ("chat/completions", {"messages": [{"role": "system", "content": "x"}, {"role": "user"}]},
         "messages.1.content"),
        ("chat/completions", {"messages": [{"role": "tool", "tool_call_id": "c"}]},
         "messages.0.content"),
    ],
    ids=[
        "bias-superscript", "bias-arabic-indic", "bias-double-minus", "bias-5000-digits",
        "top-logprobs-alone", "schema-without-its-type", "empty-prompt", "empty-in-batch",
        "empty-ids-in-batch", "third-empty-ids-in-batch", "user-content-null", "user-content-left-out",
        "tool-content-left-out",
    ],
)  # fmt: skip
def test_fields_the_request_cannot_mean_are_a_400_naming_them(
    client: TestClient, route: str, extra: dict[str, object], param: str
) -> None:
    body = {**CHAT, **extra} if route.startswith("chat") else {"model": "m", **extra}
    err = _error(client.post(f"/v1/{route}", json=body), 400)
    assert err["param"] == param, err
    assert len(str(err["message"])) < 200  # (a 5000-digit key is not echoed whole)


def test_an_unexpected_exception_is_a_500_error_object_and_the_connection_lives() -> None:
    app = create_app(GatewayConfig(port=8000, control="127.0.0.1:9"))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app) as c:  # (TestClient raises what the app lets out)
        r = c.get("/boom", headers={"x-request-id": "req-1"})
        err = _error(r, 500)
        assert err["type"] == "internal_error" and "a bug" not in str(err["message"])
        assert r.headers["x-request-id"] == "req-1"
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("route", "extra", "param", "needle"),
    [
        # a union's members each complain; the one that got furthest into the value says
        # what is wrong (this said "should be 'none', 'auto' or 'required'")
        ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": 5}}},
         "tool_choice.function.name", "valid string"),
        ("chat/completions", {"tool_choice": {"type": "function"}}, "tool_choice.function",
         "required"),
        ("chat/completions", {"tool_choice": "sometimes"}, "tool_choice", "'auto'"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content.0.text", "required"),
        ("completions", {"stop": ["a", 5]}, "stop.1", "valid string"),
        ("completions", {"stop": "a" * 300}, "stop", "256"),
        # (these said "prompt: Field required", a field of the other member)
        ("tokenize", {"prompt": 5}, "prompt", "valid string"),
        ("tokenize", {"messages": CHAT["messages"], "chat_template_kwargs": "x"},
         "chat_template_kwargs", "dictionary"),
    ],
)  # fmt: skip
def test_a_bad_value_in_a_union_is_named_where_it_is(
    client: TestClient, route: str, extra: dict[str, object], param: str, needle: str
) -> None:
    if route == "tokenize":
        r = client.post("/tokenize", json={"model": "m", **extra})
    else:
        base = CHAT if route.startswith("chat") else {"model": "m", "prompt": "x"}
        r = client.post(f"/v1/{route}", json={**base, **extra})
    err = _error(r, 400)
    assert err["param"] == param, err
    assert needle in str(err["message"]), err


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            "messages[3]: the chat template refuses it: Conversation roles must alternate",
            "messages.3",
        ),
        ("messages[12].role must be a string", "messages.12"),
        ("the chat template refuses the chat: System role not supported", "messages"),
        ("stop_token_ids: token id 7 is not in 0..5", "stop_token_ids"),
    ],
)
def test_a_control_plane_refusal_names_the_message_it_names(message: str, param: str) -> None:
    """(A chat template's refusal had param null.)"""
    e = from_code("INVALID_ARGUMENT", message)
    assert (e.status, e.param, e.message) == (400, param, message)


@pytest.mark.parametrize(
    ("route", "body", "literal", "pos"),
    [
        ("/v1/completions", '{"model": "m", "prompt": "NaN", "temperature": NaN}', "NaN", 47),
        ("/v1/chat/completions", '{"messages": [], "top_p": Infinity}', "Infinity", 26),
        (
            "/v1/completions",
            '{"prompt": "x", "guided_json": {"minimum": -Infinity}}',
            "-Infinity",
            43,
        ),
        ("/tokenize", '{"prompt": "x", "add_special_tokens": NaN}', "NaN", 38),
        ("/detokenize", '{"tokens": [1, NaN]}', "NaN", 15),
    ],
)
def test_nan_and_infinity_are_not_json(
    client: TestClient, route: str, body: str, literal: str, pos: int
) -> None:
    """Python's json reads NaN, Infinity and -Infinity; JSON has none: a 400 at the literal
    (guided_json's {"minimum": NaN} reached the control plane as null: 'Expected f64 for
    'minimum', got null')."""
    assert body[pos:].startswith(literal)
    err = _error(client.post(route, content=body, headers=JSON), 400)
    assert (
        err["message"] == f"the body is not valid JSON: {literal} is not a JSON value (char {pos})"
    )
    assert err["param"] is None


def test_nan_in_guided_json_text_is_not_json() -> None:
    req = CompletionRequest(model="m", prompt="x", guided_json='{"minimum": NaN}')
    with pytest.raises(APIError) as e:
        structured_output(req)
    assert e.value.message == (
        "guided_json is not valid JSON: NaN is not a JSON value: line 1 column 13 (char 12)"
    )
    assert e.value.param == "guided_json"
