"""Reading the packed deltas of a GenerateManyResponse (see control.proto, PackedDeltas).

for resp in message.responses: ...          # first the full responses,
for resp in packed_responses(message.packed):  # then the packed deltas, as responses
    ...
"""

from __future__ import annotations

from collections.abc import Iterator

from hetero_proto import control_pb2 as pb


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
