"""Tool-call parsing (Hermes / Qwen, the bundled SmolLM2's list, Llama 3 JSON), the
streamed parser against the one-shot one, and the checks on tools and tool_choice."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import tool_calls
from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest

NAMES = {"get_weather", "add"}


def _fn(calls: list[dict]) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (  # Hermes / Qwen: one object per block, several blocks
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            "Let me check.\n",  # (as it streams: the text before the block, as is)
            [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
        ),
        (  # SmolLM2: a list in one block
            '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>',
            None,
            [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})],
        ),
        (  # Llama 3 JSON, with "parameters"
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
            None,
            [("get_weather", {"city": "Rome"})],
        ),
        ('{"name": "unknown_fn", "arguments": {}}', '{"name": "unknown_fn", "arguments": {}}', []),
        ("<tool_call>[{not json}]</tool_call>", "<tool_call>[{not json}]</tool_call>", []),
        # arguments that are not an object are no call (OpenAI's are a JSON object)
        (
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            [],
        ),
        ('{"name": "add", "arguments": 5}', '{"name": "add", "arguments": 5}', []),
        # whitespace alone before the block is no content
        ('\n <tool_call>{"name": "add", "arguments": {}}</tool_call>', None, [("add", {})]),
        ("The weather is fine.", "The weather is fine.", []),
    ],
)
def test_parse(text: str, content: str | None, calls: list) -> None:  # type: ignore[type-arg]
    got_content, got_calls = tool_calls.parse(text, NAMES)
    assert got_content == content
    assert _fn(got_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


TEXTS = [
    'Sure. <tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>',
    '\nSure!\n <tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>',
    ' \n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    '\n<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '{"name": "add", "arguments": {"a": 3, "b": 4}}',
    "No tool is needed: 2 + 2 = 4. <tool_ca is not a tag",
    "  plain text with <| odd <tool markers",
]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_streamed_parse_equals_one_shot(text: str, cuts: list[int]) -> None:
    pieces, at = [], 0
    for n in cuts:
        pieces.append(text[at : at + n])
        at += n
    pieces.append(text[at:])
    stream = tool_calls.ToolStream(NAMES)
    content = "".join(stream.feed(p) for p in pieces) + stream.finish()
    one_content, one_calls = tool_calls.parse(text, NAMES)
    assert _fn(stream.calls) == _fn(one_calls)
    assert content == (one_content or "")  # whitespace too: streamed joins to the whole
    if not one_calls:
        assert content == text  # text that is no call streams out whole, unchanged


def _body(**kw: object) -> ChatCompletionRequest:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, **kw}
    )


CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ("", []),
        ("<tool_c", []),
        ('<tool_call>[{"name": "', []),
        ('<tool_call>[{"name": "a', [("add", "")]),  # the one name it can be
        ('<tool_call>[{"name": "get_weather", "argu', [("get_weather", "")]),
        ('<tool_call>[{"name": "get_weather", "arguments": {"ci', [("get_weather", '{"ci')]),
        (CALL, [("get_weather", '{"city": "Paris"}')]),
        (
            CALL + '{"name": "add", "arguments": {"a": 1',
            [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1')],
        ),
        (CALL[:-2] + "]</tool", [("get_weather", '{"city": "Paris"}')]),  # cut in its end tag
    ],
)
def test_a_forced_call_cut_short_keeps_what_was_written(text: str, calls: list) -> None:  # type: ignore[type-arg]
    got = tool_calls.cut_calls(text, NAMES)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
    first = tool_calls.cut_calls(text, NAMES, parallel=False)
    assert [c["function"] for c in first] == [c["function"] for c in got[:1]]
    stream = tool_calls.ToolStream(NAMES, forced=True)
    for k in range(0, len(text), 5):  # streamed: no content, the same calls
        assert stream.feed(text[k : k + 5]) == ""
    assert stream.finish() == ""
    assert [c["function"] for c in stream.calls] == [c["function"] for c in got]


def test_checks_refuse_unknown_named_function_and_choice_without_tools() -> None:
    with pytest.raises(APIError, match="not among the tools"):
        tool_calls.check(_body(tool_choice={"type": "function", "function": {"name": "nope"}}))
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}
    )
    with pytest.raises(APIError, match="no tools"):
        tool_calls.check(body)
    tool_calls.check(_body(tool_choice="required"))
    assert tool_calls.forced(_body(tool_choice="auto")) is None
    assert tool_calls.active(_body(tool_choice="auto"))
    assert not tool_calls.active(_body(tool_choice="none"))


def test_forced_grammar_compiles_and_accepts_a_call(smollm2_path) -> None:  # type: ignore[no-untyped-def]
    from control_plane.grammar import Grammars
    from control_plane.tokenizer import load_tokenizer
    from hetero_proto import control_pb2 as pb

    tok = load_tokenizer(smollm2_path)
    grammars = Grammars(tok)
    body = _body(tool_choice="required")
    spec = pb.StructuredOutput(grammar=tool_calls.grammar(tool_calls.forced(body) or [], True))
    state = grammars.start(spec)
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    for t in tok.encode(text, add_special_tokens=False):
        assert not state.dead
        grammars.advance([(state, t)])
    assert state.complete and not state.dead
    _, calls = tool_calls.parse(text, {"get_weather"})
    assert _fn(calls) == [("get_weather", {"city": "Paris"})]


def test_a_forced_call_follows_the_schemas_own_refs(smollm2_path) -> None:  # type: ignore[no-untyped-def]
    """Parameters with $defs and "#/$defs/..." refs (as pydantic writes a model's schema):
    the refs resolve in the tool's schema, not in the call schema around it. They failed
    to compile in the control plane ("Pointer '/$defs/Point' does not exist", quoting the
    whole grammar)."""
    from control_plane.grammar import Grammars
    from control_plane.tokenizer import load_tokenizer
    from hetero_proto import control_pb2 as pb

    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    params = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Point"}},
        "required": ["at"],
        "$defs": {"Point": point},
    }
    tools = [
        {"type": "function", "function": {"name": name, "parameters": params}}
        for name in ("move", "jump")
    ]
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
         "tool_choice": "required"}
    )  # fmt: skip
    tool_calls.check(body)
    tok = load_tokenizer(smollm2_path)
    grammars = Grammars(tok)
    spec = pb.StructuredOutput(grammar=tool_calls.grammar(tool_calls.forced(body) or [], True))
    good = '<tool_call>[{"name": "jump", "arguments": {"at": {"x": 3}}}]</tool_call>'
    bad = '<tool_call>[{"name": "jump", "arguments": {"at": {"x": "3"'
    for text, ok in ((good, True), (bad, False)):
        state = grammars.start(spec)
        for t in tok.encode(text, add_special_tokens=False):
            grammars.advance([(state, t)])
        assert state.dead != ok and state.complete == ok, text


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
        {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
    ],
    ids=["unimplemented", "dangling-ref"],
)
def test_a_forced_call_to_a_schema_that_does_not_compile_is_a_400_naming_the_tool(
    parameters: dict[str, object],
) -> None:
    """(The control plane's grammar error named no field and quoted the whole grammar.)
    Valid JSON Schema that llguidance does not implement is refused only where it must
    constrain the call."""
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "broken", "parameters": parameters}},
    ]

    def body(choice: object) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
             "tool_choice": choice}
        )  # fmt: skip

    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        with pytest.raises(APIError) as e:
            tool_calls.check(body(choice))
        assert e.value.param == "tools.1.function.parameters", e.value.param
        assert e.value.message.startswith("tools.1.function.parameters: function 'broken'")
        assert "start:" not in e.value.message and len(e.value.message) < 500
    for choice in ({"type": "function", "function": {"name": "ok"}}, "auto", "none"):
        tool_calls.check(body(choice))
    tool_calls.grammar(
        tool_calls.forced(body({"type": "function", "function": {"name": "ok"}})) or [], False
    )


def test_a_forced_schema_too_deep_to_compile_names_no_position_in_json_we_wrote() -> None:
    """serde's "at line 1 column 2451" pointed into the call schema the gateway builds
    around the tool's parameters, which the client never sent."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(70):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
         "tool_choice": "required"}
    )  # fmt: skip
    with pytest.raises(APIError) as e:
        tool_calls.check(body)
    assert e.value.param == "tools.0.function.parameters"
    assert "nested too deeply" in e.value.message and "column" not in e.value.message


