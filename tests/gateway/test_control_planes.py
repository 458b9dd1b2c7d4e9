"""The gateway's set of control planes (hetero_common.discovery, gateway.control_planes): the
`--control` list, names resolved and followed, TLS by the name a plane came from, and
readiness when any plane is ready. Fake control planes are small in-process gRPC servers
answering ModelInfo: the unit under test is the gateway's side."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client import REGISTRY

from gateway import metrics
from gateway.config import GatewayConfig
from gateway.control_planes import ControlPlanes
from gateway.errors import APIError
from hetero_common import discovery
from hetero_common.grpc_health import HealthReporter
from hetero_common.tls import ServerTLS
from hetero_infer.local import free_port
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.certs import make_ca


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def test_control_lists_parse_and_bad_ones_are_refused() -> None:
    assert discovery.targets("a:1, [::1]:2,10.0.0.1:3") == [("a", 1), ("::1", 2), ("10.0.0.1", 3)]
    assert discovery.static_addresses("10.0.0.1:3,[::1]:2") == {
        "10.0.0.1:3": "10.0.0.1",
        "[::1]:2": "::1",
    }
    assert discovery.static_addresses("10.0.0.1:3,name:2") is None  # to be resolved
    for bad in ("", " , ", "host", "host:0", "host:x", ":80", "a:1,b"):
        with pytest.raises(ValueError):
            GatewayConfig(control=bad)
    assert GatewayConfig(control="a:1,b:2").control == "a:1,b:2"


def test_names_resolve_to_each_address_once() -> None:
    async def go() -> None:
        found = await discovery.resolve("localhost:5,127.0.0.1:5,no-such-host.invalid:7,[::1]:6")
        # localhost is one control plane (IPv4 first); the same address twice is one;
        # a name that does not exist gives none.
        assert found == {"127.0.0.1:5": "localhost", "[::1]:6": "::1"}

    run(go)


class FakeControlPlane(pb_grpc.ControlPlaneServicer):
    """ModelInfo and gRPC health, as a control plane reports them."""

    def __init__(self, attached: bool = True, delay: float = 0.0) -> None:
        self.attached = attached
        self.delay = delay  # an unreachable plane: answers late
        self.health: HealthReporter | None = None

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Any) -> pb.ModelInfoResponse:
        await asyncio.sleep(self.delay)
        return pb.ModelInfoResponse(model_name="m", compute_attached=self.attached)

    async def serve(self, serving: bool) -> None:
        """SERVING: a compute plane attached; NOT_SERVING: none, or draining."""
        assert self.health is not None
        await self.health.set(serving)


@asynccontextmanager
async def serving(servicer: FakeControlPlane, tls: ServerTLS | None = None) -> AsyncIterator[int]:
    server = grpc.aio.server()
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)
    servicer.health = HealthReporter(server, "hetero.control.v1.ControlPlane")
    await servicer.serve(servicer.attached)
    port = free_port()
    if tls is not None:
        tls.add_port(server, f"127.0.0.1:{port}")
    else:
        server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def settled(planes: ControlPlanes, want: dict[str, bool]) -> None:
    """Until the planes' up/down is `want` (by port): answers after `info` returned."""

    def up() -> dict[str, bool]:
        return {addr.rpartition(":")[2]: p.up for addr, p in planes.planes.items()}

    for _ in range(300):
        if up() == want:
            return
        await asyncio.sleep(0.01)
    assert up() == want


def test_ready_when_any_plane_is_and_the_others_are_marked_down() -> None:
    async def go() -> None:
        dead = free_port()
        detached, attached = FakeControlPlane(False), FakeControlPlane(True)
        slow = FakeControlPlane(True, delay=2.0)  # no answer within the probe's timeout
        async with serving(detached) as a, serving(attached) as b, serving(slow) as c:
            spec = f"127.0.0.1:{dead},127.0.0.1:{a},127.0.0.1:{c},127.0.0.1:{b}"
            planes = ControlPlanes(GatewayConfig(control=spec))
            loop = asyncio.get_running_loop()
            begun = loop.time()
            info = await planes.info(timeout=1.0)
            assert info.compute_attached
            assert loop.time() - begun < 0.8  # the attached plane's answer, not the slow one's
            await settled(planes, {str(dead): False, str(a): False, str(c): False, str(b): True})
            picked = planes.pick("text:anything")
            assert picked is not None and picked[0].address == f"127.0.0.1:{b}"
            # The probes follow gRPC health: SERVING is up, NOT_SERVING (no compute
            # plane, or draining) and no answer are down.
            await detached.serve(True)
            await planes.tick(every=True)
            await settled(planes, {str(dead): False, str(a): True, str(c): True, str(b): True})
            await attached.serve(False)  # draining: it still answers ModelInfo
            await planes.tick(every=False)  # only the planes that are down
            assert planes.planes[f"127.0.0.1:{b}"].up
            await planes.tick(every=True)
            assert not planes.planes[f"127.0.0.1:{b}"].up
            attached.attached = detached.attached = slow.attached = False
            info = await planes.info(timeout=1.0)
            assert not info.compute_attached  # an answer, but not ready (/ready: 503)
            await planes.close()
        planes = ControlPlanes(GatewayConfig(control=f"127.0.0.1:{dead}"))
        with pytest.raises(APIError) as e:
            await planes.info(timeout=1.0)
        assert e.value.status == 503 and "unavailable" in e.value.message
        await planes.close()

    run(go)


