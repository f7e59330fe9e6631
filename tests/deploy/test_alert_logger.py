"""The compose stack's default receiver, run as compose runs it: Alertmanager's webhook in,
one log line per alert out, and a bad body answered 400 without stopping it."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys

import aiohttp

from tests.deploy.helpers import ROOT

SCRIPT = ROOT / "deploy" / "alert-logger.py"


def notification(status: str, caller: str, description: str) -> dict:
    """An Alertmanager webhook body (version 4), as deploy/alertmanager.yml's routes send."""
    return {
        "version": "4",
        "groupKey": '{}:{alertname="VllmCachePrefixCollapse"}',
        "status": status,
        "receiver": "page",
        "externalURL": "http://alertmanager:9093",
        "groupLabels": {"alertname": "VllmCachePrefixCollapse"},
        "commonLabels": {},
        "commonAnnotations": {},
        "truncatedAlerts": 0,
        "alerts": [
            {
                "status": status,
                "labels": {
                    "alertname": "VllmCachePrefixCollapse",
                    "severity": "critical",
                    "job": "vllm-cache-exporter",
                    "caller": caller,
                },
                "annotations": {
                    "summary": "A caller's prefix-cache hit ratio collapsed.",
                    "description": description,
                },
                "startsAt": "2026-11-29T10:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "http://prometheus:9090/graph",
                "fingerprint": "0123456789abcdef",
            }
        ],
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_logs_one_line_per_alert_and_survives_bad_bodies():
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        env={"ALERT_LOGGER_HOST": "127.0.0.1", "ALERT_LOGGER_PORT": str(port)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        ready = await asyncio.wait_for(process.stdout.readline(), timeout=30)
        assert f"listening on 127.0.0.1:{port}" in ready.decode()
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            firing = notification("firing", "agent-a", "agent-a: 12% cached\nagent-b FIRING")
            async with session.post(f"{base}/page", json=firing) as response:
                assert response.status == 200
            for body in (
                b"not json",
                b'{"alerts": "none"}',
                b'{"alerts": [{"labels": []}]}',
                b"[]",
            ):
                async with session.post(f"{base}/ticket", data=body) as response:
                    assert response.status == 400, body
            resolved = notification("resolved", "agent-a", "back to 93% cached")
            async with session.post(f"{base}/page", data=json.dumps(resolved)) as response:
                assert response.status == 200
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines == [
        "page FIRING VllmCachePrefixCollapse {caller=agent-a,job=vllm-cache-exporter,"
        "severity=critical} agent-a: 12% cached agent-b FIRING",
        "page RESOLVED VllmCachePrefixCollapse {caller=agent-a,job=vllm-cache-exporter,"
        "severity=critical} back to 93% cached",
    ]
    assert err.decode().count("ticket rejected:") == 4
