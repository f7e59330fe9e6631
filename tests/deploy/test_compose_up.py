"""`docker compose up`, for real: the stack built and run in a Docker engine of the test's own,
checked the way a user would check it, until Alertmanager pages.

The engine, the base image and the cleanup are tests/deploy/engine.py's. The images:
- the exporter's (also the simulator's, the driver's and the alert logger's), built from the
  repository's Dockerfile on a Debian bookworm base with Debian's python3 (``BASE_IMAGE``),
  under the tag compose.yaml names, so compose runs it without building;
- stand-ins for prom/prometheus and prom/alertmanager, built from Debian's packages in the
  official images' shape (tests/deploy/images/), because no image registry is reachable
  here. tests/deploy/compose.images.yaml swaps them in and changes nothing else (a test below
  holds it to that): same commands, configs, mounts, healthchecks, ports, profiles.

Grafana is left out: its image cannot be had or built here (no registry, no Debian
package). Its provisioning stays checked statically (test_compose.py) and with Grafana's own
code (tests/grafana/).

Nothing is chosen for the test: the stack runs as `docker compose up` runs it, at the
scenario's own pace (SPEED=1). The shipped rules' windows are in wall-clock time (a 5m rate
that must stay under half its baseline for 5m, with traffic 5m earlier), so no speed pages
much sooner than ten minutes, and a faster one shortens the collapse itself: at SPEED=2 the
two agents evict each other for about 5 minutes of wall time, the engine's alert fires just
before that ends, and agent-a's, whose ratio trails the engine's by the minute its turns take
to report their usage, went pending at minute 8 and cleared at minute 12 in one CI run, a
minute short of firing. At 1x the collapse lasts about 10 minutes: the engine pages after
about 13.5 minutes and agent-a's follows a minute later, with minutes to spare. Most of
this test's time is that wait, for an event: the alert logger's line.

That wait overlaps the rest of the suite: the engine, the images and ``compose up`` are
started in the background when the session begins and this module runs last
(tests/deploy/compose_stack.py, tests/deploy/conftest.py). So the checks below may run long
after ``up``: the windows they wait in are measured from ``up`` and from the driver's start,
and Docker's events and the alert logger's lines since then are read back.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import yaml

from tests.deploy import compose_stack, dockerfile
from tests.deploy.compose_stack import OVERRIDE, Stack
from tests.deploy.helpers import (
    K8S_DIR,
    ROOT,
    command_args,
    flag_value,
    published_ports,
    resolved_compose,
)
from tests.deploy.stack_checks import (
    ALERTMANAGER,
    EXPORTER,
    PROMETHEUS,
    api,
    assert_every_shipped_rule_is_loaded_and_healthy,
    evaluated_rules,
    eventually,
    first_evaluations_within,
    http_get,
    listening_addresses,
    parse_alert,
    scrape_targets_up,
)

pytestmark = pytest.mark.compose

HEALTHY_WITHIN = 120.0  # seconds from `up`; Docker first probes one interval (30 s) in
PAGE_WITHIN = 22 * 60.0  # seconds from the driver's start; about 12 minutes measured
STOP_WITHIN = 5.0  # seconds for `docker compose stop`; compose's SIGKILL comes at 10 s
JOB = "vllm-cache-exporter"
COLLAPSE = "VllmCachePrefixCollapse"


def model() -> dict[str, Any]:
    return resolved_compose()


def services() -> set[str]:
    return compose_stack.services()


def docker_time(text: str) -> float:
    """Docker's RFC 3339 time with nanoseconds -> seconds since the epoch."""
    match = re.match(r"^(.+T\d\d:\d\d:\d\d)(?:\.(\d+))?Z$", text)
    assert match, text
    whole = datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    return whole.timestamp() + float("0." + (match[2] or "0"))


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The stack started in the background since the session began (tests/deploy/
    compose_stack.py): joined here, so that its start's error fails these tests, and taken
    down after them."""
    start = compose_stack.started(request.config, lambda: tmp_path_factory.mktemp("engine"))
    try:
        yield start.join()
    finally:
        start.close()


# --- the override swaps images and nothing else ----------------------------------------------


def test_the_override_only_swaps_images():
    """Checked without Docker: every key of the override is an image of a compose service."""
    override = yaml.safe_load(OVERRIDE.read_text(encoding="utf-8"))
    assert set(override) == {"services"}
    for name, svc in override["services"].items():
        assert name in model()["services"], f"{name}: not a compose.yaml service"
        assert set(svc) == {"image"}, f"{name}: the override may only swap the image"
        assert svc["image"] != model()["services"][name]["image"]


# --- what a user checks after `docker compose up` --------------------------------------------


def test_every_service_runs_and_is_healthy(stack: Stack):
    containers = {name: stack.container(name) for name in services()}
    ready_in: dict[str, float] = {}
    # Health first, from Docker's own events since `up` (none is missed: they are replayed).
    expecting = {
        name
        for name, cid in containers.items()
        if stack.engine.inspect(cid)[0]["State"].get("Health")
    }
    assert expecting >= {"exporter", "simulator", "alert-webhook"}
    for event in stack.events(
        stack.up_at - 1,
        stack.up_at + HEALTHY_WITHIN,
        "event=health_status",
        "label=com.docker.compose.project",
    ):
        name = event["Actor"]["Attributes"].get("com.docker.compose.service")
        assert event["status"] != "health_status: unhealthy", (
            f"{name} became unhealthy\n{stack.tail(name)}"
        )
        if name in expecting and event["status"] == "health_status: healthy":
            ready_in[name] = event["timeNano"] / 1e9 - stack.up_at
            expecting.discard(name)
            if not expecting:
                break
    assert not expecting, (
        f"not healthy within {HEALTHY_WITHIN:.0f} s: {sorted(expecting)}\n"
        + "\n".join(stack.tail(name) for name in sorted(expecting))
    )
    stack.facts["healthy_after_up_seconds"] = {k: round(v, 1) for k, v in ready_in.items()}
    # Prometheus and Alertmanager answer their readiness endpoint on the published ports.
    for name, port in (("prometheus", 9090), ("alertmanager", 9093)):
        eventually(
            lambda port=port: http_get(f"http://127.0.0.1:{port}/-/ready")[0] == 200 or None,
            HEALTHY_WITHIN,
            f"{name} /-/ready",
            diagnose=lambda name=name: stack.tail(name),
        )
    # The driver plays the scenario: the exporter has counted agent-a's requests.
    eventually(
        lambda: "agent-a" in http_get(f"{EXPORTER}/metrics")[2] or None,
        HEALTHY_WITHIN,
        "the driver's usage reaching the exporter",
    )
    for name, cid in containers.items():
        state = stack.engine.inspect(cid)[0]
        assert state["State"]["Running"], f"{name}: {state['State']}\n{stack.tail(name)}"
        assert state["RestartCount"] == 0, (
            f"{name} restarted {state['RestartCount']} times\n{stack.tail(name)}"
        )
    stack.facts["exporter_rss_kib_at_healthy"] = exporter_rss_kib(stack)
    # Docker asks one interval in (30 s); the exporter itself listens much sooner.
    started = docker_time(stack.inspect("exporter")["State"]["StartedAt"])
    logs = stack.engine.run("logs", "--timestamps", containers["exporter"])
    logged = logs.stdout + logs.stderr
    listening = next(line for line in logged.splitlines() if " listening on http" in line)
    stack.facts["exporter_listening_after_start_seconds"] = round(
        docker_time(listening.split()[0]) - started, 2
    )


def pod_sidecar() -> dict[str, Any]:
    """The exporter's container in deploy/kubernetes/deployment.yaml."""
    deployment = yaml.safe_load((K8S_DIR / "deployment.yaml").read_text(encoding="utf-8"))
    sidecar: dict[str, Any] = next(
        c
        for c in deployment["spec"]["template"]["spec"]["containers"]
        if c["name"] == "vllm-cache-exporter"
    )
    return sidecar