AUTO_CUT = [
    (  # Hermes / Qwen: text, then a block cut inside its arguments
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "Let me check. ",
        [("get_weather", '{"city": "Par')],
    ),
    (  # a whole block, then one cut
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"ci',
        None,
        [("add", '{"a": 1}'), ("get_weather", '{"ci')],
    ),
    (  # SmolLM2's list, cut in the second call's name: not known yet, so no second call
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_wea',
        None,
        [("add", '{"a": 1, "b": 2}')],
    ),
    ('<tool_call>\n{"name": "add", "arguments": {}}\n</tool', None, [("add", "{}")]),
    ('<tool_call>[{"name": "add", "argu', None, [("add", "")]),
    ('Hmm. <tool_call>{"na', "Hmm. ", []),  # the call's markup is no content
    ("\n<tool_call>", None, []),
    (  # Llama 3 JSON, its name whole
        '{"name": "get_weather", "parameters": {"city": "Ro',
        None,
        [("get_weather", '{"city": "Ro')],
    ),
]
# Cut texts that are no call: they stay content, as parse leaves them.
AUTO_NOT_CALLS = [
    "The weather in Paris is",
    "Let me see <tool_ca",
    '{"answer": 4',
    '{"name": "get_wea',  # (bare JSON: nothing says it is a call before its name is whole)
    '{"name": "unknown_fn", "arguments": {"a',
    '<tool_call>{"name": "unknown_fn", "arguments": {',
    "<tool_call>hello there",
    '<tool_call>{"name": "add", "arguments": {}}</tool_call> and th',
    '<tool_call>{"name": "add", "arguments": {}} {"name": "add"',
]


