"""Bad text and chat input through the servicer's own Generate and Tokenize (no engine,
no gRPC server): refused with INVALID_ARGUMENT naming the problem, never an exception
that reaches the client as UNKNOWN with a trace; one too large to fit refused before it
is read."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from control_plane.chat_template import GEMMA3_TEMPLATE, ChatTemplateError, render_chat
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.server import BIG_INPUT_BYTES, ControlServicer
from control_plane.tokenizer import TokenizerWrapper, load_tokenizer
from hetero_proto import control_pb2 as pb
from tests.grpc_context import Aborted, Context

HI = [pb.ChatMessage(role="user", content="Hi")]
DEEP = "[" * 5000 + "]" * 5000  # deeper than Python's stack
MAX_MODEL_LEN = 64


def _call(arguments: str) -> str:
    return json.dumps(
        [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]
    )


def _engine(tok: TokenizerWrapper, scheduler: object) -> SimpleNamespace:
    """What the servicer reads of its engine, a compute plane attached."""

    async def prepare(params: pb.GenerationParams) -> None:
        pass

    return SimpleNamespace(
        tokenizer=tok, scheduler=scheduler, check_accepting=lambda: None, prepare=prepare
    )


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def servicer(tok: TokenizerWrapper) -> ControlServicer:
    return ControlServicer(_engine(tok, None), "m")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bounded(tok: TokenizerWrapper) -> ControlServicer:
    """A servicer whose compute plane has a context of MAX_MODEL_LEN tokens."""
    engine = _engine(tok, SimpleNamespace(max_model_len=MAX_MODEL_LEN))
    return ControlServicer(engine, "m")  # type: ignore[arg-type]


def _refusal(servicer: ControlServicer, rpc: str, given: dict[str, Any]) -> tuple[str, str]:
    """The status code's name and message with which Generate or Tokenize refuses it."""

    async def go() -> None:
        if rpc == "Generate":
            await anext(servicer.Generate(pb.GenerateRequest(**given), Context()))  # type: ignore[arg-type]
        else:
            await servicer.Tokenize(pb.TokenizeRequest(**given), Context())  # type: ignore[arg-type]

    with pytest.raises(Aborted) as e:
        asyncio.run(go())
    return e.value.code.name, e.value.details


@pytest.mark.parametrize("rpc", ["Generate", "Tokenize"])
@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"chat": pb.ChatInput(messages=HI, tools_json=DEEP)}, "tools_json is nested too deeply"),
        (
            {"chat": pb.ChatInput(messages=HI, template_kwargs_json='{"a": ' + DEEP + "}")},
            "chat_template_kwargs is nested too deeply",
        ),
        (
            {"chat": pb.ChatInput(messages=HI, documents_json=DEEP)},
            "documents is nested too deeply",
        ),
        (
            {
                "chat": pb.ChatInput(
                    messages=[*HI, pb.ChatMessage(role="assistant", tool_calls_json=DEEP)]
                )
            },
            "messages[1].tool_calls_json is nested too deeply",
        ),
        (
            {
                "chat": pb.ChatInput(
                    messages=[pb.ChatMessage(role="assistant", tool_calls_json=_call(DEEP))]
                )
            },
            "messages[0].tool_calls: arguments nested too deeply",
        ),
    ],
    ids=["tools", "template_kwargs", "documents", "tool_calls", "arguments"],
)
def test_json_nested_too_deeply_is_invalid_argument(
    servicer: ControlServicer, rpc: str, given: dict[str, Any], says: str
) -> None:
    assert _refusal(servicer, rpc, given) == ("INVALID_ARGUMENT", says)


def test_arguments_that_are_not_json_pass_as_sent(servicer: ControlServicer) -> None:
    msgs = [pb.ChatMessage(role="assistant", tool_calls_json=_call("{not json"))]
    ids = servicer._prompt_ids(pb.GenerateRequest(chat=pb.ChatInput(messages=msgs)))
    assert '"arguments": "{not json"' in servicer.tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("messages", "tools", "says"),
    [
        (
            [{"role": "assistant", "content": "", "tool_calls": json.loads(_call("1"))}],
            None,
            "tool call arguments",
        ),
        (
            [{"role": "user", "content": "Hi"}],
            [{"type": "function", "function": {"name": "f"}}],
            "tools",
        ),
    ],
)
def test_json_too_deep_to_write_in_the_tool_prompt_is_refused(
    tok: TokenizerWrapper,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    says: str,
) -> None:
    """Input that parsed can still be too deep to write from further down the stack (the
    tool prompt writes tools and calls as JSON): a ChatTemplateError, not a RecursionError."""
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    if tools is None:
        messages[0]["tool_calls"][0]["function"]["arguments"] = deep
    else:
        tools[0]["function"]["parameters"] = deep
    assert tok.chat_template is not None
    with pytest.raises(ChatTemplateError, match=f"^{says} nested too deeply$"):
        render_chat(tok.chat_template, messages, True, "", "", tools)


