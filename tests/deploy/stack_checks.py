"""What a user checks on a running stack, by HTTP and by the host's own tables: shared by the
compose test (tests/deploy/test_compose_up.py) and the README's stack without Docker
(tests/deploy/test_stack_without_docker.py), which publish the same ports on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from exporter.monitoring.config import duration_seconds
from tests.deploy.helpers import ROOT

T = TypeVar("T")
PROMETHEUS = "http://127.0.0.1:9090"
ALERTMANAGER = "http://127.0.0.1:9093"
EXPORTER = "http://127.0.0.1:10123"


def eventually(
    probe: Callable[[], T | None],
    within: float,
    what: str,
    diagnose: Callable[[], str] | None = None,
) -> T:
    """Poll another process's HTTP state (there is no event to await) until it answers;
    ``diagnose`` adds to the failure's message (a service's last log lines)."""
    deadline = time.monotonic() + within
    last: object = None
    while True:
        try:
            found = probe()
            if found is not None:
                return found
        except (OSError, ValueError, KeyError) as err:  # not up yet, or not yet complete
            last = err
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"{what}: not within {within:.0f} s ({last})"
                + (f"\n{diagnose()}" if diagnose else "")
            )
        time.sleep(1)


def http_get(url: str, timeout: float = 10) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return (
                response.status,
                response.headers.get("Content-Type", ""),
                response.read().decode("utf-8", "replace"),
            )
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode("utf-8", "replace")


def api(url: str) -> Any:
    status, _type, body = http_get(url)
    if status != 200:
        raise ValueError(f"{url}: {status} {body[:200]}")
    return json.loads(body)["data"] if "/api/v1/" in url else json.loads(body)


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def prometheus_jobs() -> dict[str, list[str]]:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    return {
        job["job_name"]: [
            target for static in job["static_configs"] for target in static["targets"]
        ]
        for job in config["scrape_configs"]
    }


def shipped_rules() -> set[tuple[str, str, str]]:
    """(file, group, rule name) of every rule in alerts/*.yaml."""
    out = set()
    for path in sorted((ROOT / "alerts").glob("*.yaml")):
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            for rule in group["rules"]:
                out.add((path.name, group["name"], rule.get("alert") or rule["record"]))
    return out


def first_evaluations_within() -> float:
    """Seconds within which Prometheus evaluates every shipped group once after loading it:
    a group's first evaluation falls at an offset within its interval (Prometheus spreads
    groups by a hash of their name), and the slowest groups run every two minutes
    (``caller_detail_interval``), so the longest interval and a scrape's worth of margin."""
    longest = 15.0  # deploy/prometheus.yml's evaluation_interval, for groups without one
    for path in sorted((ROOT / "alerts").glob("*.yaml")):
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            if "interval" in group:
                longest = max(longest, duration_seconds(group["interval"]))
    return longest + 45.0


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the host's sockets listening on a TCP port (IPv4 and IPv6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                raw = bytes.fromhex(address)
                if width == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


ALERT_LINE = re.compile(
    r"^(?P<receiver>\S+) (?P<status>FIRING|RESOLVED) (?P<name>\S+) "
    r"\{(?P<labels>[^}]*)\}"
)


def parse_alert(line: str) -> dict[str, Any] | None:
    """deploy/alert-logger.py's line for one alert -> its receiver, status, name, labels."""
    match = ALERT_LINE.match(line)
    if not match:
        return None
    labels = dict(pair.split("=", 1) for pair in match["labels"].split(",") if pair)
    return {
        "receiver": match["receiver"],
        "status": match["status"],
        "name": match["name"],
        "labels": labels,
    }


def scrape_targets_up(
    rewrite: Mapping[str, str] | None = None,
) -> Callable[[], dict[str, tuple[str, str]]]:
    """A probe for :func:`eventually`: job/instance -> (health, last error) of every target,
    once those of deploy/prometheus.yml (addresses rewritten as given) are all there and up."""
    expected = {
        f"{job}/{(rewrite or {}).get(target, target)}"
        for job, targets in prometheus_jobs().items()
        for target in targets
    }

    def probe() -> dict[str, tuple[str, str]]:
        active = api(f"{PROMETHEUS}/api/v1/targets")["activeTargets"]
        found = {
            target["labels"]["job"] + "/" + target["labels"]["instance"]: (
                target["health"],
                target["lastError"],
            )
            for target in active
        }
        if set(found) != expected or any(health != "up" for health, _ in found.values()):
            raise ValueError(f"targets: {found}, expected {sorted(expected)}")
        return found

    return probe


def evaluated_rules() -> list[dict[str, Any]] | None:
    """Every loaded rule with its file and group, once each group was evaluated (every 15 s;
    rules are loaded with the config, before the API answers, so none loaded stays none)."""
    groups = api(f"{PROMETHEUS}/api/v1/rules")["groups"]
    rules = [
        dict(rule, file=Path(group["file"]).name, group=group["name"])
        for group in groups
        for rule in group["rules"]
    ]
    if any(rule["lastEvaluation"].startswith("0001-") for rule in rules):
        return None
    return rules


def assert_every_shipped_rule_is_loaded_and_healthy(
    rules: list[dict[str, Any]], diagnose: Callable[[], str] = str
) -> None:
    loaded = {(rule["file"], rule["group"], rule["name"]) for rule in rules}
    shipped = shipped_rules()
    assert loaded == shipped, (
        f"missing {sorted(shipped - loaded)[:5]}, not shipped {sorted(loaded - shipped)[:5]}"
        f"\n{diagnose()}"
    )
    unhealthy = [
        (rule["name"], rule["health"], rule.get("lastError"))
        for rule in rules
        if rule["health"] != "ok"
    ]
    assert not unhealthy, f"{unhealthy}\n{diagnose()}"
