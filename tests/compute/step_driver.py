"""Hand-built steps for driving the compute engine without a control plane.

Block ids are handed out from a shuffled pool so that a request's blocks are
neither contiguous nor in order, as they are in a long-running server. The pool is the
engine's first POOL blocks at most: on a GPU the engine sizes its pool from free memory
(millions of a tiny model's blocks), and a list of them all takes seconds to shuffle.
"""

from __future__ import annotations

import random

from hetero_proto import compute_pb2 as pb

GREEDY = pb.SamplingParams(temperature=0.0)
POOL = 1 << 20


class StepDriver:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(1, min(num_blocks, POOL)))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # tokens whose slots are allocated
        self.step_id = 0

    def _grow(self, rid: str, upto: int) -> list[int]:
        """Allocate blocks so that `upto` tokens fit; return the new block ids."""
        table = self.tables.setdefault(rid, [])
        need = -(-upto // self.block_size) - len(table)
        new = [self.free.pop() for _ in range(max(0, need))]
        table.extend(new)
        self.lengths[rid] = max(self.lengths.get(rid, 0), upto)
        return new

    def new(
        self,
        rid: str,
        tokens: list[int],
        num_scheduled: int,
        *,
        num_computed: int = 0,
        shared_blocks: list[int] | None = None,
        sampling: pb.SamplingParams = GREEDY,
    ) -> pb.NewRequest:
        if shared_blocks:
            self.tables[rid] = list(shared_blocks)
        self._grow(rid, num_computed + num_scheduled)
        return pb.NewRequest(
            request_id=rid,
            token_ids=tokens,
            num_prompt_tokens=len(tokens),
            num_computed_tokens=num_computed,
            num_scheduled_tokens=num_scheduled,
            block_ids=self.tables[rid],
            sampling=sampling,
        )

    def cont(self, rid: str, num_scheduled: int) -> pb.ContinuingRequest:
        new = self._grow(rid, self.lengths[rid] + num_scheduled)
        return pb.ContinuingRequest(
            request_id=rid, new_block_ids=new, num_scheduled_tokens=num_scheduled
        )

    def step(
        self,
        new: list[pb.NewRequest] = (),  # type: ignore[assignment]
        cont: list[pb.ContinuingRequest] = (),  # type: ignore[assignment]
        finished: list[str] = (),  # type: ignore[assignment]
        *,
        pack_decodes: bool = True,
    ) -> pb.StepRequest:
        """A step; a one-token continuation with no new block goes in decode_ids, as the
        control plane sends it (`pack_decodes=False` keeps every ContinuingRequest)."""
        self.step_id += 1
        packed = [
            c.request_id
            for c in cont
            if pack_decodes and c.num_scheduled_tokens == 1 and not c.new_block_ids
        ]
        return pb.StepRequest(
            step_id=self.step_id,
            new_requests=new,
            continuing=[c for c in cont if c.request_id not in packed],
            decode_ids=packed,
            finished_ids=finished,
        )
