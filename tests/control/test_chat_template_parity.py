"""Our chat-template rendering against transformers' apply_chat_template, byte for byte,
on real templates (tests/data/chat_templates): messages, system prompts, tools, assistant
tool calls and tool results, continue_final_message, template kwargs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models

from control_plane.chat_template import GEMMA3_TEMPLATE, ChatTemplateError, render_chat

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"


def _template(name: str) -> str:
    """A template of tests/data/chat_templates, or Gemma 3's, which the control plane
    carries (the Gemma 3 GGUF has none)."""
    return (
        GEMMA3_TEMPLATE.read_text()
        if name == GEMMA3_TEMPLATE.name
        else (TEMPLATES / name).read_text()
    )


# (file, bos, eos, renders tools)
CASES = [
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", True),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", True),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>", True),
    ("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>", True),
    ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "<|im_start|>", "<|im_end|>", False),
    (GEMMA3_TEMPLATE.name, "<bos>", "<eos>", False),
    ("google-gemma-2-2b-it.jinja", "<bos>", "<eos>", False),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
}
CHATS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!  "},
    ],
    "multi": [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": 'Another, with "quotes" and ünïcode.'},
    ],
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def _hf(template: str, bos: str, eos: str):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    kw = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, **kw, chat_template=template
    )


def _both(
    name: str, bos: str, eos: str, messages: list[dict[str, Any]], **kw: Any
) -> tuple[str, str]:
    template = _template(name)
    hf = _hf(template, bos, eos)
    tools = kw.pop("tools", None)
    ours = render_chat(
        template,
        messages,
        kw.get("add_generation_prompt", False),
        bos,
        eos,
        tools,
        continue_final_message=kw.get("continue_final_message", False),
        special_tokens={k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v},
        kwargs=kw.get("kwargs"),
    )
    theirs = hf.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=kw.get("add_generation_prompt", False),
        continue_final_message=kw.get("continue_final_message", False),
        **(kw.get("kwargs") or {}),
    )
    return ours, theirs


@pytest.mark.parametrize(("name", "bos", "eos", "tools"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("agp", [True, False])
def test_messages_render_as_transformers(
    name: str, bos: str, eos: str, tools: bool, chat: str, agp: bool
) -> None:
    if "gemma-2" in name and chat == "system":
        pytest.skip("Gemma 2's template refuses a system message (both raise)")
    ours, theirs = _both(name, bos, eos, CHATS[chat], add_generation_prompt=agp)
    assert ours == theirs


@pytest.mark.parametrize(
    ("name", "bos", "eos"), [c[:3] for c in CASES if c[3]], ids=[c[0] for c in CASES if c[3]]
)
def test_tools_calls_and_results_render_as_transformers(name: str, bos: str, eos: str) -> None:
    ours, theirs = _both(name, bos, eos, TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    assert ours == theirs
    assert "get_weather" in ours and "21" in ours


@pytest.mark.parametrize(("name", "bos", "eos", "tools"), CASES, ids=[c[0] for c in CASES])
def test_continue_final_message_renders_as_transformers(
    name: str, bos: str, eos: str, tools: bool
) -> None:
    msgs = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "My favourite color is"},
    ]
    ours, theirs = _both(name, bos, eos, msgs, continue_final_message=True)
    assert ours == theirs and ours.endswith("My favourite color is")


def test_template_kwargs_reach_the_template() -> None:
    name = "Qwen-Qwen3-0.6B.jinja"
    ours, theirs = _both(
        name,
        "",
        "<|im_end|>",
        CHATS["user"],
        add_generation_prompt=True,
        kwargs={"enable_thinking": False},
    )
    assert ours == theirs and "<think>\n\n</think>" in ours


def test_loopcontrols_tojson_arguments_and_errors() -> None:
    t = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m | tojson(indent=1, sort_keys=True, separators=(',', ':')) }}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "ü"}]
    ours = render_chat(t, msgs, False, "", "")
    theirs = _hf(t, "", "</s>").apply_chat_template(msgs, tokenize=False)
    assert ours == theirs
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat(
            GEMMA3_TEMPLATE.read_text(),
            [{"role": "assistant", "content": "x"}],
            False,
            "<bos>",
            "<eos>",
        )
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", msgs, False, "", "")
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        render_chat("{{ 1 // 0 }}", msgs, False, "", "")


def test_documents_and_custom_roles_render_as_transformers() -> None:
    t = (
        "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    docs = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    msgs = [{"role": "ipython", "content": "x"}, {"role": "user", "content": "y"}]
    ours = render_chat(t, msgs, False, "", "", kwargs={"documents": docs})
    theirs = _hf(t, "", "</s>").apply_chat_template(msgs, documents=docs, tokenize=False)
    assert ours == theirs and "[B] beta" in ours and "<ipython>x" in ours


@pytest.mark.parametrize(
    "name", ["Qwen-Qwen2.5-7B-Instruct.jinja", "HuggingFaceTB-SmolLM2-135M-Instruct.jinja"]
)  # a template that renders tools, and one that gets them in the tool prompt
@pytest.mark.parametrize(
    ("tools", "index"),
    [
        ([1], 0),
        ([{"function": 5}], 0),
        ([{"function": {"name": "f"}}], 0),  # no "type"
        ([{"type": "retrieval", "function": {"name": "f"}}], 0),
        ([{"type": "function", "function": {"name": 5}}], 0),
        ([TOOLS[0], {"type": "function"}], 1),
    ],
)
def test_a_tool_not_of_openais_shape_is_refused(name: str, tools: list[Any], index: int) -> None:
    with pytest.raises(ChatTemplateError, match=rf"tools\[{index}\] must be"):
        render_chat(_template(name), CHATS["user"], True, "", "", tools)
