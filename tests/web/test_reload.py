"""Reloads: a changed file (or SIGHUP) takes effect for new connections and requests while
open keep-alive connections keep working; a bad file keeps the last good one, counted."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from exporter.web import ReloadStatus, WebListener, install_sighup
from exporter.web.metrics import WebConfigCollector
from tests.web.certs import Pki, issue, make_ca
from tests.web.conftest import client_context, demo_app, serving
from tests.web.test_tls_auth import basic, refused, tls_config, write_config


class Clock:
    """Wall time the listener stamps reloads with, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def rotate_server_certificate(pki: Pki) -> ssl.SSLContext:
    """New CA, new server certificate at the same paths; a client context trusting only
    the new CA."""
    new_ca = make_ca("test-only rotated CA")
    issue(new_ca, "exporter", server=True, dns=("localhost",), ips=("127.0.0.1",)).write(
        pki.folder, "tls"
    )
    (pki.folder / "new-ca.crt").write_bytes(new_ca.cert_pem)
    return ssl.create_default_context(cafile=str(pki.folder / "new-ca.crt"))


async def port_of(session: aiohttp.ClientSession, url: str, **kwargs: object) -> int:
    async with session.get(url, **kwargs) as response:  # type: ignore[arg-type]
        assert response.status == 200, response.status
        return (await response.json())["client_port"]


