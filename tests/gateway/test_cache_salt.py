"""cache_salt (vLLM's extension) at the gateway: a non-empty string or null, else a 400
naming it (vLLM: "Parameter 'cache_salt' must be a non-empty string if provided"); a
salt given reaches every call of the request as GenerationParams.cache_salt."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.gateway.test_serving import MODEL, FakeLink

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
ROUTES = [("completions", {"prompt": "Hi"}), ("chat/completions", CHAT)]


@pytest.fixture
def link() -> FakeLink:
    return FakeLink()


@pytest.fixture
def client(link: FakeLink):  # type: ignore[no-untyped-def]
    app = create_app(GatewayConfig(port=8000), link)  # type: ignore[arg-type]
    with TestClient(app) as c:
        yield c


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
