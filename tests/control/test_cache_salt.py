"""cache_salt (vLLM's): prefix-cache blocks are shared only by requests of one salt (or
none). Exact block ids in tiny pools, the n > 1 fork and the keys placement compares."""

from __future__ import annotations

from array import array

import pytest

from control_plane.block_manager import BlockManager
from control_plane.block_pool import IntegrityError
from control_plane.engine import prompt_keys
from control_plane.request import Request
from control_plane.scheduler import Scheduler

BS = 4


def _req(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request(rid, tokens, max_tokens=8, cache_salt=salt)


def _admit(bm: BlockManager, req: Request) -> list[int] | None:
    """What the scheduler does on admission: prefix lookup, then room for the rest."""
    prefix = bm.find_prefix(req)
    req.num_computed_tokens = len(prefix) * BS
    return bm.allocate(req, req.num_tokens - req.num_computed_tokens, prefix)


def _compute_all(bm: BlockManager, req: Request) -> None:
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed(req)


def test_one_prompt_under_two_salts_shares_no_block_and_under_one_salt_shares() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(9))  # blocks 0..3, 4..7 full; token 8 is always computed
    a = _req("a", prompt, "tenant-a")
    assert _admit(bm, a) == [1, 2, 3]
    _compute_all(bm, a)
    b = _req("b", prompt, "tenant-b")
    assert _admit(bm, b) == [4, 5, 6]  # nothing of a's
    assert b.num_computed_tokens == 0
    _compute_all(bm, b)
    plain = _req("plain", prompt)  # no salt: nothing of either
    assert _admit(bm, plain) == [7, 8, 9]
    assert plain.num_computed_tokens == 0
    _compute_all(bm, plain)
    # Six full blocks, six keys: the salt changed every block's key, not only the first's.
    assert len(bm.pool.cached) == 6
    # The same salt (or none) shares as before.
    a2 = _req("a2", prompt, "tenant-a")
    assert _admit(bm, a2) == [10]
    assert bm.block_ids("a2") == [1, 2, 10] and a2.num_computed_tokens == 8
    b2 = _req("b2", [*range(8), 99], "tenant-b")
    assert _admit(bm, b2) == [11]
    assert bm.block_ids("b2") == [4, 5, 11]
    plain2 = _req("plain2", prompt)
    assert _admit(bm, plain2) == [12]
    assert bm.block_ids("plain2") == [7, 8, 12]
    bm.check_integrity()


def test_a_salt_that_differs_only_by_case_or_space_is_another_salt() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = _req("a", list(range(5)), "Tenant")
    _admit(bm, a)
    _compute_all(bm, a)
    for i, salt in enumerate(("tenant", "Tenant ", " Tenant", "Tenant\x00")):
        assert bm.find_prefix(_req(f"x{i}", list(range(5)), salt)) == [], salt
    assert [b.block_id for b in bm.find_prefix(_req("y", list(range(5)), "Tenant"))] == [1]


