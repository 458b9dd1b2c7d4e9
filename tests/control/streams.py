"""What the control-plane tests read off a Generate stream of the control engine."""

from __future__ import annotations

from control_plane.outputs import GenerateStream
from hetero_common.accumulate import Accumulated


async def stream_tokens(stream: GenerateStream, errors: bool = False) -> list[int] | BaseException:
    """The first choice's token ids once the stream ends; an error the stream raises is
    returned with `errors`, else it fails the test."""
    acc = Accumulated()
    while True:
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            assert errors, item
            return item
        if acc.add(item):
            return acc.choice(0).token_ids
