"""Render a model's jinja2 chat template the way Hugging Face transformers does."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hetero_common.limits import CONTENT_REQUIRED

# Gemma 3's text template (system text folded into the first user turn, `model` role,
# `<start_of_turn>`/`<end_of_turn>`), for a Gemma 3 GGUF that carries none (the bundled
# `--model gemma3` file does not; every Gemma 3 model's HF tokenizer has this one).
# Transcribed by hand (no hub access here) and checked against the copies of its
# `chat_template` quoted in public code (the Berkeley function-calling leaderboard's Gemma
# handler, onnxruntime-extensions' `GEMMA3_CHAT_TEMPLATE`): the same text but for how a
# newline inside a string literal is written, and the same rendering of every
# conversation tried; tests/control/test_chat_template_parity.py renders it as
# transformers does.
GEMMA3_TEMPLATE = Path(__file__).parent / "chat_templates" / "gemma3.jinja"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or the template raised)."""


class _TemplateRaised(ChatTemplateError):
    """The template's own raise_exception("..."), with the objects its code had in hand."""

    def __init__(self, message: str, in_hand: list[dict[Any, Any]]) -> None:
        super().__init__(message)
        self.in_hand = in_hand


def _raise(message: str) -> None:
    """The template's raise_exception. Its locals (jinja2 compiles a template to Python:
    the message a `{% for %}` is on is a local of the template's frame) tell which message
    it refused, for `render_chat` to name."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != "<template>":
        frame = frame.f_back
    in_hand = [] if frame is None else [v for v in frame.f_locals.values() if isinstance(v, dict)]
    raise _TemplateRaised(message, in_hand)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: json.dumps with its arguments (not jinja2's HTML-safe one)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def read_chat_template(path: str) -> str:
    """The file --chat-template names, checked to compile at start-up: a ValueError naming
    the flag for a file that cannot be read or is not a jinja2 template (else every chat
    request would fail with a 400 that blames the client for the operator's file)."""
    try:
        source = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it: {e}") from None
    try:
        _compile(source)
    except ChatTemplateError as e:
        raise ValueError(f"--chat-template {path}: {e}") from None
    return source


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content may be a string or a list of {"type": "text", "text": ...} parts; other keys
    (name, tool_calls, tool_call_id) pass through as the template expects them. A
    developer message is the system message templates know (as the gateway read it). A
    system, developer, user or tool message without content (left out, or None) is
    refused, as the gateway refuses it."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(
                f"messages[{i}] must be a message dict (role, content), got {type(m).__name__}"
            )
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ChatTemplateError(f"messages[{i}].role must be a string")
        if not role:
            raise ChatTemplateError(f"messages[{i}].role must not be empty")
        if role == "developer":  # (OpenAI's name for the system prompt of newer models)
            role = "system"
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise ChatTemplateError(f"messages[{i}].content: only text parts are supported")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is None:
            if m.get("role") in CONTENT_REQUIRED:  # (a ChatInput's is "" at worst)
                raise ChatTemplateError(
                    f"messages[{i}]: a {m['role']} message needs content (a string or text parts)"
                )
            content = ""
        elif not isinstance(content, str):
            raise ChatTemplateError(
                f"messages[{i}].content must be a string or a list of text parts"
            )
        msg = {k: v for k, v in m.items() if v not in (None, "", [])}
        msg.update(role=role, content=content)
        out.append(msg)
    return out


def check_tools(tools: list[Any]) -> None:
    """Each tool is OpenAI's shape, as templates and the tool prompt read it:
    {"type": "function", "function": {"name": <string>, ...}}."""
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (
            isinstance(fn, dict) and t.get("type") == "function" and isinstance(fn.get("name"), str)
        ):
            raise ChatTemplateError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": <string>}}}}'
            )


def uses_tools(template: str) -> bool:
    """Whether a chat template renders the `tools` it is given."""
    return "tools" in template


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    tools: list[dict[str, Any]] | None = None,
    *,
    continue_final_message: bool = False,
    special_tokens: dict[str, str] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> str:
    """As transformers' apply_chat_template(tokenize=False): `special_tokens` (the
    tokenizer's special_tokens_map) and `kwargs` (chat_template_kwargs) are template
    variables too; `continue_final_message` cuts the text after the last message's
    content, leaving that turn open."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt are exclusive")
    msgs = normalise_messages(messages)
    check_tools(tools or [])
    if tools and not uses_tools(template):
        msgs = with_tool_prompt(msgs, tools)
    elif not uses_tools(template):
        msgs = [_calls_as_text(m) for m in msgs]
    added = len(msgs) - len(messages)  # (the tool prompt's system message, first)
    variables: dict[str, Any] = {**(special_tokens or {}), **(kwargs or {})}
    variables.update(
        messages=msgs,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        tools=tools or None,
    )
    try:
        text = _compile(template).render(**variables)
    except _TemplateRaised as e:
        on = {k for k, m in enumerate(msgs) if any(m is x for x in e.in_hand)}
        if len(on) == 1 and (i := on.pop() - added) >= 0:
            raise ChatTemplateError(f"messages[{i}]: the chat template refuses it: {e}") from e
        raise ChatTemplateError(f"the chat template refuses the chat: {e}") from e
    except ChatTemplateError:
        raise
    except Exception as e:  # a template may raise anything: the request's fault, a 400
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    if continue_final_message:
        final = msgs[-1]["content"] if msgs else ""
        for piece in (final, final.strip()):
            if piece and (at := text.rfind(piece)) >= 0:
                return text[: at + len(piece)]
        raise ChatTemplateError(
            "continue_final_message: the final message's content is not in the rendered chat"
        )
    return text


# The bundled model's (SmolLM2-Instruct's) tool-use system prompt, from its model card:
# tools in <tools>, calls as a JSON list in <tool_call>. Used for any template that
# does not render `tools` itself.
TOOL_PROMPT = """You are an expert in composing functions. You are given a question and a set of \
possible functions. Based on the question, you will need to make one or more function/tool \
calls to achieve the purpose. If none of the functions can be used, point it out and refuse \
to answer. If the given question lacks the parameters required by the function, also point \
it out.

You have access to the following tools:
<tools>{tools}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no \
function call is needed, please make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The tools in a system message (before the caller's system text, if any)."""
    functions = [t["function"] for t in tools]
    prompt = TOOL_PROMPT.format(tools=_dumps(functions, "tools"))
    msgs = [_calls_as_text(m) for m in messages]
    if msgs and msgs[0]["role"] == "system":
        first = dict(msgs[0], content=prompt + "\n\n" + msgs[0]["content"])
        return [first, *msgs[1:]]
    return [{"role": "system", "content": prompt}, *msgs]


def _calls_as_text(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool calls as the text the tool prompt asks for."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    listed = [
        {"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})}
        for c in calls
    ]
    text = "<tool_call>" + _dumps(listed, "tool call arguments") + "</tool_call>"
    return {**m, "content": (m.get("content") or "") + text}


def _dumps(value: Any, what: str) -> str:
    """The request's `what` as JSON text. JSON that parsed can still be too deep to write
    from further down the stack: the request's fault, not ours."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise ChatTemplateError(f"{what} nested too deeply") from None
