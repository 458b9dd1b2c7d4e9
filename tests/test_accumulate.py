"""hetero_common.accumulate on hand-built GenerateResponse messages."""

from __future__ import annotations

from hetero_common.accumulate import Accumulated
from hetero_proto import control_pb2 as pb


def _resp(**kw: object) -> pb.GenerateResponse:
    return pb.GenerateResponse(**kw)  # type: ignore[arg-type]


def test_choices_join_in_order_and_the_usage_ends_the_request() -> None:
    acc = Accumulated()
    assert not acc.add(_resp(request_id="r", prompt_token_ids=[5, 6, 7]))  # admitted
    assert not acc.add(
        _resp(
            choices=[
                pb.ChoiceDelta(index=0, text="Hel", token_ids=[1]),
                pb.ChoiceDelta(index=1, text="Good", token_ids=[9, 10]),
            ]
        )
    )
    lp = pb.TokenLogprob(token_id=2, logprob=-0.5)
    last = _resp(
        choices=[
            pb.ChoiceDelta(
                index=0,
                text="lo",
                token_ids=[2],
                logprobs=[lp],
                finish_reason=pb.FINISH_REASON_STOP,
            ),
            pb.ChoiceDelta(
                index=1, text="bye", token_ids=[11], finish_reason=pb.FINISH_REASON_LENGTH
            ),
        ],
        usage=pb.Usage(prompt_tokens=3, completion_tokens=5),
    )
    assert acc.add(last)
    a, b = acc.choices[0], acc.choices[1]
    assert (a.text, a.token_ids, a.deltas) == ("Hello", [1, 2], ["Hel", "lo"])
    assert (b.text, b.token_ids) == ("Goodbye", [9, 10, 11])
    assert [x.logprob for x in a.logprobs] == [-0.5] and b.logprobs == []
    assert (a.finish_reason, b.finish_reason) == (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert acc.prompt_token_ids == [5, 6, 7] and acc.usage is not None
    assert acc.usage.completion_tokens == 5


def test_a_choice_not_yet_seen_is_empty_and_unfinished() -> None:
    c = Accumulated().choice(3)
    assert (c.text, c.token_ids, c.finish_reason) == ("", [], pb.FINISH_REASON_UNSPECIFIED)
