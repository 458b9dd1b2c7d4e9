"""What a generate call becomes when its control plane fails under it (gateway.router).

Before the client has seen any of its output, the call is simply sent again. After, it
is *resumed*: the new control plane gets the prompt's token ids followed by the output
tokens already delivered, with `num_resumed_output_tokens` saying how many of those are
output. The control plane treats them as generated (they count against max_tokens and
min_tokens, in the frequency and presence penalties and in usage; a grammar consumes
them; its detokenizer starts after them) and sends only what follows, so the call goes
on from the next token. That is exact, not just plausible: seeded sampling draws from
hash(seed, position) (compute_plane/sampler.py), and every other input to the next
token is the sequence and where its prompt ends. The prompt's logprobs were sent with
the first delta, so the continuation does not ask for them again.

These cannot be resumed exactly, and fail with 503 once output has been delivered:

- n > 1: the choices are one request on the control plane (forked prompt blocks,
  per-choice seeds); a continuation would be n requests of one choice each.
- output that ends inside a UTF-8 character or in text the control plane held back as
  a possible start of a stop string: the new control plane cannot know which part of
  the delivered tokens' text the client lacks. The router checks this by detokenizing
  the delivered tokens on the new control plane: they must give exactly the text the
  client has.
"""

from __future__ import annotations

from hetero_proto import control_pb2 as pb


def why_not_continued(request: pb.GenerateRequest) -> str | None:
    """Why a call with delivered output cannot be continued exactly, or None."""
    if request.params.n > 1:
        return "n > 1"
    return None


def continuation(
    request: pb.GenerateRequest, prompt_ids: list[int], output_ids: list[int]
) -> pb.GenerateRequest | None:
    """The call that generates the rest of `request`'s output after `output_ids`, or
    None when no token is left to generate."""
    if request.params.max_tokens and request.params.max_tokens <= len(output_ids):
        return None
    out = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[*prompt_ids, *output_ids]),
        traceparent=request.traceparent,
        num_resumed_output_tokens=len(output_ids),
    )
    out.params.CopyFrom(request.params)
    out.params.ClearField("prompt_logprobs")
    return out