@pytest.mark.parametrize(("text", "content", "calls"), AUTO_CUT)
def test_an_auto_call_cut_short_is_its_calls_so_far(
    text: str,
    content: str | None,
    calls: list,  # type: ignore[type-arg]
) -> None:
    """tool_choice auto, the choice ended by max_tokens or a stop string inside a call: as a
    forced call, the calls written so far, the last one's arguments as far as they got
    (OpenAI's truncated call), the markup never content; the text before it is content."""
    assert tool_calls.parse(text, NAMES)[1] == []  # (no whole call)
    found = tool_calls.cut_auto(text, NAMES)
    assert found is not None
    got_content, got = found
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
    one = tool_calls.cut_auto(text, NAMES, parallel=False)
    assert one is not None and [c["function"] for c in one[1]] == [c["function"] for c in got[:1]]
    for cut in range(1, 8):  # streamed in pieces: the same content and calls
        stream = tool_calls.ToolStream(NAMES)
        pieces = [text[k : k + cut] for k in range(0, len(text), cut)]
        streamed = "".join(stream.feed(p) for p in pieces) + stream.finish(cut=True)
        assert streamed == (content or "")
        assert [c["function"] for c in stream.calls] == [c["function"] for c in got]
        assert stream.cut


@pytest.mark.parametrize("text", AUTO_NOT_CALLS)
def test_an_auto_text_cut_short_that_is_no_call_stays_content(text: str) -> None:
    assert tool_calls.cut_auto(text, NAMES) is None
    stream = tool_calls.ToolStream(NAMES)
    streamed = "".join(stream.feed(text[k : k + 3]) for k in range(0, len(text), 3))
    assert streamed + stream.finish(cut=True) == text and stream.calls == []


def test_only_max_tokens_or_a_stop_string_cut_a_call_short() -> None:
    """EOS or a stop token is the model ending its turn: a call it left unfinished is text."""
    from hetero_proto import control_pb2 as pb

    assert tool_calls.cut_short(pb.FINISH_REASON_LENGTH, None)
    assert tool_calls.cut_short(pb.FINISH_REASON_STOP, "\n\n")
    assert not tool_calls.cut_short(pb.FINISH_REASON_STOP, 2)
    assert not tool_calls.cut_short(pb.FINISH_REASON_STOP, None)
    text = AUTO_CUT[0][0]
    stream = tool_calls.ToolStream(NAMES)
    assert stream.feed(text) + stream.finish(cut=False) == text and stream.calls == []