def exporter_rss_kib(stack: Stack) -> int:
    """RSS of the exporter's process (not tini's) in its container, held to the memory the
    Kubernetes manifest requests for the sidecar: the same image, at the demo's load."""
    found = [
        int(proc["rss"])
        for proc in stack.processes("exporter")
        # not tini, nor the image's HEALTHCHECK (`python -c ...`) if Docker runs it just now
        if not proc["args"].startswith("/sbin/docker-init")
        and "vllm-cache-exporter run" in proc["args"]
    ]
    assert len(found) == 1, stack.processes("exporter")
    request = pod_sidecar()["resources"]["requests"]["memory"]
    assert request.endswith("Mi"), request
    assert found[0] < int(request[:-2]) * 1024, (
        f"the exporter's RSS, {found[0]} KiB, is over the pod's memory request, {request}"
    )
    return found[0]


def test_prometheus_scrapes_every_target_and_loads_every_shipped_rule(stack: Stack):
    def logs() -> str:
        return stack.tail("prometheus")

    eventually(scrape_targets_up(), 90, "every scrape target up", diagnose=logs)
    rules = eventually(
        evaluated_rules, first_evaluations_within(), "every rule evaluated once", diagnose=logs
    )
    assert_every_shipped_rule_is_loaded_and_healthy(rules, diagnose=logs)
    # ...and sends its alerts to the stack's Alertmanager.
    alertmanagers = eventually(
        lambda: api(f"{PROMETHEUS}/api/v1/alertmanagers")["activeAlertmanagers"] or None,
        60,
        "Prometheus discovering Alertmanager",
    )
    assert [am["url"] for am in alertmanagers] == ["http://alertmanager:9093/api/v2/alerts"]


