"""Accumulating a generate stream: each choice's text, tokens, logprobs and finish
reason, the prompt's token ids and the usage (control.proto GenerateResponse).

One place for every reader of whole results: offline batch inference, the gateway's
non-streaming responses, the CLI and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero_proto import control_pb2 as pb


def stop_reason(delta: pb.ChoiceDelta) -> str | int | None:
    """vLLM's stop_reason: the stop string matched, else the stop token, else None."""
    if delta.stop_reason:
        return delta.stop_reason
    if delta.finish_reason == pb.FINISH_REASON_STOP and delta.stop_token_id >= 0:
        return delta.stop_token_id
    return None


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)  # each delta's text, in order
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED  # a pb.FinishReason once finished
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # prompt tokens 1..
    stop_reason: str | int | None = None  # the stop string or stop/EOS token that ended it

    def add(self, delta: pb.ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.deltas.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        self.prompt_logprobs.extend(delta.prompt_logprobs)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            self.stop_reason = stop_reason(delta)


@dataclass
class Accumulated:
    """A whole request: its choices by index, prompt and usage (set by the last message)."""

    choices: dict[int, ChoiceResult] = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)
    usage: pb.Usage | None = None

    def add(self, resp: pb.GenerateResponse) -> bool:
        """Take one message; True once the request's last (the one with usage) is in."""
        self.prompt_token_ids.extend(resp.prompt_token_ids)
        for delta in resp.choices:
            self.choice(delta.index).add(delta)
        if resp.HasField("usage"):
            self.usage = resp.usage
            return True
        return False

    def choice(self, index: int) -> ChoiceResult:
        if (c := self.choices.get(index)) is None:
            c = self.choices[index] = ChoiceResult()
        return c
