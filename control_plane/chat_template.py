"""Render a model's jinja2 chat template the way Hugging Face transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or the template raised)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content may be a string or a list of {"type": "text", "text": ...} parts; other keys
    (name, tool_calls, tool_call_id) pass through as the template expects them."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ChatTemplateError(f"messages[{i}].role must be a string")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise ChatTemplateError(f"messages[{i}].content: only text parts are supported")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ChatTemplateError(
                f"messages[{i}].content must be a string or a list of text parts"
            )
        msg = {k: v for k, v in m.items() if v not in (None, "", [])}
        msg.update(role=role, content=content)
        out.append(msg)
    return out


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
) -> str:
    msgs = normalise_messages(messages)
    if tools and not uses_tools(template):
        msgs = with_tool_prompt(msgs, tools)
    elif not uses_tools(template):
        msgs = [_calls_as_text(m) for m in msgs]
    try:
        return _compile(template).render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools or None,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


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
    functions = [t.get("function", t) for t in tools]
    prompt = TOOL_PROMPT.format(tools=json.dumps(functions, ensure_ascii=False))
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
    text = "<tool_call>" + json.dumps(listed, ensure_ascii=False) + "</tool_call>"
    return {**m, "content": (m.get("content") or "") + text}
