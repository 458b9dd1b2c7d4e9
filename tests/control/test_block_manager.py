"""Block pool and page tables: exact ids in tiny pools, and a random-operations state machine."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from control_plane.block_manager import BlockManager
from control_plane.request import Request

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, max_tokens=8)


def _admit(bm: BlockManager, req: Request) -> list[int] | None:
    """What the scheduler does on admission: prefix lookup, then room for the rest."""
    prefix = bm.find_prefix(req)
    req.num_computed_tokens = len(prefix) * BS
    new = bm.allocate(req, req.num_tokens - req.num_computed_tokens, prefix)
    return new


def _compute_all(bm: BlockManager, req: Request) -> None:
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed(req)


def test_a_large_pool_makes_only_the_blocks_it_hands_out() -> None:
    """Block objects are made when a block is first handed out, so a pool of millions
    (a tiny model's KV budget) costs nothing per block to set up; ids are as before."""
    bm = BlockManager(num_blocks=1_000_000, block_size=BS)
    assert len(bm.pool.blocks) == 0 and bm.num_free_blocks == 999_999
    a = _req("a", list(range(9)))
    assert _admit(bm, a) == [1, 2, 3]
    assert sorted(bm.pool.blocks) == [1, 2, 3]
    bm.check_integrity()
    bm.free(a)
    assert bm.num_free_blocks == 999_999
    bm.check_integrity()


def test_exact_ids_and_free_order() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = _req("a", list(range(9)))
    assert _admit(bm, a) == [1, 2, 3]
    _compute_all(bm, a)
    b = _req("b", [50, 51])
    assert _admit(bm, b) == [4]
    assert bm.num_free_blocks == 1  # block 5
    bm.free(a)
    # a's partial block 3 (uncached) goes to the front; full cached blocks 2 then 1 to the back.
    assert list(bm.pool.free) == [3, 5, 2, 1]
    bm.check_integrity()


def test_slot_usage_counts_shared_blocks_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(9)))  # blocks 1, 2 full; block 3 holds 1 of 4
    _admit(bm, a)
    assert bm.slot_usage([a]) == (9, 12)  # slots of known tokens count before they are computed
    _compute_all(bm, a)
    assert bm.slot_usage([a]) == (9, 12)
    a.token_ids.append(7)  # the 10th token's slot is in block 3 already
    assert bm.slot_usage([a]) == (10, 12)
    b = _req("b", [*range(8), 99, 98])  # shares blocks 1, 2; block 4 holds 2
    _admit(bm, b)
    b.num_computed_tokens = b.num_tokens
    assert bm.slot_usage([a, b]) == (10 + 2, 16)


def test_prefix_hit_shares_blocks_and_is_capped() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = _req("a", list(range(9)))
    _admit(bm, a)
    _compute_all(bm, a)
    # Same first 8 tokens: both full blocks hit.
    b = _req("b", [*range(8), 99])
    assert _admit(bm, b) == [4]
    assert b.num_computed_tokens == 8 and bm.block_ids("b") == [1, 2, 4]
    assert bm.pool.blocks[1].ref_cnt == 2
    # A prompt of exactly 8 matching tokens may reuse only the first block: one token must run.
    c = _req("c", list(range(8)))
    assert _admit(bm, c) == [5]
    assert c.num_computed_tokens == 4 and bm.block_ids("c") == [1, 5]
    bm.check_integrity()


def test_freed_cached_blocks_are_evicted_last_and_lose_their_hash() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)  # usable: 1, 2, 3
    a = _req("a", list(range(8)))  # two full blocks, both cached once computed
    _admit(bm, a)
    _compute_all(bm, a)
    bm.free(a)
    assert list(bm.pool.free) == [3, 2, 1]  # fresh block first, then a's tail, then its head
    b = _req("b", [7, 7, 7])
    assert _admit(bm, b) == [3]
    c = _req("c", [8, 8, 8, 8, 8])  # needs 2 blocks: evicts cached 2 (a's tail) then 1
    assert _admit(bm, c) == [2, 1]
    assert bm.find_prefix(_req("d", [*range(8), 1])) == []  # the prefix is gone
    bm.check_integrity()


