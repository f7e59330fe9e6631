"""TLS, client certificates, basic auth and headers on a real aiohttp listener (127.0.0.1)."""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from exporter.web import WebConfigError, WebListener
from exporter.web.auth import PasswordVerifier, Verdict
from tests.web.certs import Pki
from tests.web.conftest import HITS, client_context, demo_app, serving

HEADERS = (
    "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
    "    Strict-Transport-Security: max-age=63072000\n"
)


def write_config(pki: Pki, text: str) -> str:
    path = pki.folder / "web.yml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def tls_config(extra: str = "") -> str:
    return "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n" + extra


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


async def get(
    url: str,
    context: ssl.SSLContext | bool,
    **kwargs: object,
) -> tuple[int, dict[str, str], str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, ssl=context, **kwargs) as response:  # type: ignore[arg-type]
            return response.status, dict(response.headers), await response.text()


async def test_tls_only_serves_https_with_the_configured_certificate(pki):
    listener = WebListener.open(write_config(pki, tls_config()), "web")
    app = demo_app()
    listener.install(app)
    async with serving(app, listener.ssl_context) as url:
        status, _headers, _body = await get(url + "/metrics", client_context(pki))
        assert status == 200
        # A client that trusts another CA refuses the server's certificate.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get(url + "/metrics", client_context(pki, ca=pki.other_ca))
        # Plain HTTP on the TLS port gets nothing served.
        with pytest.raises(aiohttp.ClientError):
            await get(url.replace("https", "http") + "/metrics", False)


async def test_basic_auth_401_without_or_with_wrong_credentials_200_with_right(pki, hash_of):
    config = tls_config() + HEADERS + f"basic_auth_users:\n  prometheus: '{hash_of('s3cret')}'\n"
    listener = WebListener.open(write_config(pki, config), "web")
    app = demo_app()
    listener.install(app)
    context = client_context(pki)
    async with serving(app, listener.ssl_context) as url:
        for headers in (
            {},
            basic("prometheus", "wrong"),
            basic("nobody", "s3cret"),
            {"Authorization": "Bearer s3cret"},
            {"Authorization": "Basic !!!"},
        ):
            status, response_headers, body = await get(url + "/metrics", context, headers=headers)
            assert status == 401, headers
            assert response_headers["WWW-Authenticate"] == "Basic"
            assert response_headers["X-Frame-Options"] == "deny", "headers on a 401 too"
            assert "client_port" not in body
        status, response_headers, _body = await get(
            url + "/metrics", context, headers=basic("prometheus", "s3cret")
        )
        assert status == 200
        assert response_headers["Strict-Transport-Security"] == "max-age=63072000"
        assert "WWW-Authenticate" not in response_headers


async def test_open_paths_and_bearer_paths_skip_basic_auth_others_do_not(pki, hash_of):
    config = tls_config() + f"basic_auth_users:\n  prometheus: '{hash_of('s3cret')}'\n"
    listener = WebListener.open(write_config(pki, config), "web")
    app = demo_app()
    listener.install(app, open_paths=("/-/healthy",), bearer_paths=("/v1/usage",))
    context = client_context(pki)
    async with serving(app, listener.ssl_context) as url:
        assert (await get(url + "/-/healthy", context))[0] == 200
        assert (await get(url + "/v1/usage", context))[0] == 200  # the route's own token rules
        assert (await get(url + "/-/healthy/x", context))[0] == 401
        assert (await get(url + "/", context))[0] == 401


async def test_headers_reach_streamed_and_error_responses(pki):
    listener = WebListener.open(write_config(pki, tls_config() + HEADERS), "web")
    from aiohttp import web

    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        return response

    app = web.Application()
    app.router.add_get("/stream", streamed)
    listener.install(app)
    async with serving(app, listener.ssl_context) as url:
        for path, expected in (("/stream", 200), ("/missing", 404)):
            status, headers, _body = await get(url + path, client_context(pki))
            assert status == expected
            assert headers["X-Frame-Options"] == "deny"


# --- client certificates ----------------------------------------------------------------


def _blocking_request(url: str, context: ssl.SSLContext) -> bytes:
    host, port = url.removeprefix("https://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            chunks = []
            while chunk := tls.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)


async def handshake_and_request(url: str, context: ssl.SSLContext) -> bytes:
    """One raw HTTP/1.1 request over TLS from a blocking socket (in a thread, so the server
    in this loop answers), which raises the SSL alert the server sends when it refuses."""
    return await asyncio.to_thread(_blocking_request, url, context)


async def refused(url: str, context: ssl.SSLContext) -> str:
    """How the server turned the client away: an SSL alert, or (asyncio's server aborts a
    failed handshake without flushing its alert) a connection closed before any reply."""
    try:
        answer = await handshake_and_request(url, context)
    except ssl.SSLError as err:
        return str(err.reason)
    except ConnectionError as err:
        return type(err).__name__
    assert answer == b"", answer[:100]
    return "closed"


