"""A fleet's store, started for a test: a central Prometheus (remote-write receiver) and
VictoriaMetrics with vmalert, both evaluating the rules generated with the test's monitoring
config, and Prometheus agents remote-writing into both. test_fleet_store.py and
test_fleet_replicas.py share it, so the two stores are started one way.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from exporter.monitoring.config import MonitoringConfig
from exporter.monitoring.render import ALERTS_PATH, RULES_PATH, prometheus_files, vmalert_files
from tests.monitoring.common import require_tool
from tests.monitoring.test_e2e_alerts import Processes, free_port, wait_http_ok

JOB = "vllm-cache-exporter"


@dataclass(frozen=True)
class Stores:
    """Where the stores listen (HOST:PORT), and the prometheus binary the agents run."""

    central: str  # Prometheus: /api/v1/query, /api/v1/alerts
    victoria: str  # VictoriaMetrics: /api/v1/query
    vmalert: str  # vmalert: /api/v1/alerts
    prometheus: str  # path of the prometheus binary

    @property
    def writes(self) -> list[str]:
        """The remote-write URLs of both stores."""
        return [f"http://{self.central}/api/v1/write", f"http://{self.victoria}/api/v1/write"]

    async def wait_ready(self, session: aiohttp.ClientSession, processes: Processes) -> None:
        await wait_http_ok(session, f"http://{self.central}/-/ready", processes)
        await wait_http_ok(session, f"http://{self.victoria}/health", processes)
        await wait_http_ok(session, f"http://{self.vmalert}/health", processes)


def write_rules(workdir: Path, config: MonitoringConfig) -> None:
    """The generated rules, both formats: workdir/prometheus/... and workdir/vmalert/..."""
    for folder, files in (
        ("prometheus", prometheus_files(config)),
        ("vmalert", vmalert_files(config)),
    ):
        for relative in (RULES_PATH, ALERTS_PATH):
            path = workdir / folder / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[relative], "utf-8")


def start_stores(processes: Processes, workdir: Path, config: MonitoringConfig) -> Stores:
    """Start the central Prometheus, VictoriaMetrics and vmalert on the rules of ``config``,
    every evaluation each second. vmalert notifies nobody (an address where nothing listens):
    the test reads its /api/v1/alerts."""
    prometheus = require_tool("prometheus")
    victoria = require_tool("victoria-metrics")
    vmalert = require_tool("vmalert")
    stores = Stores(
        central=f"127.0.0.1:{free_port()}",
        victoria=f"127.0.0.1:{free_port()}",
        vmalert=f"127.0.0.1:{free_port()}",
        prometheus=prometheus,
    )
    write_rules(workdir, config)
    central_config = {
        "global": {"evaluation_interval": "1s"},
        "rule_files": [RULES_PATH, ALERTS_PATH],
    }
    (workdir / "prometheus" / "prometheus.yml").write_text(yaml.safe_dump(central_config))
    processes.start(
        "central",
        prometheus,
        f"--config.file={workdir / 'prometheus' / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'central-data'}",
        f"--web.listen-address={stores.central}",
        "--web.enable-remote-write-receiver",
    )
    processes.start(
        "victoria-metrics",
        victoria,
        f"-storageDataPath={workdir / 'vm-data'}",
        f"-httpListenAddr={stores.victoria}",
        "-search.latencyOffset=0s",
        "-search.disableCache",
        "-loggerLevel=ERROR",
    )
    processes.start(
        "vmalert",
        vmalert,
        f"-rule={workdir / 'vmalert' / RULES_PATH}",
        f"-rule={workdir / 'vmalert' / ALERTS_PATH}",
        f"-datasource.url=http://{stores.victoria}",
        f"-remoteWrite.url=http://{stores.victoria}",
        "-remoteWrite.flushInterval=1s",
        f"-notifier.url=http://127.0.0.1:{free_port()}",
        "-evaluationInterval=1s",
        "-datasource.queryStep=1s",
        f"-httpListenAddr={stores.vmalert}",
        "-loggerLevel=ERROR",
    )
    return stores


def agent_config(exporters: list[str], labels: dict[str, str], writes: list[str]) -> dict[str, Any]:
    """A Prometheus agent scraping ``exporters`` each second under one job, with ``labels``
    as its external labels, remote-writing every second to ``writes``."""
    queue = {"batch_send_deadline": "1s", "min_backoff": "100ms", "max_backoff": "1s"}
    return {
        "global": {"scrape_interval": "1s", "external_labels": labels},
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": exporters}]}],
        "remote_write": [{"url": url, "queue_config": queue} for url in writes],
    }


def start_agent(
    processes: Processes,
    workdir: Path,
    stores: Stores,
    name: str,
    exporters: list[str],
    labels: dict[str, str],
) -> str:
    """Start a Prometheus agent (``--enable-feature=agent``); its HOST:PORT."""
    address = f"127.0.0.1:{free_port()}"
    path = workdir / f"agent-{name}.yml"
    path.write_text(yaml.safe_dump(agent_config(exporters, labels, stores.writes)))
    processes.start(
        f"agent-{name}",
        stores.prometheus,
        "--enable-feature=agent",
        f"--config.file={path}",
        f"--storage.agent.path={workdir / f'agent-{name}-data'}",
        f"--web.listen-address={address}",
    )
    return address


def stop_agents(processes: Processes) -> None:
    """Stop the agents while the stores still take their writes: stopped together, an agent
    retries its last batches against a store already gone until it is killed (15 s each)."""
    agents = [
        process
        for name, process, _log in processes.started
        if name.startswith("agent-") and process.poll() is None
    ]
    for process in agents:
        process.send_signal(signal.SIGTERM)
    for process in agents:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