def test_a_prefix_hit_needs_the_whole_prefix_not_a_hash_of_it() -> None:
    """A block is found only under its whole prefix, never another prefix that hashes
    alike. Keyed by (Python hash() of the parent's key, its tokens), a prompt searched
    for offline (hash() is unkeyed, 64-bit and invertible step by step) could take a
    system prompt's chain hash, and a victim's next block was then served the K/V the
    attacker's prompt computed. Here ids equal modulo 2**61 - 1 (hash(n) is n modulo
    that) make such a pair: the attacker's first block hashes as the system prompt's."""
    twin = 5 + (2**61 - 1)
    assert hash((0, (5, 1, 2, 3))) == hash((0, (twin, 1, 2, 3)))  # the old keys' collision
    bm = BlockManager(num_blocks=16, block_size=BS)
    system = _req("system", [5, 1, 2, 3, 60])  # the shared system prompt is cached: block 1
    _admit(bm, system)
    _compute_all(bm, system)
    attacker = _req("attacker", [twin, 1, 2, 3, 10, 11, 12, 13, 70])  # its blocks: 3, 4
    _admit(bm, attacker)
    _compute_all(bm, attacker)
    assert bm.block_ids("attacker")[:2] == [3, 4]
    victim = _req("victim", [5, 1, 2, 3, 10, 11, 12, 13, 80])
    assert [b.block_id for b in bm.find_prefix(victim)] == [1]  # not [1, 4]
    assert _admit(bm, victim) == [6, 7]
    assert victim.num_computed_tokens == 4
    bm.check_integrity()


def test_fork_shares_full_blocks_only() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = _req("p", list(range(10)))
    _admit(bm, parent)
    _compute_all(bm, parent)
    child = _req("c", list(range(10)))
    assert bm.fork(parent, child) == 8
    assert bm.block_ids("c") == bm.block_ids("p")[:2]
    assert [bm.pool.blocks[i].ref_cnt for i in bm.block_ids("c")] == [2, 2]
    assert bm.allocate(child, 2) == [4]  # the tail is recomputed into its own block
    bm.check_integrity()
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 7
    bm.check_integrity()


