"""TLS on both gRPC links, end to end, and failing closed.

compute plane: server TLS (no client certificates asked);
control plane: mutual TLS (clients must present a certificate signed by the test CA);
gateway: dials the control plane with the CA and its client certificate.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from hetero_infer.local import child, free_port
from hetero_proto import compute_pb2, compute_pb2_grpc
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.certs import PKI, Issued, make_pki
from tests.procs import gateway

pytestmark = pytest.mark.slow


def creds(ca: Issued, client: Issued | None = None) -> grpc.ChannelCredentials:
    cert, key = client.read() if client else (None, None)
    return grpc.ssl_channel_credentials(ca.cert.read_bytes(), key, cert)


@dataclass
class TLSStack:
    pki: PKI
    compute: str
    control: str
    url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSStack]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    s, ca, cl = pki.server, pki.ca.cert, pki.client
    kport, cport = free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{cport}"
    compute_args = ["compute-plane", "--port", str(kport), "--metrics-port", str(free_port())]
    compute_args += ["--kv-cache-bytes", str(64 << 20)]
    compute_args += ["--tls-cert", str(s.cert), "--tls-key", str(s.key)]
    control_args = ["control-plane", "--port", str(cport), "--compute", compute]
    control_args += ["--metrics-port", str(free_port())]
    control_args += ["--tls-cert", str(s.cert), "--tls-key", str(s.key), "--tls-client-ca", str(ca)]
    control_args += ["--compute-tls-ca", str(ca)]
    gateway_args = ["--control-tls-ca", str(ca)]
    gateway_args += ["--control-tls-cert", str(cl.cert), "--control-tls-key", str(cl.key)]
    with (
        child(compute_args, compute, credentials=creds(pki.ca)),
        child(control_args, control, credentials=creds(pki.ca, pki.client)),
        gateway(control, free_port(), *gateway_args) as url,
    ):
        yield TLSStack(pki, compute, control, url)


def test_openai_client_through_tls_links(stack: TLSStack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in (out.choices[0].message.content or "")


def test_control_plane_accepts_only_certified_clients(stack: TLSStack) -> None:
    pki = stack.pki

    def model_info(channel: grpc.Channel) -> pb.ModelInfoResponse:
        with channel:
            return pb_grpc.ControlPlaneStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=5)

    assert model_info(grpc.secure_channel(stack.control, creds(pki.ca, pki.client))).model_name
    refused = {
        "plaintext": grpc.insecure_channel(stack.control),
        "no client certificate": grpc.secure_channel(stack.control, creds(pki.ca)),
        "client certificate of another CA": grpc.secure_channel(
            stack.control, creds(pki.ca, pki.rogue_client)
        ),
        "server not trusted": grpc.secure_channel(stack.control, creds(pki.rogue_ca, pki.client)),
    }
    for why, channel in refused.items():
        with pytest.raises(grpc.RpcError) as e:
            model_info(channel)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, why


def test_compute_plane_refuses_plaintext_and_untrusted(stack: TLSStack) -> None:
    pki = stack.pki

    def describe(channel: grpc.Channel) -> compute_pb2.DescribeResponse:
        with channel:
            stub = compute_pb2_grpc.ComputePlaneStub(channel)
            return stub.Describe(compute_pb2.DescribeRequest(), timeout=5)

    assert describe(grpc.secure_channel(stack.compute, creds(pki.ca))).num_kv_blocks > 1
    for channel in (
        grpc.insecure_channel(stack.compute),
        grpc.secure_channel(stack.compute, creds(pki.rogue_ca)),
    ):
        with pytest.raises(grpc.RpcError) as e:
            describe(channel)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_gateway_with_wrong_certificate_is_not_ready(stack: TLSStack) -> None:
    rogue = stack.pki.rogue_client
    args = ["--control-tls-ca", str(stack.pki.ca.cert)]
    args += ["--control-tls-cert", str(rogue.cert), "--control-tls-key", str(rogue.key)]
    with gateway(stack.control, free_port(), *args, url_path="/health") as url:
        assert httpx.get(url + "/ready", timeout=10).status_code == 503
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
        assert r.status_code == 503, r.text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", "/nonexistent.crt"], "--tls-cert and --tls-key must be given together"),
        (["--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"], "cannot read"),
        (["--compute-tls-cert", "c.crt", "--compute-tls-key", "c.key"], "--compute-tls-ca"),
    ],
)
def test_bad_tls_flags_stop_the_control_plane(
    args: list[str], message: str, tmp_path: Path
) -> None:
    cmd = [sys.executable, "-m", "hetero_infer.cli", "control-plane", "--port", str(free_port())]
    cmd += ["--metrics-port", "-1", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
