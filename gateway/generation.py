"""Turn OpenAI requests into control-plane generate calls and collect their outputs.

The calls go over a GenerateMany stream to a control plane (gateway.multiplex), placed
and moved on failure by the gateway's router (gateway.router).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from gateway import tool_calls
from gateway.bodies import loads
from gateway.errors import APIError, from_grpc
from gateway.multiplex import Calls, Item
from gateway.schemas import (
    INT32,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    SamplingFields,
)
from hetero_common.accumulate import ChoiceResult
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc

FINISH: dict[int, str] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_GRAMMAR: "grammar_dead_end",
}


def closed_objects(schema: Any) -> Any:
    """OpenAI's strict mode: an object schema that does not say otherwise takes no
    properties beyond those it lists (OpenAI requires `additionalProperties: false` on
    every object under strict; we apply it where it is missing). Every output still
    validates against the schema as given."""
    if isinstance(schema, list):
        return [closed_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if isinstance(schema.get("properties"), dict):  # property names are not schemas
        out["properties"] = {k: closed_objects(v) for k, v in schema["properties"].items()}
    return out


def structured_output(req: SamplingFields) -> pb.StructuredOutput | None:
    """The grammar a body asks for (response_format or one guided_* field), or None."""
    so = req.structured_outputs
    if so is not None:  # vLLM's newer spelling: the same as the guided_* field
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        inner = [k for k, v in {**fields, "json_object": so.json_object}.items() if v]
        if len(inner) != 1:
            raise APIError(
                400,
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                "json_object",
                param="structured_outputs",
            )
        if inner[0] == "json_object":
            if req.response_format is not None and req.response_format.type != "text":
                raise APIError(
                    400,
                    "set at most one of response_format, structured_outputs",
                    param="structured_outputs",
                )
            req = req.model_copy(update={"response_format": ResponseFormat(type="json_object")})
        else:
            req = req.model_copy(update={f"guided_{inner[0]}": fields[inner[0]]})
    given = [
        name
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        if getattr(req, name) is not None
    ]
    rf = req.response_format
    if rf is not None and rf.type != "text":
        given.append("response_format")
    if len(given) > 1:
        raise APIError(
            400,
            f"set at most one of {', '.join(given)} (each constrains the output)",
            param=given[1],
        )
    if not given:
        return None
    kind = given[0]
    if kind == "response_format":
        assert rf is not None
        if rf.type == "json_object":
            return pb.StructuredOutput(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(
                400,
                "response_format json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        schema = rf.json_schema.schema_
        if rf.json_schema.strict:
            schema = closed_objects(schema)
        return pb.StructuredOutput(json_schema=json.dumps(schema))
    if kind == "guided_json":
        g = req.guided_json
        if isinstance(g, str):
            try:
                g = loads(g)
            except json.JSONDecodeError as e:
                raise APIError(400, f"guided_json is not valid JSON: {e}", param=kind) from None
        return pb.StructuredOutput(json_schema=json.dumps(g))
    if kind == "guided_regex":
        return pb.StructuredOutput(regex=req.guided_regex)
    if kind == "guided_choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=req.guided_choice))
    return pb.StructuredOutput(grammar=req.guided_grammar)


# How the control plane's grammar errors begin: the StructuredOutput kind, then ":".
GRAMMAR_KINDS = tuple(
    f"{f.name}:" for f in pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields
)


def constraining_field(req: SamplingFields) -> str | None:
    """The field of a request that constrains its output (for an error about it)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar"):  # fmt: skip
        value = getattr(req, name)
        if value is not None and not (name == "response_format" and value.type == "text"):
            return name
    if isinstance(req, ChatCompletionRequest) and tool_calls.forced(req) is not None:
        return "tools"
    return None


# The smallest normal float32. The proto's floats are 32-bit: a positive top_p or
# repetition_penalty below float32's range would arrive as 0, which means "off" (1.0).
_F32_TINY = 1.1754943508222875e-38


