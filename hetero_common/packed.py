"""Packed deltas of a GenerateManyResponse (see control.proto, PackedDeltas): the writer
the control plane fills and the reader a client uses, side by side.

for resp in message.responses: ...          # first the full responses,
for resp in packed_responses(message.packed):  # then the packed deltas, as responses
    ...
"""

from __future__ import annotations

from collections.abc import Iterator

from hetero_proto import control_pb2 as pb


class PackedDeltaWriter:
    """Plain deltas (choice 0, text and tokens, not the last) gathered as parallel lists,
    written into one message's `packed` field at the end."""

    __slots__ = ("counts", "request_ids", "seen", "texts", "tokens")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.texts: list[str] = []
        self.counts: list[int] = []
        self.tokens: list[int] = []
        self.seen: set[str] = set()  # request_ids as a set

    def __bool__(self) -> bool:
        return bool(self.request_ids)

    def add(self, request_id: str, token_ids: list[int], text: str) -> None:
        self.request_ids.append(request_id)
        self.texts.append(text)
        self.counts.append(len(token_ids))
        self.tokens += token_ids
        self.seen.add(request_id)

    def write(self, packed: pb.PackedDeltas) -> None:
        packed.request_ids.extend(self.request_ids)
        packed.texts.extend(self.texts)
        packed.num_tokens.extend(self.counts)
        packed.token_ids.extend(self.tokens)


def packed_responses(packed: pb.PackedDeltas) -> Iterator[pb.GenerateResponse]:
    """Each packed delta as the GenerateResponse it stands for, in order."""
    tokens = packed.token_ids
    sizes = {len(packed.request_ids), len(packed.texts), len(packed.num_tokens)}
    if len(sizes) > 1 or sum(packed.num_tokens) != len(tokens):  # checked before any yield
        raise ValueError(
            f"packed deltas: {len(packed.request_ids)} request_ids, {len(packed.texts)} texts "
            f"and {len(packed.num_tokens)} num_tokens adding up to {sum(packed.num_tokens)}, "
            f"for {len(tokens)} token_ids"
        )
    at = 0
    for rid, text, count in zip(packed.request_ids, packed.texts, packed.num_tokens, strict=True):
        resp = pb.GenerateResponse(request_id=rid)
        delta = resp.choices.add()
        delta.text = text
        delta.token_ids.extend(tokens[at : at + count])
        delta.stop_token_id = -1
        at += count
        yield resp