def test_allocate_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = _req("a", list(range(12)))
    assert _admit(bm, a) is None
    assert bm.num_free_blocks == 2 and not bm.holds_blocks("a")
    bm.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / prefix-hit sequences on a small pool, with
    the KV cache written as a compute plane would: a reused block holds the K/V of the
    same whole prefix, and no request writes into a block another one holds."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=BS)
        self.live: dict[str, Request] = {}
        self.next_id = 0
        # The KV cache as the compute plane would hold it: each slot's K/V stand for the
        # whole prefix up to its position (the token and every token before it).
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def _compute(self, req: Request) -> None:
        """Write the request's uncomputed positions, then count them computed. A block
        written is held by this request alone (another's K/V would be overwritten)."""
        table = self.bm.block_ids(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_tokens):
            block = table[pos // BS]
            assert self.bm.pool.blocks[block].ref_cnt == 1, f"write into shared block {block}"
            self.kv[block, pos % BS] = tuple(req.token_ids[: pos + 1])
        _compute_all(self.bm, req)

    def _check_reused(self, req: Request) -> None:
        """The blocks it starts with (a prefix hit, a fork) hold its own prefix's K/V."""
        table = self.bm.block_ids(req.request_id)
        for pos in range(req.num_computed_tokens):
            got = self.kv.get((table[pos // BS], pos % BS))
            assert got == tuple(req.token_ids[: pos + 1]), f"{req.request_id} reuses wrong K/V"

    @rule(n=st.integers(1, 14), vocab=st.integers(1, 3))
    def admit(self, n: int, vocab: int) -> None:
        # A tiny vocabulary makes prefix hits frequent.
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = _req(rid, [(i * 7) % vocab for i in range(n)])
        if _admit(self.bm, req) is not None:
            self._check_reused(req)
            self._compute(req)
            self.live[rid] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.token_ids.append(data.draw(st.integers(0, 2)))
        if self.bm.allocate(req, 1) is not None:
            self._compute(req)
        else:
            req.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = _req(f"r{self.next_id}", list(parent.token_ids))
        self.next_id += 1
        self.bm.fork(parent, child)
        if self.bm.allocate(child, child.num_tokens - child.num_computed_tokens) is None:
            self.bm.free(child)
            return
        self._check_reused(child)
        self._compute(child)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.bm.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @invariant()
    def consistent(self) -> None:
        self.bm.check_integrity()  # refcount == number of tables holding each block
        for rid, req in self.live.items():
            ids = self.bm.block_ids(rid)
            assert 0 not in ids
            assert len(ids) * BS >= req.num_tokens
        # A block in two live tables is a full block with the same tokens in both (prefix or fork).
        owners: dict[int, list[tuple[str, int]]] = {}
        for rid in self.live:
            for pos, b in enumerate(self.bm.block_ids(rid)):
                owners.setdefault(b, []).append((rid, pos))
        for b, holders in owners.items():
            if len(holders) > 1:
                contents = {
                    tuple(self.live[rid].token_ids[pos * BS : (pos + 1) * BS])
                    for rid, pos in holders
                }
                assert len(contents) == 1, f"block {b} shared by different contents"
                assert all(len(c) == BS for c in contents), f"partial block {b} shared"

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.bm.free(req)
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == 9


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def _advance(bm: BlockManager, req: Request, token: int) -> list[int] | None:
    """Append a token, room for it, compute it; then give back what left the window."""
    req.token_ids.append(token)
    if bm.allocate(req, 1) is None:
        req.token_ids.pop()
        return None
    _compute_all(bm, req)
    return bm.release_outside_window(req)


def test_blocks_that_left_the_window_are_given_back() -> None:
    """window 5, blocks of 4: the query at position p sees p - 4 .. p, so block i goes
    once the next query is at 4i + 8 (after that many tokens are computed)."""
    bm = BlockManager(num_blocks=6, block_size=BS, window=5)  # usable: 1..5
    a = _req("a", list(range(7)))
    assert _admit(bm, a) == [1, 2]
    _compute_all(bm, a)
    assert bm.release_outside_window(a) == []  # next query at 7 sees 3..7: block 1 needed
    assert _advance(bm, a, 7) == [1]  # next query at 8 sees 4..8: block 1 (0..3) is out
    assert bm.block_ids("a") == [1, 2] and bm.held_block_ids("a") == [2]
    assert bm.num_free_blocks == 4 and bm.pool.blocks[1].ref_cnt == 0
    assert list(bm.pool.free) == [3, 4, 5, 1]  # cached before it went: evicted last
    bm.check_integrity()
    for t in range(8, 11):
        assert _advance(bm, a, t) == []
    assert bm.block_ids("a") == [1, 2, 3]
    assert _advance(bm, a, 11) == [2]  # next query at 12 sees 8..12
    assert list(bm.pool.free) == [4, 5, 1, 2]
    # A new request with a's first block of tokens hits it in the prefix cache.
    b = _req("b", [0, 1, 2, 3, 99])
    assert _admit(bm, b) == [4] and bm.block_ids("b") == [1, 4]
    assert bm.pool.blocks[1].ref_cnt == 1
    bm.check_integrity()
    bm.free(a)  # only the blocks a still holds go back
    bm.free(b)
    assert bm.num_free_blocks == 5
    bm.check_integrity()


def test_a_fork_of_a_request_past_its_window_recomputes() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS, window=4)
    parent = _req("p", list(range(10)))
    _admit(bm, parent)
    _compute_all(bm, parent)
    assert bm.release_outside_window(parent) == [1]  # next query at 10 sees 7..10
    child = _req("c", list(range(10)))
    assert bm.fork(parent, child) == 0 and bm.block_ids("c") == []
    bm.check_integrity()


class WindowedPoolMachine(PoolMachine):
    """The same operations with a window of 6: appends give back what left it."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=BS, window=6)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.token_ids.append(data.draw(st.integers(0, 2)))
        if self.bm.allocate(req, 1) is None:
            req.token_ids.pop()
            return
        self._compute(req)
        self.bm.release_outside_window(req)

    @invariant()
    def consistent(self) -> None:
        self.bm.check_integrity()
        owners: dict[int, list[tuple[str, int]]] = {}
        for rid, req in self.live.items():
            table = self.bm.block_ids(rid)
            held = self.bm.held_block_ids(rid)
            assert len(table) * BS >= req.num_tokens and table[len(table) - len(held) :] == held
            # What a later query needs (positions > num_computed - 6) is all held.
            first_needed = max(0, req.num_computed_tokens - 6 + 1) // BS
            assert len(table) - len(held) <= first_needed
            for pos in range(len(table) - len(held), len(table)):
                owners.setdefault(table[pos], []).append((rid, pos))
        for b, holders in owners.items():
            contents = {
                tuple(self.live[rid].token_ids[pos * BS : (pos + 1) * BS]) for rid, pos in holders
            }
            assert len(holders) == 1 or len(contents) == 1, (
                f"block {b} shared by different contents"
            )


TestWindowedPoolMachine = WindowedPoolMachine.TestCase
TestWindowedPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