def generation_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None
) -> pb.GenerationParams:
    p = pb.GenerationParams(
        max_tokens=max_tokens or 0,
        min_tokens=req.min_tokens,
        n=req.n,
        temperature=req.temperature,
        top_p=max(req.top_p, _F32_TINY),
        top_k=max(0, req.top_k),
        min_p=req.min_p,
        repetition_penalty=max(req.repetition_penalty, _F32_TINY),
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        stop=req.stop or [],
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        cache_salt=req.cache_salt or "",
    )
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})",
            param="min_tokens",
        )
    for key, bias in (req.logit_bias or {}).items():
        token = int(key)
        if not 0 <= token < INT32:
            raise APIError(
                400, f"logit_bias: token id {token} is not a valid id", param="logit_bias"
            )
        p.logit_bias[token] = bias
    if req.seed is not None:
        p.seed = req.seed % (1 << 64)
    # echo's prompt tokens get logprobs too: the larger count, each output trims to its own
    echoed = req.logprobs if isinstance(req, CompletionRequest) and req.echo else None
    if asked := [k for k in (req.prompt_logprobs, echoed) if k is not None]:
        p.prompt_logprobs = max(asked)
    if max_tokens == 0:  # completions' echo with max_tokens 0 (CompletionServing.check)
        p.prompt_only = True
    if (spec := structured_output(req)) is not None:
        p.structured.CopyFrom(spec)
    return p


def is_batch(req: CompletionRequest) -> bool:
    """`prompt` is a list of prompts (not a text, nor one prompt's token ids)."""
    raw = req.prompt
    return not (isinstance(raw, str) or isinstance(raw[0], int))


def completion_calls(req: CompletionRequest) -> list[pb.GenerateRequest]:
    """One Generate call per prompt (a batch of prompts gives n choices each)."""
    params = generation_params(req, req.max_tokens, req.logprobs)
    raw = req.prompt
    prompts: list[str | list[int]] = list(raw) if is_batch(req) else [raw]  # type: ignore[arg-type,list-item]
    calls = []
    for prompt in prompts:
        if isinstance(prompt, str):
            calls.append(pb.GenerateRequest(text=prompt, params=params))
        else:
            calls.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=params))
    return calls


def chat_call(req: ChatCompletionRequest) -> pb.GenerateRequest:
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = generation_params(req, req.max_completion_tokens or req.max_tokens, logprobs)
    tool_calls.check(req)
    if (must := tool_calls.forced(req)) is not None:
        if params.HasField("structured"):
            raise APIError(
                400,
                "tool_choice required or named cannot be combined with a response "
                "format or guided_* field",
                param="tool_choice",
            )
        # A named function is called once (as vLLM and OpenAI do); "required" may call
        # several tools when parallel_tool_calls allows it.
        parallel = req.parallel_tool_calls and req.tool_choice == "required"
        params.structured.grammar = tool_calls.grammar(must, parallel)
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message needs add_generation_prompt false",
            param="continue_final_message",
        )
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise APIError(
            400,
            "continue_final_message needs an assistant message last",
            param="continue_final_message",
        )
    chat = pb.ChatInput(
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    if req.chat_template_kwargs:
        chat.template_kwargs_json = json.dumps(req.chat_template_kwargs)
    if req.documents:
        chat.documents_json = json.dumps(req.documents)
    if tool_calls.active(req):
        chat.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in req.tools or ()])
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        msg = chat.messages.add(role=role, content=m.text())
        msg.name = m.name or ""
        msg.tool_call_id = m.tool_call_id or ""
        if m.tool_calls:
            msg.tool_calls_json = json.dumps([c.model_dump() for c in m.tool_calls])
    return pb.GenerateRequest(chat=chat, params=params)


@dataclass
class Delta:
    index: int  # global choice index: prompt_index * n + choice index
    choice: pb.ChoiceDelta


# (deltas, usage when all calls are done, prompt ids when known, prompt tokens served
# from the prefix cache so far: each call's from its first delta on, whichever choice's)
StreamItem = tuple[list[Delta], pb.Usage | None, list[list[int]] | None, int]


