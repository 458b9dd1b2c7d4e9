"""OpenAI request bodies, validated. Responses are built as plain dicts in gateway/serving.py.

Fields follow the OpenAI API reference; `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, `stop_token_ids` and `cache_salt` are vLLM-style extensions.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, Literal, TypeVar, get_args

import jsonschema_rs
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hetero_common.limits import (
    CONTENT_REQUIRED,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
)

INT32 = 2**31  # counts and token ids travel as int32 in control.proto
# The control plane checks token ids against the model's vocabulary.
TokenId = Annotated[int, Field(ge=0, lt=INT32)]


J = TypeVar("J")


def _encodable(v: J) -> J:
    """JSON may spell lone UTF-16 surrogates ("\\ud800"); they are not text, and the
    tokenizer cannot take them. In free-form JSON (a schema, template variables) every
    key and string is checked, wherever it nests."""
    if isinstance(v, str) and v.isascii():  # (most strings: the walk costs more than this)
        return v
    if (where := _lone_surrogate(v)) is not None:
        raise ValueError(f"contains a lone UTF-16 surrogate {where}")
    return v


def _lone_surrogate(value: Any) -> str | None:
    """Where a JSON value holds a lone surrogate ("at position N", then "of PATH" inside
    an object or list), or None. A loop, not recursion: JSON text parsed from a string
    field nests deeper than the body's own parser allows."""
    todo: list[tuple[Any, str]] = [(value, "")]
    while todo:
        v, path = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"at position {e.start}" + (f" of {path}" if path else "")
        elif isinstance(v, dict):
            for key, item in v.items():
                todo.append((item, f"{path}.{key}" if path else key))
                # (pushed last, so checked first: an item's path never names a bad key)
                todo.append((key, f"a key of {path or 'the object'}"))
        elif isinstance(v, list):
            todo.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(v))
    return None


def _encodable_arguments(v: str) -> str:
    """Tool-call arguments are JSON text that the control plane parses for the chat
    template: a surrogate escaped in it becomes a lone one there."""
    try:
        value = json.loads(v)
    except (json.JSONDecodeError, RecursionError):
        return v  # not JSON: the template gets the string as sent
    _encodable(value)
    return v


Text = Annotated[str, AfterValidator(_encodable)]
# Free-form JSON objects (schemas, template variables), checked all through.
JSONObject = Annotated[dict[str, Any], AfterValidator(_encodable)]

# The meta-schemas jsonschema_rs holds ($schema spelling them as it knows them): any other
# $schema it would fetch from its URL, from this process.
_DRAFTS = {
    f"{scheme}://json-schema.org/{draft}/schema{end}"
    for draft in ("draft-04", "draft-06", "draft-07", "draft/2019-09", "draft/2020-12")
    for scheme in ("http", "https")
    for end in ("", "#")
}


