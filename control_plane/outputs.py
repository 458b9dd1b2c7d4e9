"""Per-choice output processing: detokenise, stop strings, logprobs -> GenerateResponse deltas."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.request import Request, Status
from control_plane.stop import StopChecker
from control_plane.tokenizer import TokenizerWrapper
from hetero_common.tracing import NO_SPAN, RequestSpan
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb

FINISH_REASONS = {
    Status.FINISHED_STOPPED: pb.FINISH_REASON_STOP,
    Status.FINISHED_LENGTH: pb.FINISH_REASON_LENGTH,
    Status.FINISHED_ABORTED: pb.FINISH_REASON_ABORT,
    Status.FINISHED_GRAMMAR: pb.FINISH_REASON_GRAMMAR,
}


@dataclass(eq=False)
class Choice:
    index: int
    request: Request
    detok: IncrementalDetokenizer
    stop: StopChecker
    finished: bool = False
    sent: bool = False  # a delta of this choice went out
    last_token_time: float | None = None
    # Sampled tokens not yet sent (--stream-interval > 1 sends every N tokens), and
    # their logprobs when the request asked for them.
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[cpb.TokenResult] = field(default_factory=list)
    # Prompt logprobs (positions 1..), gathered from the steps that computed the prompt,
    # sent once with the first delta.
    prompt_logprobs: list[cpb.TokenResult] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def add_prompt_logprobs(self, p: cpb.PromptLogprobs) -> None:
        """Keep the positions not seen yet (a recompute after preemption repeats them)."""
        have = len(self.prompt_logprobs)
        skip = have + 1 - p.start
        if skip >= 0:
            self.prompt_logprobs.extend(p.tokens[skip:])


class Outbox(Protocol):
    """Where the messages of a GenerateMany call's requests gather until the next write.

    A step adds its responses to the outbox as it builds them, so all of a call's
    requests go out in one message per step rather than one each.
    """

    def add(self, request_id: str) -> pb.GenerateResponse:
        """A new response of `request_id`, part of the next message: fill it in place."""
        ...

    def sent(self, request_id: str, last: bool, *, owner: object = None) -> None:
        """The response from `add` is complete; `last`: the request (`owner`, its stream)
        has ended."""
        ...

    def delta(self, request_id: str, token_ids: list[int], text: str) -> None:
        """A delta of choice 0 with only text and tokens, the request not finished: packed
        into the next message (GenerateManyResponse.packed) rather than a response."""
        ...

    def fail(self, request_id: str, error: BaseException, *, owner: object = None) -> None:
        """The request (`owner`, its stream) is refused or failed; it ends with this error."""
        ...


@dataclass(eq=False)
class GenerateStream:
    """One generate request (n choices) and where its responses go.

    A Generate call reads them from `queue`, one message each; a request of a
    GenerateMany call writes them into its call's `outbox` under `client_id`.
    """

    stream_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    tokenizer: TokenizerWrapper
    queue: asyncio.Queue[pb.GenerateResponse | BaseException] = field(default_factory=asyncio.Queue)
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    outbox: Outbox | None = None
    client_id: str = ""
    num_finished: int = 0  # choices finished
    # The outbox that takes this request's plain deltas packed (Outbox.delta): set for a
    # request of a GenerateMany call with one choice and no logprobs.
    pack_into: Outbox | None = None
    span: RequestSpan = NO_SPAN  # its trace span here (hetero_common.tracing), when tracing
    # The compute plane it runs on (control_plane.plane.ComputePlane; the engine places
    # and moves it) and its prompt's block keys counted there for placement.
    plane: Any = None
    route_keys: list[Any] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.choices)

    def new_response(self) -> pb.GenerateResponse:
        """An empty response of this request to fill in, then hand to `send`."""
        if self.outbox is None:
            return pb.GenerateResponse(request_id=self.stream_id)
        return self.outbox.add(self.client_id)

    def send(self, resp: pb.GenerateResponse, last: bool = False) -> None:
        if self.outbox is None:
            self.queue.put_nowait(resp)
        else:
            self.outbox.sent(self.client_id, last, owner=self)

    def fail(self, error: BaseException) -> None:
        """End the request with an error (the compute plane is gone, it no longer fits)."""
        self.span.end(error=str(error))
        if self.outbox is None:
            self.queue.put_nowait(error)
        else:
            self.outbox.fail(self.client_id, error, owner=self)

    def new_text(self, choice: Choice, tokens: list[int]) -> tuple[str, int, str | None]:
        """Detokenise a choice's newly sampled tokens and apply its stop strings.

        Returns the text to send, how many of `tokens` it covers, and the stop string
        matched. A stop string ends the text at the token that completed it: the tokens
        after it are cut from the request, as if they had never been sampled.
        """
        req = choice.request
        # The token that ended the request (EOS or a stop token) adds no text.
        ended_by_token = req.status is Status.FINISHED_STOPPED and isinstance(req.stop_reason, int)
        push, feed = choice.detok.push, choice.stop.feed_token
        if not ended_by_token and not choice.stop.stop:  # the common case: only text
            return "".join(map(push, tokens)), len(tokens), None
        last = len(tokens) - 1
        text = ""
        matched = None
        sent = len(tokens)
        for i, tok in enumerate(tokens):
            emit, matched = feed("" if ended_by_token and i == last else push(tok))
            text += emit
            if matched is not None:
                sent = i + 1
                if i < last:
                    req.drop_last(last - i)  # sampled after the stop string: never sent
                break
        return text, sent, matched

    def add_delta(
        self, choice: Choice, resp: pb.GenerateResponse, tokens: list[int], text: str
    ) -> pb.ChoiceDelta:
        """Add the delta of a choice (its tokens and their text) to `resp`, built in place
        (a protobuf append would copy it)."""
        delta = resp.choices.add()  # fields set one by one: add(**kwargs) is slower
        if choice.index:
            delta.index = choice.index
        delta.stop_token_id = -1
        delta.token_ids.extend(tokens)
        if choice.prompt_logprobs and not choice.prompt_logprobs_sent:
            choice.prompt_logprobs_sent = True
            delta.prompt_logprobs.extend([self._logprob(r) for r in choice.prompt_logprobs])
        if choice.request.sampling.logprobs:
            lps = choice.pending_logprobs[: len(tokens)]
            delta.logprobs.extend([self._logprob(r) for r in lps])
        delta.text = text
        return delta

    def finish(self, choice: Choice, delta: pb.ChoiceDelta, status: Status) -> None:
        """Flush held-back text and mark the choice finished."""
        if not isinstance(choice.request.stop_reason, str):  # a stop string drops the rest
            tail, matched = choice.stop.feed(choice.detok.flush())
            delta.text += tail + (choice.stop.flush() if matched is None else "")
        choice.finished = True
        self.num_finished += 1
        delta.finish_reason = FINISH_REASONS[status]
        reason = choice.request.stop_reason
        if isinstance(reason, str):
            delta.stop_reason = reason
        elif isinstance(reason, int):
            delta.stop_token_id = reason

    @property
    def prefix_hit(self) -> int:
        """The prompt tokens the prefix cache served this request: choice 0's hit at its
        first admission (-1 before it; with n > 1 the other choices fork its prompt
        blocks, so their own counts would include those). The output processor reads it
        here at the stream's first delta, whichever choice's, so that the report does not
        depend on which choice samples first."""
        return self.choices[0].request.num_cached_tokens

    @property
    def cached_prompt_tokens(self) -> int:
        # A resumed request's hit may reach into its resumed output: not prompt.
        return min(self.num_cached_tokens, len(self.prompt_token_ids))

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=sum(c.request.num_output_tokens for c in self.choices),
            cached_prompt_tokens=self.cached_prompt_tokens,
        )

    def _logprob(self, r: cpb.TokenResult) -> pb.TokenLogprob:
        t = self.tokenizer
        lp = pb.TokenLogprob(
            token_id=r.token_id,
            token=t.token_text(r.token_id),
            token_bytes=t.token_bytes(r.token_id),
            logprob=r.logprob,
            rank=r.rank,
        )
        for top in r.top_logprobs:
            lp.top_logprobs.add(
                token_id=top.token_id,
                token=t.token_text(top.token_id),
                token_bytes=t.token_bytes(top.token_id),
                logprob=top.logprob,
            )
        return lp
