"""`Tokenize`'s `add_special_tokens` on Gemma 3, a tokenizer that adds a BOS, against
transformers' own tokenizer from the same GGUF (its BOS rule, its tokenisation and its
rendering of the template are independent of ours; the GGUF carries no template, so both
render Gemma 3's, control_plane/chat_templates/gemma3.jinja). vLLM's /tokenize renders a chat with the template and then
tokenises that text with the request's `add_special_tokens` (false by default: "special
tokens (e.g. BOS) will be added to the prompt on top of what is added by the chat
template"), so a true flag on a template that writes `<bos>` gives two; Generate's chat
never adds one."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from control_plane.chat_template import GEMMA3_TEMPLATE
from control_plane.server import ControlServicer
from control_plane.tokenizer import load_tokenizer
from hetero_common.model_path import GEMMA3_DISTRIBUTION, gemma3_gguf
from hetero_proto import control_pb2 as pb
from tests.conftest import installed

pytestmark = [
    pytest.mark.slow,  # transformers parses Gemma 3's 262k-token GGUF vocabulary (~20 s)
    pytest.mark.skipif(
        not installed(GEMMA3_DISTRIBUTION), reason=f"needs the {GEMMA3_DISTRIBUTION} package"
    ),
]

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def hf_tok(gguf_parsed_once: None) -> Any:
    from transformers import AutoTokenizer

    gguf = gemma3_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.chat_template = GEMMA3_TEMPLATE.read_text()
    return tok


@pytest.fixture(scope="module")
def servicer() -> ControlServicer:
    tok = load_tokenizer(gemma3_gguf())
    engine = SimpleNamespace(tokenizer=tok, scheduler=None)
    return ControlServicer(engine, "gemma")  # type: ignore[arg-type]


def _chat() -> pb.ChatInput:
    return pb.ChatInput(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES],
        add_generation_prompt=True,
    )


def _tokenize(servicer: ControlServicer, **given: Any) -> list[int]:
    reply = asyncio.run(servicer.Tokenize(pb.TokenizeRequest(**given), None))  # type: ignore[arg-type]
    assert reply.count == len(reply.token_ids)
    return list(reply.token_ids)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_chat_tokenize_adds_the_bos_on_top_of_the_template_when_asked(
    servicer: ControlServicer, hf_tok: Any, add_special_tokens: bool
) -> None:
    text = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith(hf_tok.bos_token)  # Gemma 3's template writes its own BOS
    expected = hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    bos = hf_tok.bos_token_id
    leading = len(expected) - len(list(itertools.dropwhile(lambda t: t == bos, expected)))
    assert leading == (2 if add_special_tokens else 1)  # vLLM's: one on top of the template's
    got = _tokenize(servicer, chat=_chat(), add_special_tokens=add_special_tokens)
    assert got == expected


def test_generate_chat_never_adds_a_bos_to_the_template(
    servicer: ControlServicer, hf_tok: Any
) -> None:
    """What transformers' apply_chat_template tokenises (it adds no special tokens to a
    rendered chat), the one BOS the template writes."""
    expected = hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert servicer._prompt_ids(pb.GenerateRequest(chat=_chat())) == list(expected)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_text_tokenize_follows_the_flag(
    servicer: ControlServicer, hf_tok: Any, add_special_tokens: bool
) -> None:
    text = "The capital of France is"
    expected = hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert _tokenize(servicer, text=text, add_special_tokens=add_special_tokens) == expected
    generate = servicer._prompt_ids(pb.GenerateRequest(text=text))
    assert generate == hf_tok(text)["input_ids"]  # Generate's text always gets its BOS