def test_a_salt_cannot_continue_another_prompts_chain() -> None:
    """A salted chain's root is no block's key: were it the SHA-256 of the root key and
    the salt's bytes (a block's key is that of its parent key and its tokens' bytes), a
    salt spelling a block's token ids as int64 bytes would make its root that block's
    key, and a salted prompt would be served the blocks after it in an unsalted prompt
    (another tenant's cache read, or K/V written for it). Here the salt is the bytes of
    the victim's first block; the attacker's prompt is the victim's, less that block."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    victim = _req("victim", [5, 1, 2, 3, 10, 11, 12, 13, 80])
    _admit(bm, victim)
    _compute_all(bm, victim)
    salt = array("q", [5, 1, 2, 3]).tobytes().decode("ascii")  # (a valid JSON string too)
    attacker = _req("attacker", [10, 11, 12, 13, 80], salt)
    assert bm.find_prefix(attacker) == []
    assert _admit(bm, attacker) == [4, 5]
    bm.check_integrity()


def test_forked_choices_share_the_prompt_under_its_salt() -> None:
    """n > 1: the choices of a salted request share its prompt blocks; a child's own
    blocks are cached under the salt (found by the salt's requests, not by others)."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    parent = _req("p", list(range(10)), "s")
    assert _admit(bm, parent) == [1, 2, 3]
    _compute_all(bm, parent)
    child = _req("c", list(range(10)), "s")
    assert bm.fork(parent, child) == 8
    assert bm.block_ids("c") == [1, 2]
    assert bm.allocate(child, 2 + 2) == [4]  # its tail and 2 sampled tokens fill block 4
    child.token_ids += [90, 91]
    _compute_all(bm, child)
    grown = [*range(10), 90, 91, 7]
    assert [b.block_id for b in bm.find_prefix(_req("s2", grown, "s"))] == [1, 2, 4]
    assert bm.find_prefix(_req("t", grown, "t")) == []
    assert bm.find_prefix(_req("u", grown)) == []
    with pytest.raises(IntegrityError, match="another cache salt"):
        bm.fork(parent, _req("other", list(range(10)), "t"))
    bm.check_integrity()


def test_the_scheduler_forks_a_salted_request_and_finds_its_prefix_by_salt() -> None:
    """Through the scheduler's own admission: a salted n = 2 request's second choice
    forks the first's prompt blocks; later requests hit them under that salt only."""
    sched = Scheduler(num_blocks=32, block_size=BS, max_model_len=64)
    first, second = _one_token("r-0", "s"), _one_token("r-1", "s")
    tables = _run(sched, [first, second], forks={"r-1": first})
    assert tables["r-1"][:2] == tables["r-0"][:2] and second.num_computed_tokens >= 8
    hit, miss, plain = _one_token("h", "s"), _one_token("m", "t"), _one_token("p", "")
    tables |= _run(sched, [hit, miss, plain])
    assert (hit.num_cached_tokens, miss.num_cached_tokens, plain.num_cached_tokens) == (8, 0, 0)
    assert tables["h"][:2] == tables["r-0"][:2]
    assert not set(tables["m"]) & set(tables["r-0"])
    assert not set(tables["p"]) & (set(tables["r-0"]) | set(tables["m"]))
    sched.block_manager.check_integrity()


def _one_token(rid: str, salt: str) -> Request:
    return Request(rid, list(range(9)), max_tokens=1, ignore_eos=True, cache_salt=salt)


def _run(
    sched: Scheduler, requests: list[Request], forks: dict[str, Request] | None = None
) -> dict[str, list[int]]:
    """Run to the end (each prompt's token sampled as 7); each request's page table as
    the compute plane first gets it."""
    for r in requests:
        sched.add_request(r, fork_of=(forks or {}).get(r.request_id))
    tables: dict[str, list[int]] = {}
    for _ in range(100):
        if not sched.has_work:
            break
        out = sched.schedule()
        for new in out.new:
            tables[new.request.request_id] = list(new.block_ids)
        done = [r for r, n in out.scheduled() if r.num_computed_tokens + n >= r.num_tokens]
        sched.update(out, {r.request_id: 7 for r in done})
    assert all(r.status.finished for r in requests)
    return tables


def test_placement_keys_are_the_keys_the_salted_prompt_is_cached_under() -> None:
    """ControlEngine._place compares a prompt's keys with what each compute plane's pool
    caches: a salted prompt's keys must be those its blocks are cached under (else a
    salted request is routed to where the unsalted prompt is, and misses there)."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))
    a = _req("a", prompt, "s")
    _admit(bm, a)
    _compute_all(bm, a)
    keys = prompt_keys(prompt, BS, "s")
    assert len(keys) == 3 and set(keys) == set(bm.pool.cached)
    assert not set(prompt_keys(prompt, BS)) & set(bm.pool.cached)
    assert not set(prompt_keys(prompt, BS, "t")) & set(bm.pool.cached)