def _oversized(tok: TokenizerWrapper) -> dict[str, dict[str, Any]]:
    """An input just over the size bound, put in each field a text or chat has."""
    big = "x" * (MAX_MODEL_LEN * tok.max_token_bytes)
    msg = pb.ChatMessage
    chats = {
        "content": pb.ChatInput(messages=[msg(role="user", content=big)]),
        "role": pb.ChatInput(messages=[msg(role=big, content="Hi")]),
        "name": pb.ChatInput(messages=[msg(role="user", content="Hi", name=big)]),
        "tool_call_id": pb.ChatInput(messages=[msg(role="tool", content="1", tool_call_id=big)]),
        "tool_calls_json": pb.ChatInput(
            messages=[msg(role="assistant", tool_calls_json=_call(big))]
        ),
        "tools_json": pb.ChatInput(messages=HI, tools_json=json.dumps([{"x": big}])),
        "documents_json": pb.ChatInput(messages=HI, documents_json=json.dumps([{"x": big}])),
        "template_kwargs_json": pb.ChatInput(
            messages=HI, template_kwargs_json=json.dumps({"x": big})
        ),
    }
    return {"text": {"text": big + "x"}} | {k: {"chat": c} for k, c in chats.items()}


@pytest.mark.parametrize("rpc", ["Generate", "Tokenize"])
def test_an_input_over_the_size_bound_in_any_field_is_refused_unread(
    bounded: ControlServicer, tok: TokenizerWrapper, rpc: str
) -> None:
    """Every byte of a text or chat counts toward the bound (context length x the longest
    token's bytes), on Generate and Tokenize alike, before anything is parsed or
    tokenised: one refusal, the one a long prompt gets."""
    for field, given in _oversized(tok).items():
        code, message = _refusal(bounded, rpc, given)
        assert code == "INVALID_ARGUMENT", (field, message)
        kind = "prompt" if field == "text" else "chat"
        assert re.fullmatch(
            rf"the {kind} \(\d+ bytes\) is longer than the maximum context length of "
            rf"{MAX_MODEL_LEN} tokens",
            message,
        ), (field, message)


def test_a_text_at_the_size_bound_is_tokenised(
    bounded: ControlServicer, tok: TokenizerWrapper
) -> None:
    at_bound = pb.TokenizeRequest(text="x" * (MAX_MODEL_LEN * tok.max_token_bytes))
    reply = asyncio.run(bounded.Tokenize(at_bound, Context()))  # type: ignore[arg-type]
    assert reply.count > MAX_MODEL_LEN and reply.max_model_len == MAX_MODEL_LEN


def test_a_small_input_is_tokenised_while_big_ones_fill_their_lane(tok: TokenizerWrapper) -> None:
    """More big inputs than any default thread pool has workers are tokenising (held
    here): a small request is still tokenised at once, not queued behind them."""
    release = threading.Event()
    servicer = ControlServicer(_engine(tok, None), "m")  # type: ignore[arg-type]
    tokenise = servicer._prompt_ids

    def held(request: pb.TokenizeRequest, add_special_tokens: bool = True) -> list[int]:
        if len(request.text) > BIG_INPUT_BYTES:
            release.wait(30)
        return tokenise(request, add_special_tokens)

    servicer._prompt_ids = held  # type: ignore[method-assign]

    async def go() -> pb.TokenizeResponse:
        big = pb.TokenizeRequest(text="x" * (BIG_INPUT_BYTES + 1))
        bigs = [asyncio.create_task(servicer.Tokenize(big, Context())) for _ in range(40)]  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        try:
            small = servicer.Tokenize(pb.TokenizeRequest(text="Hi"), Context())  # type: ignore[arg-type]
            return await asyncio.wait_for(small, 10)
        finally:
            release.set()
            await asyncio.gather(*bigs)

    assert asyncio.run(go()).token_ids == tok.encode("Hi")