def test_the_exporter_answers_on_loopback_only(stack: Stack):
    status, content_type, body = http_get(f"{EXPORTER}/metrics")
    assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
    assert re.search(
        r'^vllm_cache_engine_up\{[^}]*target="http://vllm:8000/metrics"[^}]*\} 1', body, flags=re.M
    ), body[:2000]
    status, content_type, page = http_get(f"{EXPORTER}/")
    assert status == 200 and content_type.startswith("text/html"), (status, content_type)
    assert "agent-a" in page  # the status page names the driver's callers
    # Every published port, as Docker bound it and as the host's sockets show it.
    for name in services():
        declared = published_ports(model()["services"][name])
        bindings = stack.inspect(name)["HostConfig"]["PortBindings"] or {}
        assert len(bindings) == len(declared), f"{name}: {bindings}"
        for binding in (b for port in bindings.values() for b in port):
            assert binding["HostIp"] == "127.0.0.1", f"{name}: {binding}"
            assert listening_addresses(int(binding["HostPort"])) == {"127.0.0.1"}, (
                f"{name}: port {binding['HostPort']} listens on "
                f"{listening_addresses(int(binding['HostPort']))}"
            )


def test_our_image_runs_unprivileged_and_as_compose_asks(stack: Stack):
    user = dockerfile.parse(ROOT / "Dockerfile")[-1].last("USER")
    assert user is not None
    for name in sorted(services()):
        svc = model()["services"][name]
        if svc["image"] != model()["services"]["exporter"]["image"]:
            continue
        state = stack.inspect(name)
        assert state["Config"]["User"] == user.text, f"{name}: runs as {state['Config']['User']}"
        processes = stack.processes(name)
        assert processes and {proc["uid"] for proc in processes} == {user.text.split(":")[0]}, (
            f"{name}: {processes}"
        )
        # tini as PID 1 (init: true), our process its child. PID 1 is found by its host pid
        # (State.Pid), not as the first row: host pids wrap (pid_max), so tini's may be the
        # larger.
        init = [proc for proc in processes if int(proc["pid"]) == state["State"]["Pid"]]
        assert len(init) == 1 and init[0]["args"].startswith("/sbin/docker-init -- "), (
            f"{name}: PID 1 is host pid {state['State']['Pid']}: {processes}"
        )
        assert state["HostConfig"]["Init"] is True
        assert state["HostConfig"]["ReadonlyRootfs"] is bool(svc.get("read_only")), name


