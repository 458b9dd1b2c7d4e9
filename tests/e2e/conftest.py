"""Fixtures shared by the end-to-end tests that play an OpenAI client: each module
defines its own module-scoped `stack` (a FullStack, started with its own flags), and
these build on it. A module defines `client` or `model` itself where it needs other."""

from __future__ import annotations

import openai
import pytest

from tests.procs import FullStack


@pytest.fixture(scope="module")
def client(stack: FullStack) -> openai.OpenAI:
    """The official openai client on the module's gateway."""
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    """The served model's id, as the gateway lists it (one model)."""
    (m,) = client.models.list().data
    return m.id
