"""Tool calling on /v1/chat/completions: checks, the grammar of a forced call, and the
parser that turns the model's tool-call text into OpenAI `tool_calls`.

Formats parsed (whichever the model writes):
- `<tool_call>...</tool_call>` blocks (Hermes / Qwen 2.5-3: one JSON object per block;
  the bundled SmolLM2: a JSON list of calls in one block);
- Llama 3 JSON: the whole answer is `{"name": ..., "parameters"|"arguments": {...}}`,
  maybe after `<|python_tag|>`.

`tool_choice` "required" or a named function constrains the output with a grammar
(structured output) so every call parses and its arguments validate against the
function's parameters schema: `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import llguidance

from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, NamedToolChoice, Tool
from hetero_common.grammar_errors import readable
from hetero_proto import control_pb2 as pb

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# As control_plane.grammar.JSON_OPTIONS: compact JSON, no free whitespace.
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check(body: ChatCompletionRequest) -> None:
    """OpenAI's rules: tool_choice needs tools; a named function must be one of them.
    (Each tool's parameters are a valid object schema: the body's validation checks it.)
    A function tool_choice forces a call to (required: any) must have parameters that
    llguidance compiles: its error names the tool, where the grammar's own would quote the
    whole generated grammar and blame no field."""
    choice = body.tool_choice
    if choice is not None and choice != "none" and not body.tools:
        raise APIError(400, "tool_choice is set but no tools are given", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in body.tools or ()]
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(names)})",
                param="tool_choice",
            )
    seen: set[str] = set()
    for i, t in enumerate(body.tools or ()):
        if t.function.name in seen:
            raise APIError(
                400, f"tools[{i}]: function name {t.function.name!r} repeats", param="tools"
            )
        seen.add(t.function.name)
    must = {id(t) for t in forced(body) or ()}
    for i, t in enumerate(body.tools or ()):
        if id(t) not in must:
            continue
        schema = json.dumps(t.function.parameters or {"type": "object"})
        if error := llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(schema)
        ):
            where = f"tools.{i}.function.parameters"
            raise APIError(
                400,
                f"{where}: function {t.function.name!r}: the schema cannot constrain the call "
                f"tool_choice asks for: {readable(error.strip().splitlines()[0])[:300]}",
                param=where,
            )


def active(body: ChatCompletionRequest) -> bool:
    """The model may call tools (their outputs are parsed)."""
    return bool(body.tools) and body.tool_choice != "none"


def forced(body: ChatCompletionRequest) -> list[Tool] | None:
    """The tools a call must be made to ("required": any; named: that one), else None."""
    choice, tools = body.tool_choice, body.tools or []
    if choice == "required":
        return tools
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return None


def call_schema(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object", "properties": {}}
    if "$id" not in params:
        # Its own resource: "#/$defs/X" (pydantic's refs) resolves in the tool's schema,
        # not in this call schema it is nested in (which has no $defs: it did not compile).
        params = {"$id": f"urn:hetero-tool:{tool.function.name}", **params}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def grammar(tools: list[Tool], parallel: bool) -> str:
    """Lark (llguidance) grammar of one tool-call block of calls to these tools (whose
    schemas `check` has seen compile)."""
    schemas = [call_schema(t) for t in tools]
    one: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    one = {**one, "x-guidance": _X_GUIDANCE}
    more = ' (", " call)*' if parallel else ""
    return f'start: "{OPEN}[" call{more} "]{CLOSE}"\ncall: %json {json.dumps(one)}\n'


def _call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool call from a parsed {"name", "arguments"|"parameters"} object."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None  # (OpenAI's arguments are a JSON object)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _calls(value: Any, names: set[str]) -> list[dict[str, Any]] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call(x, names) for x in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def cut_calls(text: str, names: set[str], parallel: bool = True) -> list[dict[str, Any]]:
    """The calls of a forced call's text that ended before its grammar did (max_tokens, a
    stop string): those written whole, then the one being written, its `arguments` as far
    as they got (OpenAI's are text, then not JSON: the client sees how far it got, as
    OpenAI and vLLM give a call cut short) once its name is known (the text may hold a
    prefix of one name alone: the grammar allows no other). The text is a prefix of
    `grammar`'s language."""
    found = _cut(text, names, guess=True)
    calls = found[1] if found is not None else []
    return calls if parallel else calls[:1]


