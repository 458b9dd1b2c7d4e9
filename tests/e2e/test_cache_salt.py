"""cache_salt through the three planes with the official `openai` client: a prompt sent
under one salt is no prefix-cache hit under another salt or none
(usage.prompt_tokens_details.cached_tokens 0), and is one under the same salt, as
vLLM's prefix cache behaves. n > 1 forks the salted prompt as before."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.procs import FullStack, gateway_stack

pytestmark = pytest.mark.slow

# Several 16-token blocks; each test's prompt starts with its own word, so that no other
# test's requests hit it.
TEXT = "A salted prompt of several KV blocks, about tenants who share one server: "


@pytest.fixture(scope="module")
def stack() -> Iterator[FullStack]:
    with gateway_stack() as s:
        yield s


def _cached(usage: Any) -> int:
    details = usage.prompt_tokens_details  # (left out when nothing was cached)
    return 0 if details is None else details.cached_tokens


def test_completions_share_the_prefix_cache_only_within_a_salt(
    client: openai.OpenAI, model: str
) -> None:
    prompt = "Completions. " + TEXT * 3

    def send(salt: str | None, n: int = 1) -> tuple[int, list[str]]:
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=4, temperature=0, n=n, extra_body=extra
        )
        assert r.usage is not None
        return _cached(r.usage), [c.text for c in r.choices]

    first, text = send("tenant-a")
    assert first == 0
    assert send("tenant-b") == (0, text)  # another salt: no hit, the same greedy answer
    assert send(None) == (0, text)  # no salt: no hit on a salted prompt
    assert send("tenant-a")[0] >= 16  # the same salt: its blocks
    assert send(None)[0] >= 16  # the unsalted share among themselves
    assert send("Tenant-a")[0] == 0  # (a salt is its exact string)
    cached, texts = send("tenant-b", n=2)  # n > 1 forks the salted prompt
    assert cached >= 16 and len(texts) == 2 and texts[0] == texts[1]


def test_chat_shares_the_prefix_cache_only_within_a_salt(client: openai.OpenAI, model: str) -> None:
    messages: list[Any] = [{"role": "user", "content": "Chat. " + TEXT * 3}]

    def send(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=2, extra_body=extra
        )
        assert r.usage is not None
        return _cached(r.usage)

    assert (send("one"), send("two"), send(None)) == (0, 0, 0)
    assert send("one") >= 16 and send("two") >= 16 and send(None) >= 16


def test_streamed_usage_counts_no_hit_across_salts(client: openai.OpenAI, model: str) -> None:
    prompt = "Streamed. " + TEXT * 3

    def send(salt: str) -> int:
        chunks = list(
            client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"cache_salt": salt},
            )
        )
        usage = chunks[-1].usage
        assert usage is not None
        return _cached(usage)

    assert (send("x"), send("y")) == (0, 0)
    assert send("x") >= 16 and send("y") >= 16


@pytest.mark.parametrize("salt", ["", 7, ["x"]], ids=repr)
def test_a_bad_salt_is_a_400_naming_it(client: openai.OpenAI, model: str, salt: object) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt="Hi", max_tokens=1, extra_body={"cache_salt": salt}
        )
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "cache_salt", body
    r = client.completions.create(model=model, prompt="Hi", max_tokens=1)
    assert r.choices[0].finish_reason == "length"  # the planes go on serving
