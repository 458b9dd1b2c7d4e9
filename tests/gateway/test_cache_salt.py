"""cache_salt (vLLM's extension) at the gateway: a non-empty string or null, else a 400
naming it (vLLM: "Parameter 'cache_salt' must be a non-empty string if provided"); a
salt given reaches every call of the request as GenerationParams.cache_salt."""

from __future__ import annotations

import hashlib
import json

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.control_planes import ControlPlanes
from gateway.router import Router
from tests.gateway.fake_link import MODEL, FakeLink, FakeMux

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
ROUTES = [("completions", {"prompt": "Hi"}), ("chat/completions", CHAT)]


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=["completions", "chat"])
@pytest.mark.parametrize(
    "salt", ["", 5, True, ["a"], {"a": "b"}, "\ud800"], ids=repr
)  # fmt: skip
def test_a_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(
    client: TestClient, link: FakeLink, route: str, body: dict[str, object], salt: object
) -> None:
    if salt == "\ud800":  # (a lone surrogate: JSON spells it, Python's encoder cannot send it)
        raw = f'{{"model": "{MODEL}", "cache_salt": "\\ud800", ' + json.dumps(body)[1:]
        r = client.post(f"/v1/{route}", content=raw, headers={"content-type": "application/json"})
    else:
        r = client.post(f"/v1/{route}", json={"model": MODEL, "cache_salt": salt, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt", err
    assert not link.mux.calls  # refused before any call
    ok = client.post(f"/v1/{route}", json={"model": MODEL, **body})
    assert ok.status_code == 200, ok.text  # (the gateway goes on serving)


def test_the_empty_salt_says_it_must_not_be_empty(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "cache_salt": ""})
    assert r.status_code == 400 and "non-empty" in r.json()["error"]["message"]


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=["completions", "chat"])
def test_a_salt_reaches_the_control_plane_and_null_is_none(
    client: TestClient, link: FakeLink, route: str, body: dict[str, object]
) -> None:
    for salt, sent in (("tenant-7 ÿ", "tenant-7 ÿ"), (None, ""), ("  ", "  ")):
        r = client.post(f"/v1/{route}", json={"model": MODEL, "cache_salt": salt, **body})
        assert r.status_code == 200, r.text
        assert link.mux.calls[-1].params.cache_salt == sent
    r = client.post(f"/v1/{route}", json={"model": MODEL, **body})
    assert link.mux.calls[-1].params.cache_salt == ""


def test_every_prompt_of_a_batch_carries_the_salt(client: TestClient, link: FakeLink) -> None:
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "cache_salt": "s"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c.params.cache_salt for c in link.mux.calls] == ["s", "s", "s"]


def _owner(key: str, nodes: list[str]) -> str:
    """The control plane a routing key belongs to, from what gateway.placement documents,
    worked out here on its own: 64 points a plane on a ring of 64-bit BLAKE2b hashes of
    "<plane>#<i>"; the key's plane is that of the first point above the key's hash,
    wrapping around."""

    def h(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    points = sorted((h(f"{node}#{i}"), node) for node in nodes for i in range(64))
    return next((node for point, node in points if point > h(key)), points[0][1])


def test_salted_requests_are_placed_by_salt_and_leading_content() -> None:
    """Three control planes behind the gateway's router: a request's plane is its routing
    key's, the salt leading the key ("salt:<length>:<salt>|" before the content key:
    "text:" and a prompt's first 256 characters; "chat:" and the tools' JSON then each
    message's role and content, joined by 0x1e/0x1f, 256 characters in all). One salt's
    requests with one long preamble meet on one plane; tenants of one preamble spread
    over all three, on both generate routes."""
    control = ",".join(f"127.0.0.1:{port}" for port in (1, 2, 3))
    config = GatewayConfig(port=8000, control=control)
    planes = ControlPlanes(config)
    planes.ensure_running = lambda: None  # type: ignore[method-assign]  # no probes
    for plane in planes.planes.values():
        plane.mux = FakeMux()  # type: ignore[assignment]
    link = FakeLink()
    link.mux = Router(planes, 5.0)  # type: ignore[assignment]
    nodes = list(planes.planes)
    preamble = "You are the support assistant of a shop selling bicycles. " * 6
    system = "You answer questions about the solar system, briefly and exactly. " * 5
    assert len(preamble) > 256 and len(system) > 256

    def text_key(salt: str, prompt: str) -> str:
        return f"salt:{len(salt)}:{salt}|text:{prompt[:256]}"

    def chat_key(salt: str, question: str) -> str:
        parts = ["", f"system\x1f{system}", f"user\x1f{question}"]  # (no tools: "")
        return f"salt:{len(salt)}:{salt}|chat:" + "\x1e".join(parts)[:256]

    def placed() -> str:
        (address,) = [a for a, p in planes.planes.items() if p.mux.calls]  # type: ignore[attr-defined]
        planes.planes[address].mux.calls.clear()  # type: ignore[attr-defined]
        return address

    salts = [f"tenant-{i}" for i in range(12)]
    with TestClient(create_app(GatewayConfig(port=8000), link)) as client:  # type: ignore[arg-type]
        for route in ("completions", "chat/completions"):
            got, want = [], []
            for salt in salts:
                for question in ("Is the shop open on Sunday?", "Do you repair tyres?"):
                    if route == "completions":
                        body: dict[str, object] = {"prompt": preamble + question}
                        key = text_key(salt, preamble + question)
                    else:
                        messages = [
                            {"role": "system", "content": system},
                            {"role": "user", "content": question},
                        ]
                        body = {"messages": messages}
                        key = chat_key(salt, question)
                    r = client.post(
                        f"/v1/{route}", json={"model": MODEL, "cache_salt": salt, **body}
                    )
                    assert r.status_code == 200, r.text
                    got.append(placed())
                    want.append(_owner(key, nodes))
            assert got == want, route
            # Each salt's two questions met on one plane; the salts spread over all three.
            assert all(got[i] == got[i + 1] for i in range(0, len(got), 2)), got
            assert set(got) == set(nodes), got
