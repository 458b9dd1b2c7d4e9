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


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Content may be a string or a list of {"type": "text", "text": ...} parts."""
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
        out.append({"role": role, "content": content})
    return out


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
) -> str:
    try:
        return _compile(template).render(
            messages=normalise_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