def test_generate_without_a_compute_plane_is_refused_before_tokenising(
    tok: TokenizerWrapper, smollm2_path: Path
) -> None:
    """No compute plane attached: Generate is UNAVAILABLE at once, not after seconds of
    tokenising a prompt that could only be refused (Tokenize still works)."""
    engine = ControlEngine(ControlConfig(model=str(smollm2_path), metrics_port=-1), tok)
    servicer = ControlServicer(engine, "m")
    tokenised = []
    tokenise = servicer._prompt_ids

    def counted(request: pb.GenerateRequest, add_special_tokens: bool = True) -> list[int]:
        tokenised.append(request.WhichOneof("input"))
        return tokenise(request, add_special_tokens)

    servicer._prompt_ids = counted  # type: ignore[method-assign]
    refused = _refusal(servicer, "Generate", {"text": "x" * 1_000_000})
    assert refused == ("UNAVAILABLE", "no compute plane is attached") and tokenised == []
    reply = asyncio.run(servicer.Tokenize(pb.TokenizeRequest(text="Hi"), Context()))  # type: ignore[arg-type]
    assert reply.token_ids == tok.encode("Hi") and tokenised == ["text"]


GEMMA3 = GEMMA3_TEMPLATE.read_text()


def _turn(role: str) -> dict[str, str]:
    return {"role": role, "content": role[0]}


@pytest.mark.parametrize(
    ("roles", "tools", "says"),
    [
        (["user", "user"], None, "messages[1]: the chat template refuses it: Conversation roles"),
        (["system", "user", "assistant", "assistant"], None, "messages[3]: "),
        (["assistant"], None, "messages[0]: "),
        # The tool prompt's system message, put first, is not the client's message 0.
        (["user", "user"], [{"type": "function", "function": {"name": "f"}}], "messages[1]: "),
    ],
)
def test_a_template_refusal_names_the_message_it_was_on(
    roles: list[str], tools: list[dict[str, Any]] | None, says: str
) -> None:
    """Gemma 3's template raises when roles do not alternate: the error names the message
    its loop was on (the gateway's param messages.N; was no param at all)."""
    with pytest.raises(ChatTemplateError) as e:
        render_chat(GEMMA3, [_turn(r) for r in roles], True, "<bos>", "<eos>", tools)
    assert str(e.value).startswith(says), e.value


def test_a_template_refusal_outside_its_loop_names_the_chat() -> None:
    template = "{% for m in messages %}{% endfor %}{{ raise_exception('no user turn') }}"
    with pytest.raises(ChatTemplateError) as e:
        render_chat(template, [_turn("user"), _turn("user")], True, "", "")
    assert str(e.value) == "the chat template refuses the chat: no user turn"


def test_a_developer_message_is_the_system_message_for_every_client() -> None:
    # The gateway read OpenAI's developer role as system; a gRPC client's or
    # OfflineLLM.chat's reached the template as "developer": SmolLM2's rendered its
    # default system prompt and then a '<|im_start|>developer' turn, Gemma 3's refused the
    # chat ('Conversation roles must alternate').
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    chat = [{"role": "developer", "content": "Be brief."}, _turn("user")]
    as_system = [{"role": "system", "content": "Be brief."}, _turn("user")]
    assert render_chat(template, chat, False, "", "") == render_chat(
        template, as_system, False, "", ""
    )
    assert render_chat(template, chat, False, "", "").startswith("[system:Be brief.]")
    gemma = render_chat(GEMMA3, chat, True, "<bos>", "<eos>")
    assert gemma == "<bos><start_of_turn>user\nBe brief.\n\nu<end_of_turn>\n<start_of_turn>model\n"


def test_an_empty_role_is_refused_by_name() -> None:
    # The gateway refused it (role min_length 1); a gRPC client's or OfflineLLM.chat's
    # rendered a turn of no role.
    with pytest.raises(ChatTemplateError) as e:
        render_chat("{{ messages }}", [_turn("user"), {"role": "", "content": "x"}], True, "", "")
    assert str(e.value) == "messages[1].role must not be empty"


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_a_message_without_the_content_its_role_needs_is_refused_by_name(role: str) -> None:
    # The gateway answered 400 (OpenAI refuses it); OfflineLLM.chat rendered an empty turn.
    for missing in ({"role": role}, {"role": role, "content": None}):
        with pytest.raises(ChatTemplateError) as e:
            render_chat("{{ messages }}", [_turn("user"), missing], True, "", "")
        assert (
            str(e.value) == f"messages[1]: a {role} message needs content (a string or text parts)"
        )
    # An assistant turn may be tool calls alone, and a role of the template's its own.
    for role_ in ("assistant", "ipython"):
        assert (
            render_chat("{{ messages[1].content }}", [_turn("user"), {"role": role_}], True, "", "")
            == ""
        )
