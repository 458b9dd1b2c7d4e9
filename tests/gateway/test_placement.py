"""Placement of generate calls on control planes (gateway.placement): the hash ring
spreads keys evenly and moves few when a plane joins or leaves, shared prefixes meet,
and load or a plane that is down sends a call on along its ring."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.placement import (
    AFFINITY,
    KEY_CHARS,
    KEY_TOKENS,
    LOAD,
    LOAD_SLACK,
    UNAVAILABLE,
    HashRing,
    choose,
    overloaded,
    routing_key,
)
from hetero_proto import control_pb2 as pb

NODES = [f"10.0.0.{i}:50051" for i in range(1, 5)]
KEYS = [f"text:prompt number {i}" for i in range(20_000)]


def owners(ring: HashRing) -> list[str]:
    return [next(ring.walk(k)) for k in KEYS]


def test_keys_spread_evenly() -> None:
    shares = Counter(owners(HashRing(NODES)))
    assert set(shares) == set(NODES)
    for node in NODES:  # 64 points a node: each within 25% of a fair share
        assert abs(shares[node] / len(KEYS) - 1 / len(NODES)) < 0.25 / len(NODES), shares


def test_a_joining_plane_takes_about_its_share_and_nothing_else_moves() -> None:
    before = owners(HashRing(NODES[:3]))
    after = owners(HashRing(NODES))
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert all(b == NODES[3] for _, b in moved)  # only onto the new plane
    assert 0.15 < len(moved) / len(KEYS) < 0.35  # ~1/4


def test_a_leaving_plane_gives_up_its_keys_only() -> None:
    before = owners(HashRing(NODES))
    after = owners(HashRing(NODES[:3]))
    for a, b in zip(before, after, strict=True):
        assert a == b or a == NODES[3]
    assert 0.15 < sum(a == NODES[3] for a in before) / len(KEYS) < 0.35


def test_walk_gives_every_node_once_starting_with_the_owner() -> None:
    ring = HashRing(NODES)
    for key in KEYS[:200]:
        order = list(ring.walk(key))
        assert sorted(order) == sorted(NODES)
    assert list(HashRing([]).walk("x")) == []
    # The ring depends only on the node names: another gateway places keys the same way.
    assert owners(HashRing(reversed(NODES))) == owners(HashRing(NODES))


def test_shared_prefixes_share_a_key() -> None:
    preamble = "You are a helpful assistant. " * 20  # longer than KEY_CHARS
    assert len(preamble) > KEY_CHARS
    a = pb.GenerateRequest(text=preamble + "What is 2 + 2?")
    b = pb.GenerateRequest(text=preamble + "Name a colour.")
    assert routing_key(a) == routing_key(b)
    assert routing_key(pb.GenerateRequest(text="short one")) != routing_key(
        pb.GenerateRequest(text="short two")
    )
    ids = list(range(KEY_TOKENS))
    assert routing_key(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[*ids, 1]))) == routing_key(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[*ids, 2]))
    )

    def chat(*contents: str) -> pb.GenerateRequest:
        call = pb.GenerateRequest()
        roles = ["system", "user", "assistant", "user"]
        for role, content in zip(roles, contents, strict=False):
            call.chat.messages.add(role=role, content=content)
        return call

    # A conversation's later turns meet its first (the same system prompt and question).
    system = "You answer questions about the solar system. " * 6
    first = chat(system, "How far is Mars?")
    later = chat(system, "How far is Mars?", "About 225 million km.", "And Jupiter?")
    assert routing_key(first) == routing_key(later)
    assert routing_key(chat("Be brief.", "Hi")) != routing_key(chat("Be brief.", "Hello"))


def test_a_cache_salt_keys_its_own_prefixes() -> None:
    # Prefix-cache blocks are shared only within one salt: each tenant's prefix is its own
    # key (its requests meet on one plane), and tenants of one system prompt spread.
    preamble = "You are a helpful assistant. " * 20

    def call(text: str, salt: str = "") -> pb.GenerateRequest:
        return pb.GenerateRequest(text=text, params=pb.GenerationParams(cache_salt=salt))

    assert routing_key(call(preamble + "A?", "tenant-1")) == routing_key(
        call(preamble + "B?", "tenant-1")
    )
    assert routing_key(call(preamble, "tenant-1")) != routing_key(call(preamble, "tenant-2"))
    assert routing_key(call(preamble, "tenant-1")) != routing_key(call(preamble))
    # No salt: the key is the content's alone, as before salts existed.
    assert routing_key(call(preamble)) == "text:" + preamble[:KEY_CHARS]
    # A salt cannot spell another salt followed by content.
    assert routing_key(call("x", "a")) != routing_key(call("", "a|text:x"))
    chat = pb.GenerateRequest(params=pb.GenerationParams(cache_salt="t"))
    chat.chat.messages.add(role="user", content="Hi")
    plain = pb.GenerateRequest()
    plain.chat.messages.add(role="user", content="Hi")
    assert routing_key(chat) != routing_key(plain)
    ring = HashRing(NODES)
    tenants = Counter(next(ring.walk(routing_key(call(preamble, f"t{i}")))) for i in range(400))
    assert set(tenants) == set(NODES)
    assert max(tenants.values()) < 0.4 * 400  # an even split is 25 % each


def test_choose_prefers_the_keys_own_plane() -> None:
    order = ["a", "b", "c"]
    up = dict.fromkeys(order, True)
    assert choose(order, up, {"a": 3, "b": 0, "c": 0}) == ("a", AFFINITY)
    assert choose([], up, {}) is None


def test_an_overloaded_plane_hands_on_to_the_next_on_the_ring() -> None:
    order = ["a", "b", "c"]
    up = dict.fromkeys(order, True)
    assert not overloaded(LOAD_SLACK, 0) and overloaded(LOAD_SLACK + 1, 0)
    assert choose(order, up, {"a": LOAD_SLACK + 1, "b": 0, "c": 0}) == ("b", LOAD)
    # The next one on the ring, not the least loaded, when it is within the margin.
    assert choose(order, up, {"a": 20, "b": 5, "c": 0}) == ("b", LOAD)
    assert choose(order, up, {"a": 20, "b": 20, "c": 0}) == ("c", LOAD)
    # A relative margin at high load: 140 vs 100 is fine, 160 is not.
    assert choose(order, up, {"a": 140, "b": 100, "c": 100}) == ("a", AFFINITY)
    assert choose(order, up, {"a": 160, "b": 100, "c": 100}) == ("b", LOAD)


def test_planes_that_are_down_are_passed_over() -> None:
    order = ["a", "b", "c"]
    loads = {"a": 0, "b": 0, "c": 0}
    assert choose(order, {"a": False, "b": True, "c": True}, loads) == ("b", UNAVAILABLE)
    assert choose(order, {"a": False, "b": False, "c": True}, loads) == ("c", UNAVAILABLE)
    # None up: the key's own plane is tried (it may be back), unless only_up.
    down = dict.fromkeys(order, False)
    assert choose(order, down, loads) == ("a", AFFINITY)
    assert choose(order, down, loads, only_up=True) is None


@pytest.mark.parametrize("n", [2, 3, 5])
def test_load_never_exceeds_the_margin_with_every_call_on_one_key(n: int) -> None:
    """Many calls with one prefix: the key's plane takes them until it is past the
    margin, then they spill along the ring; no plane ends far beyond the least loaded."""
    nodes = [f"p{i}" for i in range(n)]
    ring = HashRing(nodes)
    load = dict.fromkeys(nodes, 0)
    up = dict.fromkeys(nodes, True)
    for _ in range(500):
        picked = choose(ring.walk("text:hot prefix"), up, load)
        assert picked is not None
        load[picked[0]] += 1
    least = min(load.values())
    assert all(not overloaded(v, least + 1) for v in load.values()), load
    assert load[next(ring.walk("text:hot prefix"))] == max(load.values())
