"""TLS contexts from a validated TLSServerConfig, and one that follows reloads.

A listening socket is handed one ``ssl.SSLContext`` for its whole life. To let a reload
change everything (certificate, key, client CAs, client auth, versions, ciphers) for new
connections while open ones carry on, the listener gets a ``FollowingContext``: asyncio
asks it for each new connection's SSL object (``wrap_bio``) and it hands that request to
whatever context is current at that moment. An SSL object keeps the context it was made
from, so established connections are untouched. (Swapping ``SSLObject.context`` from an
``sni_callback`` would not do: OpenSSL copies the verify mode and the protocol versions
into the SSL object before that callback runs, so a reload could not turn client
certificates on or change ``min_version``.)

Certificates and keys are read into memory here, each read bounded, and handed to OpenSSL
through an anonymous in-memory file where the platform has one: inline ``cert``/``key``
never touch the disk, and a file that changes between two reads cannot yield a certificate
from one version and a key from the other. The same bytes give the chain's expiry
(``chain_not_after``: the earliest notAfter of the certificates served, read from their DER
here, since the ssl module shows no loaded certificate), which the listener exports and
warns about: an expired certificate is still served, as exporter-toolkit serves it.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import contextlib
import os
import re
import ssl
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from exporter.web.config import GO_TO_OPENSSL_CIPHERS, TLSServerConfig, WebConfigError

MAX_PEM_BYTES = 1024 * 1024

VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH_MODES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


class ServerTLS(NamedTuple):
    """A built server context and when the certificates it serves expire."""

    context: ssl.SSLContext
    not_after: float | None  # unix time; None if no certificate's validity could be read


def build_ssl_context(tls: TLSServerConfig, path: str) -> ssl.SSLContext:
    """A server context for ``tls`` (which must be enabled); errors name ``path`` and a key."""
    return build_server_tls(tls, path).context


def build_server_tls(tls: TLSServerConfig, path: str) -> ServerTLS:
    """``build_ssl_context``, with the served chain's expiry."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated, and asked for here
            warnings.simplefilter("ignore", DeprecationWarning)
            context.minimum_version = VERSIONS[tls.min_version]
            context.maximum_version = VERSIONS[tls.max_version]
    except (ValueError, ssl.SSLError) as err:
        raise WebConfigError(
            path, "tls_server_config.min_version", f"this OpenSSL cannot use it: {err}"
        ) from None
    if tls.cipher_suites:
        try:
            context.set_ciphers(":".join(GO_TO_OPENSSL_CIPHERS[name] for name in tls.cipher_suites))
        except ssl.SSLError:
            raise WebConfigError(
                path,
                "tls_server_config.cipher_suites",
                "none of these suites is available in this OpenSSL",
            ) from None
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    context.set_alpn_protocols(["http/1.1"])
    cert_pem = _load_certificate(context, tls, path)
    _load_client_verification(context, tls, path)
    return ServerTLS(context, chain_not_after(cert_pem))


def _read_pem(path: str, file_name: str, key: str, inline: str) -> bytes:
    if inline:
        return inline.encode("utf-8")
    try:
        with open(file_name, "rb") as handle:
            data = handle.read(MAX_PEM_BYTES + 1)
    except OSError as err:
        raise WebConfigError(path, key, f"cannot read {file_name}: {err.strerror}") from None
    if len(data) > MAX_PEM_BYTES:
        raise WebConfigError(path, key, f"{file_name} is larger than {MAX_PEM_BYTES} bytes")
    return data


def _load_certificate(context: ssl.SSLContext, tls: TLSServerConfig, path: str) -> bytes:
    """Load the certificate chain and key; the chain's PEM, as loaded."""
    cert_key = "tls_server_config." + ("cert" if tls.cert else "cert_file")
    key_key = "tls_server_config." + ("key" if tls.key else "key_file")
    cert_pem = _read_pem(path, tls.cert_file, cert_key, tls.cert)
    key_pem = _read_pem(path, tls.key_file, key_key, tls.key)
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise WebConfigError(path, cert_key, "holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key_pem:
        raise WebConfigError(path, key_key, "holds no PEM private key")
    if b"ENCRYPTED" in key_pem:
        raise WebConfigError(path, key_key, "the key is encrypted; give an unencrypted key")

    def no_passphrase() -> bytes:
        raise WebConfigError(path, key_key, "the key is encrypted; give an unencrypted key")

    try:
        with _pem_file(cert_pem) as cert_path, _pem_file(key_pem) as key_path:
            context.load_cert_chain(cert_path, key_path, password=no_passphrase)
    except ssl.SSLError as err:
        reason = err.reason or str(err)
        if reason == "KEY_VALUES_MISMATCH":
            problem = "the key does not belong to the certificate"
        else:
            problem = f"cannot load the certificate and key: {reason}"
        raise WebConfigError(path, cert_key, problem) from None
    except OSError as err:  # no in-memory file and no writable temporary folder
        raise WebConfigError(
            path, cert_key, f"cannot hand the certificate to OpenSSL: {err.strerror or err}"
        ) from None
    return cert_pem


_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----([A-Za-z0-9+/=\s]+?)-----END CERTIFICATE-----"
)