def test_planes_follow_dns_and_leavers_finish_their_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        answers: list[dict[str, str] | None] = [
            {"10.0.0.1:5": "svc", "10.0.0.2:5": "svc"},
            {"10.0.0.2:5": "svc", "10.0.0.3:5": "svc"},  # .1 left, .3 joined
            {"10.0.0.1:5": "svc", "10.0.0.2:5": "svc", "10.0.0.3:5": "svc"},  # .1 is back
            {"10.0.0.2:5": "svc", "10.0.0.3:5": "svc"},
            None,  # the resolver failed: keep what is known
            {},  # every address gone at once: keep them too (a glitch, not a scale-down)
        ]

        async def resolve(spec: str) -> dict[str, str] | None:
            assert spec == "svc:5"
            return answers.pop(0)

        monkeypatch.setattr(discovery, "resolve", resolve)
        planes = ControlPlanes(GatewayConfig(control="svc:5"))
        assert planes.dynamic and not planes.planes
        await planes.refresh()
        assert list(planes.planes) == ["10.0.0.1:5", "10.0.0.2:5"]
        leaver = planes.planes["10.0.0.1:5"]
        leaver.add_in_flight(1)  # a call still runs on it
        metrics.routed.labels(control=leaver.address, reason="affinity").inc()  # (as routed)
        await planes.refresh()
        assert list(planes.planes) == ["10.0.0.2:5", "10.0.0.3:5"]
        assert set(planes.ring.nodes) == {"10.0.0.2:5", "10.0.0.3:5"}
        assert planes.leaving == [leaver]
        await planes.refresh()  # back before it closed: the same plane, its call on it
        assert planes.planes["10.0.0.1:5"] is leaver and not planes.leaving
        await planes.refresh()
        assert planes.leaving == [leaver]
        for key in (f"text:{i}" for i in range(50)):
            picked = planes.pick(key)
            assert picked is not None and picked[0] is not leaver
        await planes.tick(every=False)
        assert planes.leaving == [leaver]  # its call runs on
        leaver.add_in_flight(-1)
        await planes.tick(every=False)
        assert planes.leaving == []
        series = [s.labels for m in REGISTRY.collect() for s in m.samples]
        assert not [s for s in series if s.get("control") == leaver.address]  # (gone with it)
        for _ in range(2):
            await planes.refresh()
            assert list(planes.planes) == ["10.0.0.2:5", "10.0.0.3:5"]
        await planes.close()

    run(go)


def dns_only_server_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for the DNS name `localhost` only (no IP SAN)."""
    ca, ca_key = make_ca(folder, "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    crt, pem = folder / "server.crt", folder / "server.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca.cert, crt, pem


def test_tls_verifies_a_resolved_plane_by_its_name(tmp_path: Path) -> None:
    """`--control localhost:P` dials 127.0.0.1:P but checks the certificate for
    `localhost`; the IP address itself is not in the certificate."""

    async def go() -> None:
        ca, crt, key = dns_only_server_cert(tmp_path)
        async with serving(FakeControlPlane(), ServerTLS(str(crt), str(key))) as port:
            by_name = ControlPlanes(
                GatewayConfig(control=f"localhost:{port}", control_tls_ca=str(ca))
            )
            await by_name.refresh()
            assert list(by_name.planes) == [f"127.0.0.1:{port}"]
            assert (await by_name.info(timeout=5.0)).model_name == "m"
            by_ip = ControlPlanes(
                GatewayConfig(control=f"127.0.0.1:{port}", control_tls_ca=str(ca))
            )
            with pytest.raises(APIError):  # the certificate does not name 127.0.0.1
                await by_ip.info(timeout=5.0)
            for planes in (by_name, by_ip):
                await planes.close()

    run(go)


def test_a_plane_still_starting_is_no_warning_and_one_that_served_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The planes start in any order: a gateway asked for /ready before the compute plane
    attached logged 'control plane ... is down' as a WARNING at every `serve`. Until a
    plane has been ready once, its not serving is an INFO line; once it has, going down
    is a WARNING."""
    address = ""

    async def go() -> None:
        nonlocal address
        starting = FakeControlPlane(False)
        async with serving(starting) as port:
            address = f"127.0.0.1:{port}"
            planes = ControlPlanes(GatewayConfig(control=address))
            try:
                info = await planes.info(timeout=1.0)  # /ready: 503
                assert not info.compute_attached
                await settled(planes, {str(port): False})
                await planes.tick(every=True)  # still starting: no second line
                starting.attached = True
                await starting.serve(True)  # a compute plane attached
                await planes.tick(every=False)
                await settled(planes, {str(port): True})
                await starting.serve(False)  # draining, after it served
                await planes.tick(every=True)
                await settled(planes, {str(port): False})
            finally:
                await planes.close()

    with caplog.at_level(logging.INFO, logger="gateway.control_planes"):
        run(go)
    lines = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.getMessage().startswith(f"control plane {address} is")
    ]
    assert lines == [
        (
            "INFO",
            f"control plane {address} is not serving yet: no compute plane attached, or draining",
        ),
        ("INFO", f"control plane {address} is up"),
        (
            "WARNING",
            f"control plane {address} is down: not serving (no compute plane attached, or draining)",
        ),
    ], lines