async def stream_calls(
    mux: Calls, calls: list[pb.GenerateRequest], timeout: float
) -> AsyncGenerator[StreamItem, None]:
    """Run the calls concurrently; yield `StreamItem`s.

    Past `timeout` seconds the calls end with a 504. Closing or cancelling the consumer
    cancels every call that has not ended (the control plane then frees its blocks).
    """
    n = calls[0].params.n or 1
    queue: asyncio.Queue[Item] = asyncio.Queue()
    ids = mux.start(calls, queue, timeout)  # past the timeout the queue gets a 504
    prompt_ids: list[list[int]] = [[] for _ in calls]
    usage = pb.Usage()
    cached = [0] * len(calls)
    done = 0
    try:
        while done < len(calls):
            item = await queue.get()
            if item is None:
                done += 1
                continue
            if isinstance(item, BaseException):
                raise item
            i, resp = item
            if isinstance(resp, BaseException):
                if isinstance(resp, APIError):
                    resp.call_index = i
                raise resp
            if resp.prompt_token_ids:
                prompt_ids[i] = list(resp.prompt_token_ids)
            if resp.HasField("usage"):
                usage.prompt_tokens += resp.usage.prompt_tokens
                usage.completion_tokens += resp.usage.completion_tokens
                usage.cached_prompt_tokens += resp.usage.cached_prompt_tokens
                cached[i] = resp.usage.cached_prompt_tokens
            elif resp.cached_prompt_tokens:
                cached[i] = resp.cached_prompt_tokens
            deltas = [Delta(i * n + c.index, c) for c in resp.choices]
            first = bool(resp.prompt_token_ids)
            known = prompt_ids if first and all(prompt_ids) else None
            yield deltas, None, known, sum(cached)
        yield [], usage, None, usage.cached_prompt_tokens
    finally:
        mux.cancel(ids)


async def start_stream(
    mux: Calls, calls: list[pb.GenerateRequest], timeout: float
) -> AsyncIterator[StreamItem]:
    """`stream_calls`, returned once every call is admitted.

    The control plane answers each call at once with an "admitted" message, so refusals
    (full queue, prompt too long, no compute plane) raise here, before the HTTP head is
    sent, and reach the client as a 4xx/5xx status rather than as an SSE error event.
    """
    gen = stream_calls(mux, calls, timeout)
    head: list[StreamItem] = []
    try:
        async for item in gen:
            head.append(item)
            if item[2] is not None:  # prompt ids of every call: all admitted
                break
    except BaseException:
        await gen.aclose()
        raise

    async def rest() -> AsyncIterator[StreamItem]:
        try:
            for item in head:
                yield item
            async for item in gen:
                yield item
        finally:
            await gen.aclose()

    return rest()


async def detokenize(stub: pb_grpc.ControlPlaneStub, ids: list[int]) -> str:
    try:
        resp = await stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=False))
    except grpc.aio.AioRpcError as e:
        raise from_grpc(e) from e
    return resp.text


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            404,
            f"The model `{requested}` does not exist. Available: `{served}`.",
            param="model",
            code="model_not_found",
        )


async def collect_calls(
    mux: Calls, calls: list[pb.GenerateRequest], timeout: float
) -> tuple[dict[int, ChoiceResult], pb.Usage, list[list[int]]]:
    """Run the calls to the end: each choice's accumulated deltas (finish_reason as the
    proto enum: FINISH maps it to OpenAI's), usage, prompts."""
    states: dict[int, ChoiceResult] = {}
    usage = pb.Usage()
    prompts: list[list[int]] = [[] for _ in calls]
    async for deltas, u, prompt_ids, _ in stream_calls(mux, calls, timeout):
        if prompt_ids is not None:
            prompts = prompt_ids
        for d in deltas:
            states.setdefault(d.index, ChoiceResult()).add(d.choice)
        if u is not None:
            usage = u
    return states, usage, prompts
