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
from one version and a key from the other.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

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


def build_ssl_context(tls: TLSServerConfig, path: str) -> ssl.SSLContext:
    """A server context for ``tls`` (which must be enabled); errors name ``path`` and a key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated, and asked for here
            warnings.simplefilter("ignore", DeprecationWarning)
            context.minimum_version = VERSIONS[tls.min_version]
            context.maximum_version = VERSIONS[tls.max_version]
    except (ValueError, ssl.SSLError) as err:
        raise WebConfigError(path, "tls_server_config.min_version",
                             f"this OpenSSL cannot use it: {err}") from None
    if tls.cipher_suites:
        try:
            context.set_ciphers(":".join(GO_TO_OPENSSL_CIPHERS[name]
                                         for name in tls.cipher_suites))
        except ssl.SSLError:
            raise WebConfigError(path, "tls_server_config.cipher_suites",
                                 "none of these suites is available in this OpenSSL") from None
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    context.set_alpn_protocols(["http/1.1"])
    _load_certificate(context, tls, path)
    _load_client_verification(context, tls, path)
    return context


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


def _load_certificate(context: ssl.SSLContext, tls: TLSServerConfig, path: str) -> None:
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
        raise WebConfigError(path, cert_key, f"cannot hand the certificate to OpenSSL: "
                                             f"{err.strerror or err}") from None


def _load_client_verification(context: ssl.SSLContext, tls: TLSServerConfig,
                              path: str) -> None:
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

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                 server_side: bool = False, server_hostname: str | bytes | None = None,
                 session: ssl.SSLSession | None = None) -> ssl.SSLObject:
        return self._current().wrap_bio(incoming, outgoing, server_side=server_side,
                                        server_hostname=server_hostname, session=session)

    def wrap_socket(self, sock: Any, server_side: bool = False,  # type: ignore[override]
                    do_handshake_on_connect: bool = True, suppress_ragged_eofs: bool = True,
                    server_hostname: str | bytes | None = None,
                    session: ssl.SSLSession | None = None) -> ssl.SSLSocket:
        return self._current().wrap_socket(
            sock, server_side=server_side, do_handshake_on_connect=do_handshake_on_connect,
            suppress_ragged_eofs=suppress_ragged_eofs, server_hostname=server_hostname,
            session=session)