MTLS = "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"


async def test_mtls_refuses_a_client_without_a_certificate_at_the_handshake(pki):
    listener = WebListener.open(write_config(pki, tls_config(MTLS)), "web")
    app = demo_app()
    listener.install(app)
    async with serving(app, listener.ssl_context) as url:
        answer = await handshake_and_request(
            url, client_context(pki, cert=pki.client_cert, key=pki.client_key)
        )
        assert answer.startswith(b"HTTP/1.1 200")
        assert app[HITS] == ["/metrics"]
        for context in (
            client_context(pki),  # no certificate
            client_context(pki, cert=pki.other_client_cert, key=pki.other_client_key),
        ):  # another CA's
            assert await refused(url, context)
        assert app[HITS] == ["/metrics"], "a refused client never reaches the app"


async def test_mtls_over_tls12_fails_inside_the_handshake(pki):
    listener = WebListener.open(write_config(pki, tls_config(MTLS)), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        context = client_context(pki)
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        host, port = url.removeprefix("https://").split(":")
        # TLS 1.2: the server refuses before its Finished, so the client's own handshake
        # (open_connection) fails.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await asyncio.open_connection(host, int(port), ssl=context, server_hostname="localhost")


async def test_verify_if_given_accepts_none_refuses_an_unknown_one(pki):
    config = tls_config("  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: ca.crt\n")
    listener = WebListener.open(write_config(pki, config), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        assert (await handshake_and_request(url, client_context(pki))).startswith(b"HTTP/1.1 200")
        assert await refused(
            url, client_context(pki, cert=pki.other_client_cert, key=pki.other_client_key)
        )


@pytest.mark.parametrize("allowed", ["prometheus.example", "spiffe://test/prometheus"])
async def test_client_allowed_sans(pki, allowed):
    config = tls_config(MTLS + f"  client_allowed_sans: ['{allowed}', '::1']\n")
    listener = WebListener.open(write_config(pki, config), "web")
    app = demo_app()
    listener.install(app)
    async with serving(app, listener.ssl_context) as url:
        good = client_context(pki, cert=pki.client_cert, key=pki.client_key)
        assert (await handshake_and_request(url, good)).startswith(b"HTTP/1.1 200")
        intruder = client_context(pki, cert=pki.intruder_cert, key=pki.intruder_key)
        assert (await handshake_and_request(url, intruder)).startswith(b"HTTP/1.1 403")


# --- versions, ciphers, inline material -------------------------------------------------


async def test_min_version_refuses_older_clients(pki):
    listener = WebListener.open(write_config(pki, tls_config("  min_version: TLS13\n")), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        old = client_context(pki)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(aiohttp.ClientConnectorError):
            await get(url, old)
        assert (await get(url, client_context(pki)))[0] == 200


async def test_cipher_suites_are_the_only_tls12_suites_offered(pki):
    config = tls_config(
        "  max_version: TLS12\n  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384]\n"
    )
    listener = WebListener.open(write_config(pki, config), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        other = client_context(pki)
        other.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256")
        with pytest.raises(aiohttp.ClientConnectorError):
            await get(url, other)
        chosen = client_context(pki)
        chosen.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384")
        host, port = url.removeprefix("https://").split(":")
        _reader, writer = await asyncio.open_connection(
            host, int(port), ssl=chosen, server_hostname="localhost"
        )
        assert writer.get_extra_info("cipher")[0] == "ECDHE-ECDSA-AES256-GCM-SHA384"
        writer.close()


async def test_inline_certificate_key_and_client_ca(pki):
    def block(path: Path) -> str:
        return "|\n" + "".join("    " + line + "\n" for line in path.read_text().splitlines())

    config = (
        "tls_server_config:\n"
        f"  cert: {block(pki.server_cert)}  key: {block(pki.server_key)}"
        "  client_auth_type: RequireAndVerifyClientCert\n"
        f"  client_ca: {block(pki.ca)}"
    )
    listener = WebListener.open(write_config(pki, config), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        good = client_context(pki, cert=pki.client_cert, key=pki.client_key)
        assert (await handshake_and_request(url, good)).startswith(b"HTTP/1.1 200")
        assert await refused(url, client_context(pki))


@pytest.mark.parametrize(
    "change,key,words",
    [
        (lambda pki: pki.server_key.unlink(), "tls_server_config.key_file", "cannot read"),
        (
            lambda pki: pki.server_key.write_bytes(pki.client_key.read_bytes()),
            "tls_server_config.cert_file",
            "does not belong to the certificate",
        ),
        (
            lambda pki: pki.server_cert.write_text("not a certificate"),
            "tls_server_config.cert_file",
            "holds no PEM certificate",
        ),
        (
            lambda pki: pki.server_key.write_text(
                "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n"
            ),
            "tls_server_config.key_file",
            "encrypted",
        ),
    ],
    ids=["missing-key", "wrong-key", "not-pem", "encrypted"],
)
def test_certificate_problems_are_one_line_errors(pki, change, key, words):
    change(pki)
    with pytest.raises(WebConfigError) as caught:
        WebListener.open(write_config(pki, tls_config()), "web")
    assert caught.value.key == key and words in str(caught.value)


def test_basic_auth_is_refused_where_the_listener_cannot_take_it(pki, hash_of):
    path = write_config(pki, tls_config() + f"basic_auth_users:\n  a: '{hash_of('x')}'\n")
    with pytest.raises(WebConfigError, match="basic_auth_users: not supported on this"):
        WebListener.open(path, "tap", allow_basic_auth=False)


# --- the verifier: cache, bound, unknown users ------------------------------------------


class CountingCheck:
    """bcrypt.checkpw stand-in that can be held, to pile requests up behind it."""

    def __init__(self, real: Callable[[bytes, bytes], bool]) -> None:
        self.real = real
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.gate.wait(10)
        return self.real(password, hashed)


async def test_successes_are_cached_failures_are_not(hash_of):
    import bcrypt

    users = (("prometheus", hash_of("s3cret").encode()),)
    verifier = PasswordVerifier(check=bcrypt.checkpw)
    header = basic("prometheus", "s3cret")["Authorization"]
    assert await verifier.verify(header, users) is Verdict.ALLOWED
    assert await verifier.verify(header, users) is Verdict.ALLOWED
    assert verifier.bcrypt_checks == 1
    wrong = basic("prometheus", "nope")["Authorization"]
    for _ in range(2):
        assert await verifier.verify(wrong, users) is Verdict.DENIED
    assert verifier.bcrypt_checks == 3
    # A changed hash for the same user is a new cache key: the old password no longer works.
    assert (
        await verifier.verify(header, (("prometheus", hash_of("new").encode()),)) is Verdict.DENIED
    )
    # Unknown users cost a bcrypt check too (no timing difference) and are never let in.
    assert await verifier.verify(basic("ghost", "s3cret")["Authorization"], users) is Verdict.DENIED
    assert verifier.bcrypt_checks == 5


async def test_cache_holds_at_most_its_size(hash_of):
    import bcrypt

    users = tuple((f"user{index}", hash_of(f"pw{index}").encode()) for index in range(3))
    verifier = PasswordVerifier(check=bcrypt.checkpw, cache_size=2)
    headers = [basic(f"user{index}", f"pw{index}")["Authorization"] for index in range(3)]
    for header in headers:
        assert await verifier.verify(header, users) is Verdict.ALLOWED
    assert verifier.bcrypt_checks == 3
    assert await verifier.verify(headers[2], users) is Verdict.ALLOWED  # still cached
    assert verifier.bcrypt_checks == 3
    assert await verifier.verify(headers[0], users) is Verdict.ALLOWED  # evicted: checked again
    assert verifier.bcrypt_checks == 4


async def test_waiting_checks_are_bounded(hash_of):
    import bcrypt

    check = CountingCheck(bcrypt.checkpw)
    check.gate.clear()
    verifier = PasswordVerifier(check=check, max_waiting=2)
    users = (("a", hash_of("x").encode()),)
    header = basic("a", "x")["Authorization"]
    first = asyncio.ensure_future(verifier.verify(header, users))
    second = asyncio.ensure_future(verifier.verify(basic("a", "y")["Authorization"], users))
    await asyncio.sleep(0)  # both are now waiting (one in the worker thread)
    assert await verifier.verify(basic("a", "z")["Authorization"], users) is Verdict.BUSY
    check.gate.set()
    assert await first is Verdict.ALLOWED
    assert await second is Verdict.DENIED


async def test_passwords_longer_than_72_bytes_match_as_in_go(hash_of):
    long_password = "p" * 72
    users = (("a", hash_of(long_password).encode()),)
    verifier = PasswordVerifier()
    assert (
        await verifier.verify(basic("a", long_password + "ignored")["Authorization"], users)
        is Verdict.ALLOWED
    )
    assert await verifier.verify(basic("a", "p" * 71)["Authorization"], users) is Verdict.DENIED


def test_without_in_memory_files_a_private_temporary_file_is_used_and_removed(
    pki, monkeypatch, tmp_path
):
    import os
    import tempfile

    monkeypatch.delattr(os, "memfd_create", raising=False)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    listener = WebListener.open(write_config(pki, tls_config()), "web")
    assert listener.ssl_context is not None
    assert list(scratch.iterdir()) == [], "the key must not stay on disk"
