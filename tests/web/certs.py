"""Test-only certificates, made at test time with pyca/cryptography (nothing committed).

One CA signs a server certificate for 127.0.0.1/localhost and client certificates; a
second, unrelated CA stands for "someone else's". EC P-256 keys: fast to make.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FROM = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
VALID_UNTIL = datetime.datetime(2099, 1, 1, tzinfo=datetime.timezone.utc)


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def write(self, folder: Path, stem: str) -> tuple[Path, Path]:
        cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        return cert_path, key_path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    return Issued(
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        certificate,
        key,
    )


def make_ca(common_name: str = "test-only CA") -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(VALID_FROM)
        .not_valid_after(VALID_UNTIL)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem(certificate, key)


def issue(
    ca: Issued,
    common_name: str,
    *,
    server: bool,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    uris: tuple[str, ...] = (),
    valid_from: datetime.datetime = VALID_FROM,
    valid_until: datetime.datetime = VALID_UNTIL,
) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
    names += [x509.IPAddress(ipaddress.ip_address(address)) for address in ips]
    names += [x509.UniformResourceIdentifier(uri) for uri in uris]
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_until)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _pem(builder.sign(ca.key, hashes.SHA256()), key)


@dataclass(frozen=True)
class Pki:
    """Files in one folder, named as a Kubernetes TLS Secret names them."""

    folder: Path
    ca: Path  # ca.crt: signs the server and the clients
    server_cert: Path  # tls.crt (127.0.0.1, localhost)
    server_key: Path  # tls.key
    client_cert: Path  # client.crt, SANs: DNS prometheus.example, URI spiffe://test/prometheus
    client_key: Path
    other_ca: Path  # other-ca.crt: an unrelated CA
    other_client_cert: Path  # signed by the unrelated CA
    other_client_key: Path
    intruder_cert: Path  # signed by ca.crt but with a SAN nobody allows
    intruder_key: Path


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, other_ca = make_ca("test-only CA"), make_ca("test-only unrelated CA")
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    (folder / "other-ca.crt").write_bytes(other_ca.cert_pem)
    server_cert, server_key = issue(
        ca, "exporter", server=True, dns=("localhost",), ips=("127.0.0.1",)
    ).write(folder, "tls")
    client_cert, client_key = issue(
        ca,
        "prometheus",
        server=False,
        dns=("prometheus.example",),
        uris=("spiffe://test/prometheus",),
    ).write(folder, "client")
    other_cert, other_key = issue(
        other_ca, "prometheus", server=False, dns=("prometheus.example",)
    ).write(folder, "other-client")
    intruder_cert, intruder_key = issue(
        ca, "intruder", server=False, dns=("intruder.example",)
    ).write(folder, "intruder")
    return Pki(
        folder,
        folder / "ca.crt",
        server_cert,
        server_key,
        client_cert,
        client_key,
        folder / "other-ca.crt",
        other_cert,
        other_key,
        intruder_cert,
        intruder_key,
    )
