"""Tokenizer (GGUF and HF folder), chat template, incremental detokenizer, stop strings."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.stop import StopChecker
from control_plane.tokenizer import TokenizerError, TokenizerWrapper, load_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "naïve café — “quotes” and ümlauts",
    "emoji 🤗🚀 and CJK 你好世界",
    "def f(x):\n    return x * x  # code",
]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_path)


def test_round_trip(tok: TokenizerWrapper) -> None:
    for text in [*TEXTS, "in 2024 there were 1,234,567 people"]:
        assert tok.decode(tok.encode(text)) == text


def test_matches_transformers_on_digit_free_text(
    tok: TokenizerWrapper, hf_smollm2_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        assert tok.encode(text) == hf_smollm2_tokenizer(text, add_special_tokens=False).input_ids, (
            text
        )


def test_digits_are_split_one_by_one(tok: TokenizerWrapper) -> None:
    ids = tok.encode("2024")
    assert len(ids) == 4
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_tokens_and_eos(tok: TokenizerWrapper) -> None:
    assert tok.encode("<|im_start|>user") == [1, *tok.encode("user")]
    assert tok.eos_token_ids == (2,)
    assert tok.decode([1, *tok.encode("hi"), 2], skip_special_tokens=True) == "hi"


def test_chat_template_is_chatml(tok: TokenizerWrapper) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert (
        with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_a_lone_surrogate_is_the_clients_error(tok: TokenizerWrapper) -> None:
    """A gRPC client's chat JSON (tools here) can spell a lone surrogate, which reaches
    the rendered prompt; tokenizers raised a TypeError there (INTERNAL, or UNKNOWN from
    Tokenize). It is a TokenizerError, so INVALID_ARGUMENT."""
    import grpc

    from control_plane.server import status_for

    tools = json.loads(
        '[{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]'
    )
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools)
    for text in (prompt, "a\udfffb"):
        with pytest.raises(TokenizerError, match="surrogate") as e:
            tok.encode(text)
        assert status_for(e.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_hf_folder_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        TEXTS * 20,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}",
            }
        )
    )
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("Hello 🤗")
    assert ids[0] == t.token_to_id("<s>")
    assert tok.decode(ids, skip_special_tokens=True) == "Hello 🤗"
    assert tok.eos_token_ids == (t.token_to_id("</s>"),)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x</s>"


def test_a_hf_folder_whose_tokenizer_files_cannot_be_read_is_named(tmp_path: Path) -> None:
    # Each was a traceback at control plane start-up (tokenizers' bare Exception, a
    # JSONDecodeError without the file's name).
    tj = tmp_path / "tokenizer.json"
    for text, message in [
        ("garbage", "not readable as JSON"),
        ("{}", "not a tokenizer the tokenizers library reads"),
        ("[]", "expected a JSON object"),
    ]:
        tj.write_text(text)
        with pytest.raises(ValueError, match=rf"{tj}: {message}"):
            load_tokenizer(tmp_path)


def _stream(tok: TokenizerWrapper, ids: list[int], skip: bool = True) -> list[str]:
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [*[d.push(i) for i in ids], d.flush()]


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_detokenizer_streams_exactly_the_decoded_text(tok: TokenizerWrapper, text: str) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == decoded
    if "\ufffd" not in decoded:
        assert all("\ufffd" not in p for p in pieces)  # never a broken character mid-stream


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 49151), max_size=30))
def test_detokenizer_on_arbitrary_ids(tok: TokenizerWrapper, ids: list[int]) -> None:
    assert "".join(_stream(tok, ids, skip=False)) == tok.decode(ids)


def test_detokenizer_holds_split_emoji(tok: TokenizerWrapper) -> None:
    ids = tok.encode("🤗")
    assert len(ids) > 1  # byte-level pieces of one character
    pieces = _stream(tok, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and "".join(pieces) == "🤗"


def _run_stops(chunks: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    checker = StopChecker(stops)
    out, matched = [], None
    for c in chunks:
        emit, m = checker.feed(c)
        out.append(emit)
        if m is not None:
            matched = m
            break
    if matched is None:
        out.append(checker.flush())
    return out, matched


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abc ", max_size=30),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_strings_property(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, matched = _run_stops(chunks, stops)
    # The stop string that completes first ends the text (the earlier start on a tie).
    ends = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    hits = [min(ends)[1]] if ends else []
    expected = text[: hits[0]] if hits else text
    assert "".join(out) == expected
    assert (matched is not None) == bool(hits)
    if hits:
        # Whatever was emitted before the match never contained the start of the stop string.
        assert matched is not None and text.find(matched) == min(hits)


def test_stop_cases() -> None:
    assert _run_stops(["Hel", "lo wo", "rld"], ["lo w"]) == (["He", "l"], "lo w")
    assert _run_stops(["abcdef"], ["cd", "bc"]) == (["a"], "bc")  # earliest match wins
    assert _run_stops(["STOP", "x"], ["STOP"]) == ([""], "STOP")
    assert _run_stops(["ab", "c"], ["abd"]) == (["", "abc", ""], None)


def test_stop_strings_are_not_searched_in_the_first_min_tokens() -> None:
    """vLLM's min_tokens: a stop string in the text of the first min_tokens tokens does not
    end the request; after them the search goes on as usual."""
    tokens = ["Yes", ".", " It", " is", ".", " Done", "."]

    def run(min_tokens: int) -> tuple[str, str | None]:
        checker, out = StopChecker(["."], min_tokens=min_tokens), ""
        for t in tokens:
            emit, matched = checker.feed_token(t)
            out += emit
            if matched is not None:
                return out, matched
        return out + checker.flush(), None

    assert run(0) == ("Yes", ".")
    assert run(2) == ("Yes. It is", ".")  # the "." of token 2 is inside min_tokens
    assert run(5) == ("Yes. It is. Done", ".")
    assert run(7) == ("Yes. It is. Done.", None)