def chain_not_after(pem: bytes) -> float | None:
    """The earliest notAfter (unix time) of the certificates in ``pem``, the served chain;
    None when none can be read. Only the validity is read from each certificate's DER:
    Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber,
    signature, issuer, validity SEQUENCE { notBefore, notAfter }, ... }, ... }."""
    times = []
    for match in _PEM_CERTIFICATE.finditer(pem):
        try:
            der = base64.b64decode(b"".join(match.group(1).split()), validate=True)
            times.append(_not_after(der))
        except (ValueError, IndexError, binascii.Error):
            continue
    return min(times) if times else None


def _not_after(der: bytes) -> float:
    certificate = _children(_tlv(der, 0)[1])
    tbs = _children(certificate[0][1])
    index = 1 if tbs[0][0] == 0xA0 else 0  # the explicit [0] version, when present
    validity = _children(tbs[index + 3][1])
    tag, value = validity[1]
    text = value.decode("ascii")
    if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ: years 1950-2049 (RFC 5280 4.1.2.5.1)
        year = int(text[:2])
        text = str(1900 + year if year >= 50 else 2000 + year) + text[2:]
    elif tag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise ValueError("not a time")
    if not re.fullmatch(r"\d{14}Z", text):
        raise ValueError("not a DER time")
    fields = [
        int(text[start : start + size])
        for start, size in ((0, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 2))
    ]
    return float(calendar.timegm((*fields, 0, 0, 0)))


def _tlv(data: bytes, at: int) -> tuple[int, bytes, int]:
    """(tag, value, end) of the DER element at ``at`` (single-byte tags, as X.509 uses)."""
    tag, length = data[at], data[at + 1]
    at += 2
    if length & 0x80:
        count = length & 0x7F
        if not 0 < count <= 4:
            raise ValueError("bad DER length")
        length = int.from_bytes(data[at : at + count], "big")
        at += count
    end = at + length
    if end > len(data):
        raise ValueError("DER element runs past its end")
    return tag, data[at:end], end


def _children(data: bytes) -> list[tuple[int, bytes]]:
    out = []
    at = 0
    while at < len(data):
        tag, value, at = _tlv(data, at)
        out.append((tag, value))
    return out


def _load_client_verification(context: ssl.SSLContext, tls: TLSServerConfig, path: str) -> None:
    context.verify_mode = CLIENT_AUTH_MODES[tls.client_auth_type]
    if tls.client_auth_type == "NoClientCert":
        return
    if not (tls.client_ca_file or tls.client_ca):
        # Go verifies client certificates against the system roots when no CA is given.
        context.load_default_certs(ssl.Purpose.CLIENT_AUTH)
        return
    ca_key = "tls_server_config." + ("client_ca" if tls.client_ca else "client_ca_file")
    ca_pem = _read_pem(path, tls.client_ca_file, ca_key, tls.client_ca)
    if b"-----BEGIN CERTIFICATE-----" not in ca_pem:
        raise WebConfigError(path, ca_key, "holds no PEM certificate")
    try:
        context.load_verify_locations(cadata=ca_pem.decode("ascii", errors="replace"))
    except ssl.SSLError as err:
        raise WebConfigError(path, ca_key, f"cannot load the CA: {err.reason or err}") from None


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path OpenSSL can read ``data`` from, gone when the block ends: an anonymous
    in-memory file on Linux, else a private temporary file."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        descriptor = memfd_create("web-config-pem", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(descriptor, data)
            yield f"/proc/self/fd/{descriptor}"
        finally:
            os.close(descriptor)
        return
    with tempfile.TemporaryDirectory(prefix="web-config-") as folder:
        file_name = os.path.join(folder, "pem")
        descriptor = os.open(file_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        yield file_name


class FollowingContext(ssl.SSLContext):
    """The context a listening socket holds: each new connection gets its SSL object from
    ``current()``, called at that moment (and free to reload first)."""

    _current: Callable[[], ssl.SSLContext]

    def __new__(cls, current: Callable[[], ssl.SSLContext]) -> FollowingContext:
        context = super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)
        context._current = current
        return context

    def __init__(self, current: Callable[[], ssl.SSLContext]) -> None:
        pass  # set up in __new__: SSLContext is built there

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        return self._current().wrap_bio(
            incoming,
            outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
            session=session,
        )

    def wrap_socket(
        self,
        sock: Any,
        server_side: bool = False,  # type: ignore[override]
        do_handshake_on_connect: bool = True,
        suppress_ragged_eofs: bool = True,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLSocket:
        return self._current().wrap_socket(
            sock,
            server_side=server_side,
            do_handshake_on_connect=do_handshake_on_connect,
            suppress_ragged_eofs=suppress_ragged_eofs,
            server_hostname=server_hostname,
            session=session,
        )