def cut_short(finish_reason: int, stop_reason: str | int | None) -> bool:
    """A choice ended by max_tokens or a stop string, which may end it inside a tool call
    (EOS or a stop token is the model ending its turn: what it wrote is its answer)."""
    return finish_reason == pb.FINISH_REASON_LENGTH or isinstance(stop_reason, str)


def cut_auto(
    text: str, names: set[str], parallel: bool = True
) -> tuple[str | None, list[dict[str, Any]]] | None:
    """tool_choice auto: a text that max_tokens or a stop string ended inside a tool call,
    as `cut_calls` takes a forced one: (the content before the call, the calls written so
    far, the last one's `arguments` as far as they got once its whole name is known).
    The text is inside a call from a whole `<tool_call>` on, or when it is a Llama 3 JSON
    call whose name is written whole. None when it is no call (a call that names no given
    tool, text after a finished block): the text stays content, as `parse` leaves it."""
    found = _cut(text, names, guess=False)
    if found is None:
        return None
    head, calls = found
    return (head if head.strip() else None), calls if parallel else calls[:1]


# The head of a call object being written: its name (whole when the quote closes it) and
# the key of its arguments.
_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _cut(text: str, names: set[str], guess: bool) -> tuple[str, list[dict[str, Any]]] | None:
    """(text before the calls, the calls of a text cut inside them), or None when it holds
    no call to these tools. `guess`: a name cut short is the one tool it can be."""
    if (at := text.find(OPEN)) >= 0:
        calls: list[dict[str, Any]] = []
        rest = text[at:]
        while rest.startswith(OPEN):
            body, close, rest = rest[len(OPEN) :].partition(CLOSE)
            if not close:  # the block being written
                more = _cut_items(body, names, guess)
                return None if more is None else (text[:at], calls + more)
            found = _parse_block(body, names)
            if found is None:
                return None
            calls += found
            rest = rest.lstrip()
        # Past whole blocks: only the start of another block (or of its tag) may follow.
        return (text[:at], calls) if OPEN.startswith(rest) else None
    bare = text.strip().removeprefix(PYTHON_TAG).lstrip()
    if not bare.startswith(("{", "[")) or guess:
        return None
    items = _cut_items(bare, names, guess)
    return ("", items) if items else None


def _parse_block(body: str, names: set[str]) -> list[dict[str, Any]] | None:
    try:
        return _calls(json.loads(body), names)
    except json.JSONDecodeError:
        return None


def _cut_items(body: str, names: set[str], guess: bool) -> list[dict[str, Any]] | None:
    """The calls of a block's text cut short: a call object, or a list of them, the last
    cut; None when a call names no given tool or the text is not call objects."""
    rest = body.lstrip()
    listed = rest.startswith("[")
    rest = rest[1:] if listed else rest
    calls: list[dict[str, Any]] = []
    while True:
        rest = rest.lstrip()
        if (listed and rest.startswith("]")) or CLOSE.startswith(rest):  # (cut in its end)
            return calls
        try:
            obj, end = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            break  # the call being written
        if (call := _call(obj, names)) is None:
            return calls if guess else None
        calls.append(call)
        rest = rest[end:].lstrip()
        if listed and rest.startswith(","):
            rest = rest[1:]
        elif not ((listed and rest.startswith("]")) or CLOSE.startswith(rest)):
            return calls if guess else None  # (one object a block, or a list of them)
    if not rest.startswith("{"):
        return calls if guess else None
    m = _NAME.match(rest)
    if m is None:  # its name not begun
        return calls
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:  # cut inside an escape
        return calls
    known = [name] if m.group(2) else [n for n in names if guess and n.startswith(name)]
    if len(known) != 1:
        return calls
    if known[0] not in names:
        return calls if guess else None
    args = _ARGS.match(rest, m.end())
    arguments = rest[args.end() :] if args is not None else ""
    call = {"name": known[0], "arguments": arguments}
    calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call})
    return calls


