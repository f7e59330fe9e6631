"""Fixtures for the web config tests: a fresh PKI per test, bcrypt hashes, TLS servers."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import bcrypt
import pytest
from aiohttp import web

from tests.web.certs import Pki, make_pki

# bcrypt's smallest cost: the same algorithm, ~1 ms a check instead of ~100 ms.
TEST_COST = 4


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture(scope="session")
def hash_of() -> Callable[[str], str]:
    def make(password: str) -> str:
        return bcrypt.hashpw(password.encode(), bcrypt.gensalt(TEST_COST)).decode()

    return make


def client_context(
    pki: Pki, *, cert: Path | None = None, key: Path | None = None, ca: Path | None = None
) -> ssl.SSLContext:
    """What a careful client does: verify the server against the test CA, maybe present
    a client certificate."""
    context = ssl.create_default_context(cafile=str(ca or pki.ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


@asynccontextmanager
async def serving(
    app: web.Application,
    ssl_context: ssl.SSLContext | None,
) -> AsyncIterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port; yield its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = runner.addresses[0][1]
    scheme = "https" if ssl_context is not None else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


HITS = web.AppKey("hits", list)


async def whoami(request: web.Request) -> web.Response:
    """Which client connection this request came on (its port): keep-alive proof."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    request.app[HITS].append(request.path)
    return web.json_response({"client_port": peer[1] if peer else None, "path": request.path})


def demo_app() -> web.Application:
    app = web.Application()
    app[HITS] = []
    app.router.add_get("/{tail:.*}", whoami)
    app.router.add_post("/{tail:.*}", whoami)
    return app
