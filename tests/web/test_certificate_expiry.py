"""The served certificate's expiry: exported, and logged when it is expired or close to it,
at load, at each reload and when a running listener's certificate crosses into either. An
expired certificate is still served (as exporter-toolkit serves it): the series and the log
are how an operator learns of it before the clients do."""

from __future__ import annotations

import datetime
import logging
import ssl

import aiohttp
from prometheus_client import CollectorRegistry

from exporter.web import WebListener
from exporter.web.listener import EXPIRY_WARNING_SECONDS
from exporter.web.metrics import NOT_AFTER, WebConfigCollector
from exporter.web.tls import chain_not_after
from tests.web.certs import Pki, issue, make_ca
from tests.web.conftest import demo_app, serving
from tests.web.test_tls_auth import tls_config, write_config

NOW = datetime.datetime(2027, 6, 1, tzinfo=datetime.timezone.utc)


class Clock:
    def __init__(self, now: datetime.datetime = NOW) -> None:
        self.now = now.timestamp()

    def __call__(self) -> float:
        return self.now


def server_certificate(pki: Pki, valid_until: datetime.datetime) -> float:
    """A new server certificate (and chain file: leaf then its CA) at tls.crt/tls.key."""
    ca = make_ca("expiry test CA")
    leaf = issue(
        ca,
        "exporter",
        server=True,
        dns=("localhost",),
        ips=("127.0.0.1",),
        valid_from=valid_until - datetime.timedelta(days=400),
        valid_until=valid_until,
    )
    (pki.folder / "tls.crt").write_bytes(leaf.cert_pem + ca.cert_pem)
    (pki.folder / "tls.key").write_bytes(leaf.key_pem)
    return valid_until.timestamp()


def exported(listener: WebListener) -> float | None:
    registry = CollectorRegistry()
    registry.register(WebConfigCollector(lambda: [listener.status()]))
    return registry.get_sample_value(NOT_AFTER, {"listener": listener.name})


def warnings_of(caplog) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "certificate" in record.getMessage()
    ]


async def test_an_expired_certificate_is_served_exported_and_warned_about(pki, caplog):
    caplog.set_level(logging.INFO)
    expired = server_certificate(pki, NOW - datetime.timedelta(days=3))
    listener = WebListener.open(write_config(pki, tls_config()), "web", wall_clock=Clock())
    assert exported(listener) == expired
    (said,) = warnings_of(caplog)
    assert "web: the TLS certificate served expired at 2027-05-29 00:00:00 UTC" in said
    assert "3.0 days ago" in said
    accept_anything = ssl.create_default_context()
    accept_anything.check_hostname = False
    accept_anything.verify_mode = ssl.CERT_NONE
    async with serving(demo_app(), listener.ssl_context) as url:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/x", ssl=accept_anything) as response:
                assert response.status == 200  # still served
    assert len(warnings_of(caplog)) == 1  # once, not at every connection


def test_a_certificate_close_to_expiry_is_warned_about_once(pki, caplog):
    caplog.set_level(logging.INFO)
    soon = server_certificate(pki, NOW + datetime.timedelta(days=3, hours=12))
    clock = Clock()
    listener = WebListener.open(write_config(pki, tls_config()), "tap", wall_clock=clock)
    assert exported(listener) == soon
    assert warnings_of(caplog) == [
        "tap: the TLS certificate served expires at 2027-06-04 "
        f"12:00:00 UTC, in 3.5 days: renew it ({pki.folder}/web.yml)"
    ]
    listener.current_ssl_context()
    assert len(warnings_of(caplog)) == 1
    clock.now = soon + 1  # the running listener's certificate expires: said at once more
    listener.current_ssl_context()
    assert len(warnings_of(caplog)) == 2 and "expired" in warnings_of(caplog)[1]


def test_a_valid_certificate_warns_only_when_it_gets_close_and_a_renewal_is_exported(pki, caplog):
    caplog.set_level(logging.INFO)
    until = server_certificate(pki, NOW + datetime.timedelta(days=90))
    clock = Clock()
    listener = WebListener.open(write_config(pki, tls_config()), "web", wall_clock=clock)
    assert exported(listener) == until and warnings_of(caplog) == []
    clock.now = until - EXPIRY_WARNING_SECONDS + 60  # 14 days left, less a minute
    listener.current_ssl_context()  # a new TLS connection
    assert len(warnings_of(caplog)) == 1 and "in 14.0 days" in warnings_of(caplog)[0]
    renewed = server_certificate(pki, NOW + datetime.timedelta(days=180))
    listener.current_ssl_context()  # the changed files are reloaded
    assert exported(listener) == renewed and len(warnings_of(caplog)) == 1


def test_without_tls_there_is_no_expiry_series(pki):
    listener = WebListener.open(
        write_config(pki, "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"), "web"
    )
    assert exported(listener) is None


def test_the_expiry_is_read_from_each_certificate_of_the_chain(pki):
    ca = make_ca("chain CA")
    early = issue(ca, "a", server=True, valid_until=NOW)
    late = issue(ca, "b", server=True, valid_until=NOW + datetime.timedelta(days=1))
    assert chain_not_after(late.cert_pem + early.cert_pem) == NOW.timestamp()
    # UTCTime years before 2050, GeneralizedTime from 2050 on (RFC 5280 4.1.2.5)
    far = issue(
        ca,
        "c",
        server=True,
        valid_until=datetime.datetime(2051, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
    )
    assert (
        chain_not_after(far.cert_pem)
        == datetime.datetime(2051, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc).timestamp()
    )
    assert chain_not_after(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----") is None
    assert chain_not_after(b"no certificate here") is None