_DECODER = json.JSONDecoder()


def parse(
    text: str, names: set[str], parallel: bool = True
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls). Text that is not a well-formed call stays content. Not
    `parallel` (OpenAI's parallel_tool_calls false: at most one call a turn): the first
    call alone, the model's others dropped."""
    content, calls = _parse(text, names)
    return content, calls if parallel else calls[:1]


def _parse(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    if OPEN in text:
        head, calls, rest = text.split(OPEN, 1)[0], [], text[text.index(OPEN) :]
        while rest.startswith(OPEN):
            end = rest.find(CLOSE)
            body = rest[len(OPEN) : end if end >= 0 else len(rest)].strip()
            try:
                found = _calls(json.loads(body), names)
            except json.JSONDecodeError:
                found = None
            if found is None:
                return text, []
            calls += found
            rest = rest[end + len(CLOSE) :].lstrip() if end >= 0 else ""
        if rest:
            return text, []
        return (head if head.strip() else None), calls  # (as streamed: see ToolStream)
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if stripped.startswith(("{", "[")):
        try:
            found = _calls(json.loads(stripped), names)
        except json.JSONDecodeError:
            found = None
        if found:
            return None, found
    return text, []


@dataclass
class ToolStream:
    """One streamed choice: content goes out as it comes until it may be a tool call;
    from there the text is held and parsed when the choice ends."""

    names: set[str]
    parallel: bool = True  # as parse's
    forced: bool = False  # tool_choice required or named: the text is a call, maybe cut
    text: str = ""
    sent: int = 0  # characters of `text` streamed as content
    holding: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    cut: bool = False  # the calls are those of a call cut short (cut_calls, cut_auto)

    def feed(self, delta: str) -> str:
        """The content to stream now."""
        self.text += delta
        if self.holding:
            return ""
        rest = self.text[self.sent :]
        if self.sent == 0 and rest.lstrip().startswith(("{", "[", PYTHON_TAG)):
            self.holding = True  # maybe a bare JSON call
            return ""
        if (at := rest.find(OPEN)) >= 0:
            self.holding = True
            out = rest[:at]
            if self.sent == 0 and not out.strip():
                return ""  # whitespace alone before the calls is no content (parse's head)
            self.sent += at
            return out
        # Keep back a tail that may be the start of "<tool_call>" or "<|python_tag|>".
        keep = max(_partial(rest, OPEN), _partial(rest, PYTHON_TAG) if self.sent == 0 else 0)
        out = rest[: len(rest) - keep]
        if self.sent == 0 and not out.strip():
            return ""  # leading whitespace: wait to see what follows
        self.sent += len(out)
        return out

    def finish(self, cut: bool = False) -> str:
        """At the end: the calls (in `calls`), and what is left of the content. `cut`: the
        choice was ended by max_tokens or a stop string (a call may be cut short)."""
        rest = self.text[self.sent :]
        content, self.calls = parse(rest, self.names, self.parallel)
        if not self.calls and self.forced:  # cut short: no markup as content
            self.calls, self.cut = cut_calls(rest, self.names, self.parallel), True
            return ""
        if not self.calls and cut and (found := cut_auto(rest, self.names, self.parallel)):
            (content, self.calls), self.cut = found, True  # (maybe no call named yet)
        if self.calls or self.cut:
            # Content before the block went out already; what parse kept is the head.
            return (content or "") if self.sent == 0 else ""
        return rest


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
