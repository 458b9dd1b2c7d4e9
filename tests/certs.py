"""Throwaway PKI for TLS tests: a CA, a server and a client certificate, and a rogue CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Issued:
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(
    folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Issued:
    c, k = folder / f"{stem}.crt", folder / f"{stem}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Issued(c, k)


def _builder(
    subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(folder: Path, name: str) -> tuple[Issued, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(name, _name(name), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(folder, name, cert, key), key


def issue(
    folder: Path, stem: str, ca: Issued, ca_key: ec.EllipticCurvePrivateKey, server: bool
) -> Issued:
    """A leaf certificate signed by `ca`: for 127.0.0.1/localhost when `server`."""
    key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    builder = _builder(stem, ca_cert.subject, key)
    if server:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return _write(folder, stem, cert, key)


@dataclass
class PKI:
    ca: Issued
    server: Issued
    client: Issued
    rogue_ca: Issued  # an unrelated CA
    rogue_client: Issued  # a client certificate signed by the rogue CA


def make_pki(folder: Path) -> PKI:
    ca, ca_key = make_ca(folder, "test-ca")
    rogue, rogue_key = make_ca(folder, "rogue-ca")
    return PKI(
        ca=ca,
        server=issue(folder, "server", ca, ca_key, server=True),
        client=issue(folder, "client", ca, ca_key, server=False),
        rogue_ca=rogue,
        rogue_client=issue(folder, "rogue-client", rogue, rogue_key, server=False),
    )
