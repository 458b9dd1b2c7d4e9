"""Page tables: which blocks hold each request's tokens; prefix hits, growth, fork, free.

Token t of a request lives in block `table[t // block_size]` at offset
`t % block_size`. Full, computed blocks are indexed by a chained hash so that a later
request with the same prefix (and the same cache salt, or none) reuses them instead of
recomputing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from control_plane.block_pool import (
    Block,
    BlockHash,
    BlockPool,
    IntegrityError,
    chain_hashes,
    root_hash,
)
from control_plane.request import Request


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """The pool at one moment: what metrics and ModelInfo report."""

    num_free_blocks: int  # usable blocks no request holds (cached-free included)
    num_usable_blocks: int  # all but the null block
    prefix_queries: int  # prompt tokens looked up in the prefix cache, ever
    prefix_hits: int  # of which found

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        # Every layer of the model sees only the last `window` positions: blocks that left
        # it are given back while the request runs (release_outside_window).
        self.window = window
        self._tables: dict[str, list[Block]] = {}
        # Leading entries of a table given back (outside the window): they still map the
        # request's positions to block ids, which the compute plane never reads, but the
        # request no longer holds them.
        self._released: dict[str, int] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table already indexed
        self._last_hash: dict[str, BlockHash] = {}  # the key of each table's last indexed block
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            self.pool.num_free, self.pool.num_usable, self.prefix_queries, self.prefix_hits
        )

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def has_free_slot(self, req: Request) -> bool:
        """The request's next token fits a block it holds (no allocation needed)."""
        return req.num_computed_tokens < len(self._tables[req.request_id]) * self.block_size

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count a request's prefix-cache lookup at its first admission (not again when it
        is re-admitted after preemption, nor when it skipped the lookup)."""
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def slot_usage(self, requests: Iterable[Request]) -> tuple[int, int]:
        """(slots holding a token, slots of the blocks they hold); shared blocks once.

        A slot holds a token when that token is known (prompt or sampled), whether its
        K/V are already computed or being written by the step in flight; the rest of
        an allocated block (the unfilled tail of each last block) is the waste.
        """
        bs = self.block_size
        filled: dict[int, int] = {}
        for req in requests:
            table = self._tables.get(req.request_id, [])
            for i in range(self._released.get(req.request_id, 0), len(table)):
                block = table[i]
                n = min(bs, max(0, req.num_tokens - i * bs))
                filled[block.block_id] = max(n, filled.get(block.block_id, 0))
        return sum(filled.values()), len(filled) * bs

    def block_ids(self, request_id: str) -> list[int]:
        """The request's page table: every position's block (given-back ones included)."""
        return [b.block_id for b in self._tables.get(request_id, [])]

    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request still holds (the page table less those given back)."""
        start = self._released.get(request_id, 0)
        return [b.block_id for b in self._tables.get(request_id, [])[start:]]

    def find_prefix(self, req: Request) -> list[Block]:
        """Cached blocks holding a prefix of `req`, capped so at least one token is left to compute."""
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[Block] = []
        if not self.pool.enable_caching:
            return hits
        for key in chain_hashes(req.token_ids, bs, 0, max_blocks, root_hash(req.cache_salt)):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # ------------------------------------------------------------------ changes
    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks a held request needs beyond its own for `num_new_tokens` more tokens."""
        held = len(self._tables.get(req.request_id, ()))
        return max(0, -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - held)

    def allocate(
        self, req: Request, num_new_tokens: int, prefix: list[Block] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; return the appended block ids.

        `prefix` (first admission only) are cache hits to share; the request's
        num_computed_tokens must already count them. None when the pool is short:
        then nothing changed.
        """
        table = self._tables.get(req.request_id)
        held = len(table) if table is not None else len(prefix or ())
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - held
        if need <= 0 and table is not None:
            return []  # fits in the blocks it holds (most decode steps)
        prefix = prefix or []
        # Shared prefix blocks sitting in the free queue stop being free once taken.
        if max(0, need) + self.pool.num_free_among(prefix) > self.pool.num_free:
            return None
        if table is None:
            self.pool.share(prefix)
            table = self._tables[req.request_id] = list(prefix)
            self._num_hashed[req.request_id] = len(prefix)
            last = prefix[-1].key if prefix else root_hash(req.cache_salt)
            assert last is not None, "a prefix hit that is not in the prefix cache"
            self._last_hash[req.request_id] = last
        new = self.pool.allocate(max(0, need)) or []
        table.extend(new)
        return [b.block_id for b in new]

    def cache_computed(self, req: Request) -> None:
        """Index blocks that became full and computed (call after each step). With steps
        in flight (async scheduling) a block is indexed once its tokens are known: with
        two or more ahead, positions counted as computed can still hold a placeholder."""
        rid = req.request_id
        table = self._tables[rid]
        bs = self.block_size
        done = self._num_hashed[rid]
        known = min(req.num_computed_tokens, len(req.token_ids) - req.num_pending)
        full = min(known // bs, len(table))
        if full <= done:
            return  # no block became full since the last call
        keys = list(chain_hashes(req.token_ids, bs, done, full, self._last_hash[rid]))
        for block, key in zip(table[done:full], keys, strict=True):
            self.pool.cache(block, key)
        self._num_hashed[rid] = full
        self._last_hash[rid] = keys[-1]

    def fork(self, parent: Request, child: Request) -> int:
        """Share the parent's full computed blocks with `child` (n > 1); returns tokens shared.

        Only full blocks are shared: a partly filled block would be written by both,
        so the child recomputes that tail into a block of its own (copy-on-write by
        recompute). The child's num_computed_tokens is set to the shared length.
        """
        if child.request_id in self._tables:
            raise IntegrityError(f"fork into {child.request_id!r}, which holds blocks")
        if child.cache_salt != parent.cache_salt:  # (the choices of one request share it)
            raise IntegrityError(f"fork into {child.request_id!r} under another cache salt")
        n = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        if self._released.get(parent.request_id):
            n = 0  # the window the child's next tokens need is partly gone: recompute
        shared = self._tables[parent.request_id][:n]
        self.pool.share(shared)
        self._tables[child.request_id] = list(shared)
        self._num_hashed[child.request_id] = 0
        self._last_hash[child.request_id] = root_hash(child.cache_salt)
        child.num_computed_tokens = n * self.block_size
        return child.num_computed_tokens

    def release_outside_window(self, req: Request) -> list[int]:
        """Give back the request's blocks that every later query of it is past: with
        `window`, the query at position p sees positions > p - window, and the next query
        is at num_computed_tokens or later. They are indexed for the prefix cache first,
        while still held. Returns the block ids given back."""
        if self.window is None:
            return []
        rid = req.request_id
        table = self._tables[rid]
        done = self._released.get(rid, 0)
        dead = min(len(table), max(0, req.num_computed_tokens - self.window + 1) // self.block_size)
        if dead <= done:
            return []
        self.cache_computed(req)
        self.pool.release(table[done:dead])
        self._released[rid] = dead
        return [b.block_id for b in table[done:dead]]

    def free(self, req: Request) -> None:
        """Give back the request's blocks, tail first so its last blocks are evicted first."""
        table = self._tables.pop(req.request_id, None)
        self._num_hashed.pop(req.request_id, None)
        self._last_hash.pop(req.request_id, None)
        done = self._released.pop(req.request_id, 0)
        if table:
            self.pool.release(table[done:][::-1])

    def check_integrity(self) -> None:
        """Pool consistency, and refcounts equal the number of tables holding each block.

        Walks every table: O(blocks + held blocks). Raises IntegrityError."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for rid, table in self._tables.items():
            for b in table[self._released.get(rid, 0) :]:
                holders[b.block_id] += 1
        for b in self.pool.blocks.values():  # (a block never made is held by no table)
            if b.ref_cnt != holders[b.block_id]:
                raise IntegrityError(
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by "
                    f"{holders[b.block_id]} tables"
                )
