"""API keys at the gateway: wrong or missing key -> 401 in OpenAI's schema; probes stay open."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from hetero_infer.local import free_port, stop_process, wait_http_ready

BODY = {"model": "m", "prompt": "x", "max_tokens": 1}


@pytest.fixture(params=["flag", "env"])
def gateway_url(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A gateway requiring key 's3cret' (by flag or env), with no control plane behind it."""
    port = free_port()
    cmd = [sys.executable, "-m", "hetero_infer.cli", "gateway", "--port", str(port)]
    cmd += ["--control", f"127.0.0.1:{free_port()}"]
    env = dict(os.environ)
    if request.param == "flag":
        cmd += ["--api-key", "s3cret"]
    else:
        env["HETERO_API_KEY"] = "s3cret"
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/health", proc)  # type: ignore[arg-type]
        yield url
    finally:
        stop_process(proc)  # type: ignore[arg-type]


def test_wrong_or_missing_key_is_401(gateway_url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
        r = httpx.post(gateway_url + "/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_right_key_passes_and_probes_stay_open(gateway_url: str) -> None:
    # Authenticated, so the request reaches the (absent) control plane: 503 with Retry-After.
    r = httpx.post(
        gateway_url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"}
    )
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert httpx.get(gateway_url + "/health").status_code == 200
    assert httpx.get(gateway_url + "/ready").status_code == 503  # no control plane, but not 401
    assert httpx.get(gateway_url + "/metrics").status_code == 200