def _parameters_schema(v: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters: a JSON Schema of an object, valid against its draft's
    meta-schema, as OpenAI checks them whatever tool_choice says (the model is shown
    them, and "required" or a named tool compiles them). Rust, about 1 ms for 200 KB, so
    it runs where the body is validated."""
    if v.get("type", "object") != "object":
        raise ValueError("must be an object schema (type: object)")
    try:
        json.dumps(v, allow_nan=False)
    except ValueError:  # (Python's json reads 1e400 as inf, and NaN / Infinity literals)
        raise ValueError(
            "has a number that is not finite (NaN, Infinity, or past 1.8e308)"
        ) from None
    checked = v
    if isinstance(v.get("$schema"), str) and v["$schema"] not in _DRAFTS:
        # Another meta-schema is checked as the newest draft: never fetched from its URL.
        checked = {k: x for k, x in v.items() if k != "$schema"}
    try:
        jsonschema_rs.meta.validate(checked)
    except jsonschema_rs.ValidationError as e:
        where = ".".join(map(str, e.instance_path))
        raise ValueError(
            f"is not a valid JSON Schema: {e.message}" + (f" (at {where})" if where else "")
        ) from None
    except jsonschema_rs.ReferencingError as e:  # (a meta-schema it lacks: not expected)
        raise ValueError(f"is not a JSON Schema it can check: {str(e).splitlines()[0]}") from None
    return v


ParametersSchema = Annotated[JSONObject, AfterValidator(_parameters_schema)]


class Strict(BaseModel):
    """A JSON number is not a string, nor a boolean a number: no coercion. A field we do
    not implement is a 400 that names it, never silently dropped. null is the default of
    a field that has one and no meaning for null (OpenAI's optional fields are "or null":
    the openai client sends `temperature=None` as null, and vLLM takes it)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            nulls = _defaults_for_null(cls)
            return {k: v for k, v in data.items() if v is not None or k not in nulls}
        return data


@functools.cache
def _defaults_for_null(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` (by name and alias) that null leaves at their default: those
    with a default whose type has no None (a field that takes None, such as completions'
    max_tokens, where null means up to the context, keeps it)."""
    return frozenset(
        key
        for name, f in model.model_fields.items()
        if not f.is_required() and type(None) not in get_args(f.annotation)
        for key in (name, f.alias)
        if key is not None
    )


class JsonSchemaFormat(Strict):
    name: Text
    description: Text | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (the newer name of its guided_* fields): one of them."""

    json_: JSONObject | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"json_schema is only for type json_schema, not {self.type}")
        return self


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (vLLM)


class SamplingFields(Strict):
    """Fields shared by completions and chat completions."""

    model: Text
    max_tokens: Annotated[int, Field(ge=1, lt=INT32)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    stop: Text | list[Text] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # vLLM-style extensions
    top_k: Annotated[int, Field(ge=-1, lt=INT32)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY)] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, lt=INT32)] = 0
    stop_token_ids: list[TokenId] | None = None
    # Structured output: OpenAI's response_format, and vLLM's guided_* extensions.
    response_format: ResponseFormat | None = None
    guided_json: JSONObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM extensions
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Prefix-cache blocks are shared only among requests of the same salt (or none).
    cache_salt: Text | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v == "":  # (vLLM's rule: "" would read as no salt, sharing with everyone)
            raise ValueError("cache_salt must be a non-empty string if provided")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None:
            if len(stops) > MAX_STOPS:
                raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed")
            if any(not s for s in stops):
                raise ValueError("stop sequences must not be empty")
            if any(len(s) > MAX_STOP_CHARS for s in stops):
                raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not _TOKEN_KEY.fullmatch(key):  # (ASCII digits: str.isdigit takes "²")
                shown = key if len(key) <= 24 else key[:24] + "..."
                raise ValueError(f"keys must be token ids, got {shown!r}")
        return v


_TOKEN_KEY = re.compile(r"-?[0-9]{1,10}", re.ASCII)


def _batch_prompt(v: J) -> J:
    """A batch's prompt (text or token ids) is not empty: checked per item, so that the
    error names it (prompt.1)."""
    if not v:
        raise ValueError("a prompt of the batch must not be empty")
    return v


BatchText = Annotated[Text, AfterValidator(_batch_prompt)]
BatchIds = Annotated[list[TokenId], AfterValidator(_batch_prompt)]


class CompletionRequest(SamplingFields):
    prompt: Text | list[BatchText] | list[TokenId] | list[BatchIds]
    # 0 only with echo: the prompt scored, nothing generated (CompletionServing.check)
    max_tokens: Annotated[int, Field(ge=0, lt=INT32)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Text | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if not v:  # "" or [] (a batch's own items: _batch_prompt)
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> None:
        if v:
            raise ValueError("suffix is not supported")
        return None


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(Strict):
    name: Text
    arguments: Annotated[Text, AfterValidator(_encodable_arguments)]


class ToolCall(Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    # OpenAI's roles, or any other the model's chat template knows (e.g. "ipython").
    role: Annotated[Text, Field(min_length=1, max_length=64)]
    # (checked when left out too: OpenAI refuses a system, user or tool turn without it)
    content: Annotated[Text | list[TextPart] | None, Field(validate_default=True)] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: Text | None = None  # a tool result: the call it answers

    @field_validator("content")
    @classmethod
    def _content_where_needed(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role in CONTENT_REQUIRED:
            raise ValueError(f"a {role} message needs content (a string or text parts)")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: ParametersSchema | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's: keep the completion for its dashboards. Nothing is kept here, which is what
    # false (its default) asks; some clients send it.
    store: bool | None = None
    # vLLM extensions: how the chat template renders the messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # prepend the open final message (continue_final_message) to the answer
    chat_template_kwargs: JSONObject | None = None
    # RAG documents, for templates that use them
    documents: list[Annotated[dict[str, Text], AfterValidator(_encodable)]] | None = None

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, v: bool | None) -> None:
        if v:
            raise ValueError("true is not supported: this server keeps no completions")
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):  # (OpenAI's and vLLM's rule)
            raise ValueError("top_logprobs needs logprobs set to true")
        return v


class TokenizeCompletionRequest(Strict):
    """vLLM's POST /tokenize with a prompt."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeChatRequest(Strict):
    """vLLM's POST /tokenize with chat messages (rendered with the chat template)."""

    model: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: JSONObject | None = None


def _tokenize_kind(body: Any) -> str:
    chat = isinstance(body, dict) and "messages" in body
    return "TokenizeChatRequest" if chat else "TokenizeCompletionRequest"


# Told apart by `messages`, so that an error names the field of the body's own kind
# (tried as either, a bad chat body was blamed for its missing `prompt`).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[TokenId]
