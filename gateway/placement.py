"""Which control plane a generate call goes to: prefix affinity, then load.

Each control plane has its own prefix cache, so requests that share a long prefix (a
system prompt, a few-shot preamble, the earlier turns of a conversation) should meet on
the same one. The gateway does not tokenize, so the key is the request's leading
content as it arrives, behind its cache_salt (`routing_key`), placed on a consistent-hash
ring with virtual nodes (`HashRing`): adding or removing one of N planes moves only ~1/N
of the keys, so the caches of the others stay warm.

    ring:  ...──a#7──b#2──[key]──b#40──a#3──c#9──...
                            └──▶ walk: b, a, c   (distinct planes in ring order)

`choose` takes the first plane of that walk that is up and not overloaded: loaded more
than max(least + LOAD_SLACK, LOAD_RATIO x least) in-flight calls, where `least` is the
least loaded plane that is up, so a hot prefix spills over to the next plane on its
ring rather than to a random one. Pure functions: no gRPC, no clock.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator, Mapping

from hetero_proto import control_pb2 as pb

VNODES = 64  # points per plane on the ring: keys split within a few % between planes
KEY_CHARS = 256  # leading characters of a text prompt / of serialized chat messages
KEY_TOKENS = 64  # leading ids of a token-id prompt
# A plane with more in-flight calls than max(least + LOAD_SLACK, LOAD_RATIO x least) is
# passed over: a few calls' difference is noise, and under heavy load a relative
# margin keeps affinity from piling a hot prefix onto one plane.
LOAD_SLACK = 8
LOAD_RATIO = 1.5

AFFINITY, LOAD, UNAVAILABLE = "affinity", "load", "unavailable"


def _hash(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


def routing_key(call: pb.GenerateRequest) -> str:
    """The part of a call's input that decides its plane: its leading content, behind
    its cache_salt when it has one (prefix-cache blocks are shared only within one salt,
    so each tenant's prefix is its own key: tenants with a common system prompt spread
    over the planes, and each tenant's requests still meet on one)."""
    content = _content_key(call)
    salt = call.params.cache_salt
    # The salt's length leads, so no salt can spell another salt followed by content.
    return f"salt:{len(salt)}:{salt}|{content}" if salt else content


def _content_key(call: pb.GenerateRequest) -> str:
    kind = call.WhichOneof("input")
    if kind == "text":
        return "text:" + call.text[:KEY_CHARS]
    if kind == "token_ids":
        return "ids:" + ",".join(map(str, call.token_ids.ids[:KEY_TOKENS]))
    if kind == "chat":
        # Tools and the first messages are what a chat template renders first.
        parts, size = [call.chat.tools_json], len(call.chat.tools_json)
        for m in call.chat.messages:
            if size >= KEY_CHARS:
                break
            parts.append(f"{m.role}\x1f{m.content}")
            size += len(parts[-1]) + 1
        return "chat:" + "\x1e".join(parts)[:KEY_CHARS]
    return ""


class HashRing:
    """A consistent-hash ring of node names, VNODES points each."""

    def __init__(self, nodes: Iterable[str], vnodes: int = VNODES) -> None:
        points = sorted((_hash(f"{node}#{i}"), node) for node in set(nodes) for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._nodes = [n for _, n in points]
        self.nodes = frozenset(self._nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def walk(self, key: str) -> Iterator[str]:
        """Every node once, in ring order from the key's point: its own node first."""
        n = len(self._nodes)
        if not n:
            return
        start = bisect.bisect(self._hashes, _hash(key))
        seen: set[str] = set()
        for k in range(n):
            node = self._nodes[(start + k) % n]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.nodes):
                    return


def overloaded(load: int, least: int) -> bool:
    return load > max(least + LOAD_SLACK, LOAD_RATIO * least)


def choose(
    order: Iterable[str], up: Mapping[str, bool], load: Mapping[str, int], only_up: bool = False
) -> tuple[str, str] | None:
    """The plane for a key whose ring walk is `order`, and why (AFFINITY: its own plane;
    LOAD: an earlier one was overloaded; UNAVAILABLE: its own plane is down).

    Planes that are down are passed over; when none is up, the key's own plane is tried
    anyway (it may be back), unless `only_up`. None when `order` is empty, or with
    `only_up` when no plane in it is up.
    """
    order = list(order)
    if not order:
        return None
    healthy = [a for a in order if up.get(a, False)]
    if not healthy:
        return None if only_up else (order[0], AFFINITY)
    least = min(load.get(a, 0) for a in healthy)
    chosen = next(a for a in healthy if not overloaded(load.get(a, 0), least))
    if chosen == order[0]:
        return chosen, AFFINITY
    return chosen, LOAD if up.get(order[0], False) else UNAVAILABLE