def test_our_image_runs_with_the_pods_security_context(stack: Stack):
    """deploy/kubernetes runs the image read-only, without capabilities or privilege
    escalation, as uid 10001: the same image, run that way, serves and is healthy."""
    context = pod_sidecar()["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["capabilities"]["drop"] == ["ALL"]
    assert context["allowPrivilegeEscalation"] is False
    image = model()["services"]["exporter"]["image"]
    started = time.time()
    cid = stack.engine.run(
        "run",
        "-d",
        "--read-only",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        f"--user={context['runAsUser']}:{context['runAsGroup']}",
        "--network=none",
        "--health-interval=1s",
        image,
        "run",
        "--vllm.url=http://127.0.0.1:9",
    ).stdout.strip()
    try:
        for event in stack.events(
            started - 1, started + 60, f"container={cid}", "event=health_status", "event=die"
        ):
            assert event["status"] != "die", stack.engine.run("logs", cid).stderr
            if event["status"] == "health_status: healthy":
                break
        else:
            pytest.fail(f"not healthy within 60 s: {stack.engine.run('logs', cid).stderr}")
    finally:
        stack.engine.run("rm", "-f", cid)


# --- the collapse pages ------------------------------------------------------------------------


def test_the_collapse_pages_through_alertmanager(stack: Stack):
    """The engine's collapse reaches the alert logger on the page route, and agent-a's follows
    it into Alertmanager on the same route. (Alertmanager groups by alert name, so agent-a's,
    firing a minute later, is only sent with the group's next notification, group_interval
    later: its route is read from Alertmanager instead of waiting 5 more minutes.)"""
    driver_started = docker_time(stack.inspect("driver")["State"]["StartedAt"])
    exporter = model()["services"]["exporter"]
    target = (flag_value(command_args(exporter), "--vllm.url") or "") + "/metrics"
    engine = {
        "alertname": COLLAPSE,
        "severity": "critical",
        "scope": "engine",
        "job": JOB,
        "target": target,
        "model_name": "qwen3.8-27b",
    }
    caller = {
        "alertname": COLLAPSE,
        "severity": "critical",
        "scope": "caller",
        "job": JOB,
        "caller": "agent-a",
        "model": "qwen3.8-27b",
    }
    seen = []
    for stamp, line in stack.log_lines("alert-webhook", stack.up_at, driver_started + PAGE_WITHIN):
        alert = parse_alert(line)
        if alert is None:
            continue
        seen.append(alert)
        labels = {"alertname": alert["name"], **alert["labels"]}
        # The routing: pages are critical, and every critical alert pages.
        assert (alert["receiver"] == "page") == (labels.get("severity") == "critical"), alert
        if (alert["receiver"], alert["status"]) == ("page", "FIRING") and all(
            labels.get(key) == value for key, value in engine.items()
        ):
            stack.facts["paged_after_driver_start_seconds"] = round(
                docker_time(stamp) - driver_started
            )
            break
    else:
        pytest.fail(
            f"no page for the engine's collapse within {PAGE_WITHIN / 60:.0f} min of "
            f"the driver's start; the alert logger received: {seen}"
        )

    def routed_to_page(expected: dict[str, str]) -> list[dict[str, Any]] | None:
        alerts = api(
            f"{ALERTMANAGER}/api/v2/alerts?active=true&filter="
            + urllib.parse.quote(f'alertname="{COLLAPSE}"')
        )
        found = [
            alert
            for alert in alerts
            if all(alert["labels"].get(key) == value for key, value in expected.items())
        ]
        return found or None

    for expected in (engine, caller):
        for alert in eventually(
            lambda expected=expected: routed_to_page(expected),
            300,
            f"{expected['scope']} collapse in Alertmanager",
            diagnose=lambda: collapse_history("agent-a", since=driver_started),
        ):
            assert [receiver["name"] for receiver in alert["receivers"]] == ["page"], alert
    stack.facts["exporter_rss_kib_after_page"] = exporter_rss_kib(stack)


def collapse_history(caller: str, since: float) -> str:
    """What the caller's collapse alert read since the driver started, a minute apart: the
    failure's message says which of its conditions did not hold."""
    now = time.time()
    lines = []
    for name, query in (
        ("ratio5m", f'caller_model:vllm_cache_hit_ratio:rate5m{{caller="{caller}"}}'),
        ("baseline", f'caller_model:vllm_cache_hit_ratio:p90_1d_rate1h{{caller="{caller}"}}'),
        ("prompt5m", f'caller_model:vllm_cache_prompt_tokens:rate5m{{caller="{caller}"}}'),
        ("engine5m", "target_model:vllm_cache_engine_hit_ratio:rate5m"),
        ("alerts", f'ALERTS{{alertname="{COLLAPSE}"}}'),
    ):
        try:
            result = api(
                f"{PROMETHEUS}/api/v1/query_range?"
                + urllib.parse.urlencode({"query": query, "start": since, "end": now, "step": 60})
            )
        except (OSError, ValueError) as err:
            lines.append(f"{name}: {err}")
            continue
        for series in result["result"]:
            labels = {k: v for k, v in series["metric"].items() if k in ("scope", "alertstate")}
            points = " ".join(
                f"{(float(t) - since) / 60:.0f}m={float(v):.3g}" for t, v in series["values"]
            )
            lines.append(f"{name} {labels}: {points}")
    return "\n".join(lines)


# --- and stops at once --------------------------------------------------------------------------


def test_compose_stop_is_prompt(stack: Stack):
    """Last: stops the stack. Every process gets SIGTERM (tini forwards it to ours) and
    exits by itself, well before compose's SIGKILL."""
    ids = {name: stack.container(name) for name in services()}
    started = time.monotonic()
    stack.compose("stop")
    took = time.monotonic() - started
    stack.facts["stop_seconds"] = round(took, 2)
    for name, cid in ids.items():
        state = stack.engine.inspect(cid)[0]["State"]
        assert not state["Running"], name
        assert state["ExitCode"] == 0, f"{name} exited {state['ExitCode']} (137: killed)"
    assert took < STOP_WITHIN, f"docker compose stop took {took:.1f} s"
