"""The gateway's in-process client over a fake control link (tests/gateway/fake_link.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.gateway.fake_link import FakeLink


@pytest.fixture
def link() -> FakeLink:
    return FakeLink()


@pytest.fixture
def client(link: FakeLink):  # type: ignore[no-untyped-def]
    app = create_app(GatewayConfig(port=8000), link)  # type: ignore[arg-type]
    with TestClient(app) as c:
        yield c
    assert link.closed  # the lifespan closed the link on shutdown
