"""What a generate call becomes when its control plane fails under it (gateway.router).

Before the client has seen any of its output, the call is simply sent again. After, it
is *continued*: the new control plane gets the prompt's token ids followed by the
output tokens already delivered as its input, and max_tokens and min_tokens less those,
so it goes on from the next token. That is exact, not just plausible, because what
decides the next token depends on the sequence and not on where the prompt ends:
seeded sampling draws from hash(seed, position) (compute_plane/sampler.py), the
repetition penalty counts prompt and output tokens alike, logit_bias has no memory,
and greedy decoding is greedy. The prompt's logprobs were sent with the first delta,
so the continuation does not ask for them again.

These cannot be continued exactly, and fail with 503 once output has been delivered:

- n > 1: the choices are one request on the control plane (forked prompt blocks,
  per-choice seeds); a continuation would be n requests of one choice each.
- structured output (response_format, guided_*, tool_choice required or named): the
  grammar's state is the output so far; as prompt tokens it would start afresh.
- frequency and presence penalties: they count output tokens only, and the delivered
  ones would become prompt tokens.
- output that ends inside a UTF-8 character or in text the control plane held back as
  a possible start of a stop string: its detokenizer and stop-string state are not
  carried over. The router checks this by detokenizing the delivered tokens on the new
  control plane: they must give exactly the text the client has.
"""

from __future__ import annotations

from hetero_proto import control_pb2 as pb


def why_not_continued(request: pb.GenerateRequest) -> str | None:
    """Why a call with delivered output cannot be continued exactly, or None."""
    p = request.params
    if p.n > 1:
        return "n > 1"
    if p.HasField("structured"):
        return "structured output"
    if p.frequency_penalty or p.presence_penalty:
        return "frequency or presence penalty"
    return None


def continuation(
    request: pb.GenerateRequest, prompt_ids: list[int], output_ids: list[int]
) -> pb.GenerateRequest | None:
    """The call that generates the rest of `request`'s output after `output_ids`, or
    None when no token is left to generate."""
    out = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[*prompt_ids, *output_ids]), traceparent=request.traceparent
    )
    p = out.params
    p.CopyFrom(request.params)
    done = len(output_ids)
    if p.max_tokens:  # 0: up to max_model_len, which counts prompt and output alike
        if p.max_tokens <= done:
            return None
        p.max_tokens -= done
    p.min_tokens = max(0, p.min_tokens - done)
    p.ClearField("prompt_logprobs")
    return out


def continued_usage(usage: pb.Usage, prompt_tokens: int, delivered: int) -> None:
    """A continuation's usage as the original call's: its own prompt, every output token
    (those delivered before the continuation count as output, not as prompt)."""
    usage.completion_tokens += delivered
    usage.prompt_tokens = prompt_tokens
    usage.cached_prompt_tokens = min(usage.cached_prompt_tokens, prompt_tokens)
