"""The KV block pool: block ids, refcounts, the free queue and the prefix-cache index.

Block 0 is the null block: never handed out. A free block may still hold a cached
prefix (its hash stays findable) until it is reallocated. The free queue is ordered
for eviction: blocks without a cached prefix go to the front (reused first), cached
ones to the back, so the prefixes used last survive longest (LRU).

    free queue:  [uncached ... | cached, least recently freed ... most recently freed]
                   ^ allocate() takes from here
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from hashlib import sha256

# A full block's prefix-cache key: SHA-256 of its parent block's key and its own token
# ids. A key stands for the whole prefix up to the block's end, so it must be
# collision-resistant: with an unkeyed 64-bit hash (Python's hash() of a tuple, which is
# invertible step by step) a prompt searched for offline could take another prompt's
# key, and a later request sharing only that key would attend to K/V computed from the
# other prompt (vLLM's CVE-2025-25183). Nothing else decides a block's K/V here: one
# model per compute plane, each plane its own pool, no adapters nor multimodal input.
# A request's cache salt (vLLM's `cache_salt`) is the one other input: it picks the
# chain's root, so it enters the first block's key and through it every later one.
BlockHash = bytes
ROOT_HASH: BlockHash = bytes(32)  # the parent of an unsalted prompt's first block
# Prefixed to a salt's UTF-8 bytes to make its root: a salted root is then the SHA-256 of
# bytes that no block key hashes (those start with a parent key: 32 zero bytes, or a
# SHA-256 digest that would have to start with this tag), so a salt cannot be chosen to
# make its root equal to some prompt's block key and its chain continue that prompt's.
_SALT_TAG = b"hetero-infer cache_salt\x00"


def root_hash(cache_salt: str = "") -> BlockHash:
    """The parent key of a prompt's first block: ROOT_HASH without a salt, else one of
    the salt's own, so that prompts under different salts share no block and prompts
    under one salt (or none) share as before."""
    if not cache_salt:
        return ROOT_HASH
    return sha256(_SALT_TAG + cache_salt.encode("utf-8", "surrogatepass")).digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, start: int, stop: int, parent: BlockHash = ROOT_HASH
) -> Iterator[BlockHash]:
    """Keys of full blocks start..stop-1 of `token_ids`, `parent` being block start-1's
    key: equal keys mean equal whole prefixes (a SHA-256 collision aside).
    Each token is 8 bytes (int64), every block block_size tokens, so the bytes hashed
    for a block are unambiguous; made lazily, so a lookup stops hashing at its miss."""
    data = array("q", token_ids[start * block_size : stop * block_size]).tobytes()
    width = 8 * block_size
    for offset in range(0, len(data), width):
        parent = sha256(parent + data[offset : offset + width]).digest()
        yield parent


class IntegrityError(RuntimeError):
    """The block pool's bookkeeping disagrees with itself (a bug, never bad input)."""


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    key: BlockHash | None = None  # set while the block is in the prefix-cache index


class Blocks(dict[int, Block]):
    """The pool's Block objects by id, each made when first looked up: a block never
    handed out is free, unreferenced and uncached, so it needs no object. A pool of a
    million blocks (a tiny model's, or a large GPU's) starts at once instead of after
    ~1 s of making them; iterating gives the blocks made so far."""

    def __missing__(self, block_id: int) -> Block:
        block = self[block_id] = Block(block_id)
        return block


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"{num_blocks} blocks: block 0 is reserved, at least 2 are needed")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = Blocks()
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[BlockHash, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[Block] | None:
        """n fresh blocks (ref 1), evicting cached prefixes if needed; None if too few are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block = self.blocks[self.free.popitem(last=False)[0]]
            if block.key is not None:
                del self.cached[block.key]
                block.key = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, key: BlockHash) -> Block | None:
        return self.cached.get(key)

    def share(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found in the prefix cache (or a parent's, on fork)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop a reference; blocks reaching 0 go back to the free queue in the given order."""
        for b in blocks:
            assert b.ref_cnt > 0, f"block {b.block_id} released more often than taken"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free[b.block_id] = None
                if b.key is None:
                    self.free.move_to_end(b.block_id, last=False)

    def cache(self, block: Block, key: BlockHash) -> None:
        """Index a full, computed block by its chained hash (first writer wins)."""
        if self.enable_caching and block.key is None and key not in self.cached:
            block.key = key
            self.cached[key] = block

    def num_free_among(self, blocks: list[Block]) -> int:
        return sum(1 for b in blocks if b.ref_cnt == 0)

    def check_integrity(self) -> None:
        """free + in use == usable; the index and the free queue agree with the blocks.

        Raises IntegrityError (a real check: it stays under `python -O`)."""
        in_use = sum(1 for b in self.blocks.values() if b.ref_cnt > 0 and b.block_id != 0)
        if self.blocks[0].ref_cnt != 0 or 0 in self.free:
            raise IntegrityError("null block handed out")
        if in_use + len(self.free) != self.num_usable:
            raise IntegrityError(
                f"{in_use} in use + {len(self.free)} free != {self.num_usable} usable blocks"
            )
        for bid in self.free:
            if bid in self.blocks and self.blocks[bid].ref_cnt != 0:
                raise IntegrityError(f"free block {bid} has references")
        for key, b in self.cached.items():
            if b.key != key:
                raise IntegrityError(f"cache index disagrees with block {b.block_id}")