async def test_rotated_certificate_serves_new_connections_open_ones_keep_going(pki):
    listener = WebListener.open(write_config(pki, tls_config()), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        connector = aiohttp.TCPConnector(limit=1, ssl=client_context(pki))
        async with aiohttp.ClientSession(connector=connector) as old_client:
            port = await port_of(old_client, url)
            new_trust = rotate_server_certificate(pki)
            # A new connection: the stat sees the new files, the new certificate is served.
            async with aiohttp.ClientSession() as new_client:
                await port_of(new_client, url, ssl=new_trust)
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await port_of(new_client, url, ssl=client_context(pki))  # the old CA
            # The open connection was not dropped and still answers.
            assert await port_of(old_client, url) == port
    assert listener.status().successes == 1 and listener.status().failures == 0


async def test_new_users_apply_to_the_next_request_on_an_open_connection(pki, hash_of):
    users = "basic_auth_users:\n  prometheus: '{}'\n"
    path = write_config(pki, tls_config() + users.format(hash_of("old")))
    listener = WebListener.open(path, "web")
    app = demo_app()
    listener.install(app)
    async with serving(app, listener.ssl_context) as url:
        connector = aiohttp.TCPConnector(limit=1, ssl=client_context(pki))
        async with aiohttp.ClientSession(connector=connector) as client:
            port = await port_of(client, url, headers=basic("prometheus", "old"))
            write_config(pki, tls_config() + users.format(hash_of("new")))
            async with client.get(url, headers=basic("prometheus", "old")) as response:
                assert response.status == 401
            assert await port_of(client, url, headers=basic("prometheus", "new")) == port


async def test_client_certificates_turned_on_by_a_reload_apply_to_new_connections(pki):
    """The verify mode comes from the reloaded context too (an sni_callback swap could
    not change it)."""
    listener = WebListener.open(write_config(pki, tls_config()), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        async with aiohttp.ClientSession() as client:
            await port_of(client, url, ssl=client_context(pki))
        write_config(
            pki,
            tls_config(
                "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"
            ),
        )
        assert await refused(url, client_context(pki))
        async with aiohttp.ClientSession() as client:
            await port_of(
                client, url, ssl=client_context(pki, cert=pki.client_cert, key=pki.client_key)
            )


async def test_a_bad_file_keeps_the_last_good_one_logs_once_and_is_counted(pki, hash_of, caplog):
    path = write_config(pki, tls_config() + f"basic_auth_users:\n  a: '{hash_of('pw')}'\n")
    seen: list[ReloadStatus] = []
    clock = Clock()
    listener = WebListener.open(path, "web", wall_clock=clock, on_reload=seen.append)
    app = demo_app()
    listener.install(app)
    started_at = listener.status().last_success_unix
    async with serving(app, listener.ssl_context) as url:
        async with aiohttp.ClientSession() as client:
            write_config(pki, "tls_server_config: [broken\n")
            caplog.set_level(logging.ERROR, logger="exporter.web.listener")
            for _ in range(3):  # three requests, one failed attempt: the file did not change
                await port_of(client, url, ssl=client_context(pki), headers=basic("a", "pw"))
            errors = [record for record in caplog.records if record.levelno == logging.ERROR]
            assert len(errors) == 1
            assert "keeping the previous one" in errors[0].getMessage()
            assert "not valid YAML" in errors[0].getMessage()
            assert listener.status().failures == 1 and seen[-1].failures == 1
            # Fixed: the next request picks it up.
            clock.now += 60
            write_config(pki, tls_config() + f"basic_auth_users:\n  a: '{hash_of('pw2')}'\n")
            await port_of(client, url, ssl=client_context(pki), headers=basic("a", "pw2"))
    status = listener.status()
    assert (status.successes, status.failures) == (1, 1)
    assert status.last_success_unix == started_at + 60


@pytest.mark.parametrize(
    "broken",
    [
        "http_server_config: {}\n",  # TLS off: needs a restart
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: absent.key\n",
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n  curve_preferences: []\n",
    ],
)
async def test_refused_reloads_keep_tls_serving(pki, broken):
    listener = WebListener.open(write_config(pki, tls_config()), "web")
    async with serving(demo_app(), listener.ssl_context) as url:
        write_config(pki, broken)
        async with aiohttp.ClientSession() as client:
            await port_of(client, url, ssl=client_context(pki))
    assert listener.status().failures == 1 and listener.status().tls


async def test_a_missing_file_that_appears_later_is_picked_up(pki):
    listener = WebListener.open(write_config(pki, tls_config()), "web")
    write_config(pki, "tls_server_config:\n  cert_file: next.crt\n  key_file: next.key\n")
    assert listener.refresh() is False and listener.status().failures == 1
    assert listener.refresh() is False and listener.status().failures == 1  # not retried
    new_ca = make_ca("test-only next CA")
    issue(new_ca, "exporter", server=True, ips=("127.0.0.1",)).write(pki.folder, "next")
    assert listener.refresh() is True
    assert listener.config.tls.cert_file == str(pki.folder / "next.crt")


async def test_sighup_reloads_before_any_new_connection_open_ones_keep_going(pki):
    reloaded = asyncio.Event()
    listener = WebListener.open(
        write_config(pki, tls_config()), "web", on_reload=lambda _status: reloaded.set()
    )
    loop = asyncio.get_running_loop()
    assert install_sighup([listener])
    try:
        async with serving(demo_app(), listener.ssl_context) as url:
            connector = aiohttp.TCPConnector(limit=1, ssl=client_context(pki))
            async with aiohttp.ClientSession(connector=connector) as old_client:
                port = await port_of(old_client, url)
                new_trust = rotate_server_certificate(pki)
                os.kill(os.getpid(), signal.SIGHUP)
                await asyncio.wait_for(reloaded.wait(), timeout=10)  # no connection made
                assert listener.status().successes == 1
                assert await port_of(old_client, url) == port
                async with aiohttp.ClientSession() as new_client:
                    await port_of(new_client, url, ssl=new_trust)
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
    assert listener.status().successes == 1, "the new connection found nothing left to load"


def test_reload_series(pki):
    clock = Clock()
    listener = WebListener.open(write_config(pki, tls_config()), "tap", wall_clock=clock)
    registry = CollectorRegistry()
    registry.register(WebConfigCollector(lambda: [listener.status()]))
    write_config(pki, "nonsense: 1\n")
    listener.reload()
    labels = {"listener": "tap"}
    assert (
        registry.get_sample_value(
            "vllm_cache_exporter_web_config_reloads_total", {**labels, "result": "failure"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "vllm_cache_exporter_web_config_reloads_total", {**labels, "result": "success"}
        )
        == 0
    )
    assert (
        registry.get_sample_value(
            "vllm_cache_exporter_web_config_last_reload_success_timestamp_seconds", labels
        )
        == clock.now
    )
