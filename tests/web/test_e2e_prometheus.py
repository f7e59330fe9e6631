"""A real Prometheus 2.42 (Debian's package) scrapes the real exporter over TLS.

Two exporters, each started as a user would with ``--web.config.file``: one with TLS and
basic auth, one with mutual TLS. Prometheus' own ``scrape_configs`` use ``scheme: https``,
``tls_config`` (``ca_file``, and a client certificate where needed) and ``basic_auth``.
Right credentials get ``up == 1`` and the exporter's series; a wrong password or none gets
``up == 0`` with a 401, and a scraper without a client certificate is refused by the TLS
handshake (no HTTP status at all).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.monitoring.common import require_tool
from tests.monitoring.test_e2e_alerts import (
    Processes,
    exporter_command,
    free_port,
    instant_query,
    poll_until,
    wait_http_ok,
)
from tests.web.certs import Pki, make_pki

pytestmark = pytest.mark.e2e

EXPECTED_UP = {
    "tls-auth": 1,
    "wrong-password": 0,
    "no-credentials": 0,
    "mtls": 1,
    "mtls-no-cert": 0,
}


@pytest.fixture
def processes(tmp_path: Path):  # type: ignore[no-untyped-def]
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def scrape_job(
    name: str, target: str, tls: dict[str, str], auth: dict[str, str] | None = None
) -> dict[str, Any]:
    job: dict[str, Any] = {
        "job_name": name,
        "scheme": "https",
        "tls_config": tls,
        "static_configs": [{"targets": [target]}],
    }
    if auth is not None:
        job["basic_auth"] = auth
    return job


def prometheus_config(
    pki: Pki, password: str, auth_target: str, mtls_target: str
) -> dict[str, Any]:
    ca = {"ca_file": str(pki.ca)}
    client = {**ca, "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            scrape_job(
                "tls-auth", auth_target, ca, {"username": "prometheus", "password": password}
            ),
            scrape_job(
                "wrong-password",
                auth_target,
                ca,
                {"username": "prometheus", "password": password + "x"},
            ),
            scrape_job("no-credentials", auth_target, ca),
            scrape_job("mtls", mtls_target, client),
            scrape_job("mtls-no-cert", mtls_target, ca),
        ],
    }


async def target_errors(session: aiohttp.ClientSession, prometheus: str) -> dict[str, str]:
    async with session.get(f"http://{prometheus}/api/v1/targets") as response:
        body = await response.json()
    return {
        target["labels"]["job"]: target["lastError"] for target in body["data"]["activeTargets"]
    }


async def test_prometheus_scrapes_over_tls_with_basic_auth_and_client_certificates(
    tmp_path, processes, fake_vllm, hash_of
):
    prometheus_bin = require_tool("prometheus")
    pki = make_pki(tmp_path / "pki")
    password = secrets.token_urlsafe(16)
    (pki.folder / "auth.yml").write_text(
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"
        f"basic_auth_users:\n  prometheus: '{hash_of(password)}'\n",
        encoding="utf-8",
    )
    (pki.folder / "mtls.yml").write_text(
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n",
        encoding="utf-8",
    )
    addr = {name: f"127.0.0.1:{free_port()}" for name in ("auth", "mtls", "prometheus")}
    for name in ("auth", "mtls"):
        processes.start(
            f"exporter-{name}",
            *exporter_command(
                "--vllm.url",
                fake_vllm.url,
                "--web.listen-address",
                addr[name],
                "--web.config.file",
                str(pki.folder / f"{name}.yml"),
                "--log.level",
                "info",
            ),
        )
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(
        yaml.safe_dump(prometheus_config(pki, password, addr["auth"], addr["mtls"])),
        encoding="utf-8",
    )
    processes.start(
        "prometheus",
        prometheus_bin,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={tmp_path / 'prom-data'}",
        f"--web.listen-address={addr['prometheus']}",
    )
    async with aiohttp.ClientSession() as session:
        await wait_http_ok(session, f"http://{addr['prometheus']}/-/ready", processes)
        # Every job scraped at least once (each has an `up` sample).
        await poll_until(session, addr["prometheus"], processes, f"count(up) == {len(EXPECTED_UP)}")
        results = await instant_query(session, addr["prometheus"], "up")
        up = {result["metric"]["job"]: int(float(result["value"][1])) for result in results}
        assert up == EXPECTED_UP, await target_errors(session, addr["prometheus"])
        # The scrapes that got in brought the exporter's data.
        for job in ("tls-auth", "mtls"):
            await poll_until(
                session, addr["prometheus"], processes, f'vllm_cache_engine_up{{job="{job}"}} == 1'
            )
        errors = await target_errors(session, addr["prometheus"])
    assert errors["tls-auth"] == "" and errors["mtls"] == ""
    assert "401" in errors["wrong-password"] and "401" in errors["no-credentials"]
    # Refused by TLS, not by HTTP. (asyncio closes a failed handshake without flushing the
    # TLS alert, so Go's client reports the connection's end, an EOF, a reset, or "server
    # closed idle connection" (the connection ended before any response byte) depending on
    # which side's packets land first, rather than the alert.)
    refused = errors["mtls-no-cert"]
    assert "HTTP status" not in refused
    assert any(
        end in refused
        for end in (
            "EOF",
            "tls:",
            "connection reset by peer",
            "broken pipe",
            "server closed idle connection",
        )
    ), errors
