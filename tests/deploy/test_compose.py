"""compose.yaml, offline: docker-compose accepts it in both modes, and what it starts would
work: pinned images, loopback-only ports, mounts that exist, commands our CLI accepts,
names that resolve to exactly one running service, and Prometheus, Alertmanager and Grafana
reading the committed rules, receivers and dashboards.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter import __version__
from exporter.cli import parse
from exporter.config import build_config
from exporter.monitoring.config import MonitoringConfig
from tests.deploy.helpers import (
    ROOT,
    active_services,
    command_args,
    docker_compose,
    dotenv,
    flag_value,
    host_path,
    network_names,
    published_ports,
    raw_compose,
    require_tool,
    resolved_compose,
)

OUR_IMAGE = f"vllm-cache-exporter:{__version__}"
# Mode -> the --profile flags given on the command line ("demo" is .env's default).
MODES = {"demo": (), "gpu": ("gpu",)}
DEMO_SERVICES = {
    "simulator",
    "driver",
    "exporter",
    "prometheus",
    "alertmanager",
    "grafana",
    "alert-webhook",
}
GPU_SERVICES = DEMO_SERVICES - {"simulator", "driver"} | {"vllm"}
# Ports the third-party images listen on by default (their documentation).
IMAGE_PORTS = {"prom/prometheus": {9090}, "prom/alertmanager": {9093}, "grafana/grafana": {3000}}
VERSION_TAG = re.compile(r"^v?\d+\.\d+\.\d+(?:[-.][0-9A-Za-z.]+)?$")


def model() -> dict[str, Any]:
    return resolved_compose()


def service(name: str, **overrides: str) -> dict[str, Any]:
    return resolved_compose(**overrides)["services"][name]


def parse_our_command(svc: Mapping[str, Any]) -> Any:
    """The service's command through our real CLI parser: a renamed flag fails here."""
    argv = command_args(svc)
    try:
        return parse(argv)
    except SystemExit:
        pytest.fail(f"vllm-cache-exporter rejects the compose command {argv}")


def listening_ports(name: str, svc: Mapping[str, Any]) -> set[int]:
    """Ports a service listens on, read from its command and environment."""
    image = svc["image"]
    if image == OUR_IMAGE:
        if svc.get("entrypoint"):  # the alert logger, run with our image's Python
            return {int(svc["environment"]["ALERT_LOGGER_PORT"])}
        args = parse_our_command(svc)
        if args.command == "run":
            config = build_config(args, environ=svc.get("environment") or {})
            ports = {config.listen_host_port[1]}
            if config.tap_listen_address:
                ports.add(int(config.tap_listen_address.rpartition(":")[2]))
            return ports
        address = flag_value(command_args(svc), "--sim.listen-address")
        return {int(address.rpartition(":")[2])} if address else set()
    if image.startswith("vllm/vllm-openai:"):
        return {int(flag_value(command_args(svc), "--port") or 8000)}
    return IMAGE_PORTS[image.partition(":")[0]]


def resolve(address: str, mode: str) -> tuple[str, int]:
    """host:port on the compose network -> (the one active service, port); fail otherwise."""
    host, _, port = address.rpartition(":")
    names = network_names(model(), active_services(model(), MODES[mode]))
    assert host in names, f"{address}: no running service answers to {host!r} ({mode})"
    assert len(names[host]) == 1, f"{address}: {names[host]} all answer to {host!r} ({mode})"
    target = names[host][0]
    assert int(port) in listening_ports(target, model()["services"][target]), (
        f"{address}: {target} does not listen on {port} ({mode})"
    )
    return target, int(port)


def url_address(url: str) -> str:
    match = re.match(r"^https?://([^/]+)", url)
    assert match, url
    host_port = match.group(1)
    return host_port if ":" in host_port else host_port + ":80"


# --- the file as compose reads it ---------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(MODES))
def test_docker_compose_accepts_the_file_with_no_variable_unset(mode):
    profile_flags = [arg for profile in MODES[mode] for arg in ("--profile", profile)]
    result = docker_compose(*profile_flags, "config", "-q")
    assert result.returncode == 0, result.stderr
    # Every variable has a default: plain `docker compose up` needs no environment.
    assert "WARNING" not in result.stderr, result.stderr


def test_demo_by_default_and_the_gpu_profile_instead_of_it():
    assert dotenv()["COMPOSE_PROFILES"] == "demo"
    assert active_services(model()) == DEMO_SERVICES
    assert active_services(model(), ["gpu"]) == GPU_SERVICES
    for mode, flags in MODES.items():
        active = active_services(model(), flags)
        for name in active:
            # Compose v2 refuses to start a service whose dependency is not in the project.
            for dependency in model()["services"][name].get("depends_on", {}):
                assert dependency in active, f"{name} depends on {dependency}, off in {mode}"
        # Everything that calls vLLM calls it by one name, answered by one service per mode.
        target, _port = resolve("vllm:8000", mode)
        assert target == ("simulator" if mode == "demo" else "vllm")


def test_every_image_is_pinned_to_a_version():
    raw = raw_compose()["services"]
    for name, svc in model()["services"].items():
        image = svc["image"]
        assert "${" not in raw[name]["image"], f"{name}: the image tag must not be a variable"
        repository, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest" and VERSION_TAG.match(tag), f"{name}: {image} is not pinned"
        if image == OUR_IMAGE:
            assert Path(svc["build"]["context"]).resolve() == ROOT
            assert (ROOT / svc["build"].get("dockerfile", "Dockerfile")).is_file()
    assert {svc["image"] for svc in model()["services"].values()} >= {
        OUR_IMAGE,
        "prom/prometheus:v3.5.0",
        "prom/alertmanager:v0.28.1",
    }


def test_every_published_port_is_bound_to_loopback():
    published = []
    for name, svc in model()["services"].items():
        assert svc.get("network_mode") != "host", f"{name}: host networking publishes all"
        for host_ip, port in published_ports(svc):
            assert host_ip == "127.0.0.1", f"{name}: port {port} is published on all addresses"
            published.append(int(port))
    assert {3000, 9090, 9093, 10123} <= set(published)
    assert len(published) == len(set(published)), "two services publish the same host port"


def test_every_mounted_file_exists():
    for name, svc in model()["services"].items():
        for volume in svc.get("volumes", []):
            source = str(volume).split(":")[0] if isinstance(volume, str) else volume["source"]
            if not source.startswith(("/", ".")):
                continue  # a named volume
            path = Path(source) if source.startswith("/") else ROOT / source
            assert path.exists(), f"{name} mounts {source}, which does not exist"
            assert ROOT in path.resolve().parents, f"{name} mounts {source} from outside"


# --- what runs ----------------------------------------------------------------------------


def test_our_services_run_commands_the_cli_accepts():
    checked = set()
    for svc in model()["services"].values():
        if svc["image"] != OUR_IMAGE or svc.get("entrypoint"):
            continue
        args = parse_our_command(svc)
        if args.command == "run":
            build_config(args, environ=svc.get("environment") or {})  # values validate too
        checked.add(args.command)
    assert checked == {"run", "simulate", "drive"}


def test_scenario_and_speed_are_each_chosen_by_one_variable():
    from exporter.sim.scenario import available

    for flag, variable, other in (
        ("--scenario", "SCENARIO", "two-agents-fit"),
        ("--speed", "SPEED", "20"),
    ):
        default = flag_value(command_args(service("simulator")), flag)
        assert default and flag_value(command_args(service("driver")), flag) == default
        for name in ("simulator", "driver"):  # the two must agree, or time runs apart
            args = command_args(service(name, **{variable: other}))
            assert flag_value(args, flag) == other
    assert flag_value(command_args(service("simulator")), "--scenario") in available()


def test_the_driver_reports_to_the_exporter_which_reads_vllm_and_taps_it():
    exporter = build_config(
        parse_our_command(service("exporter")), environ=service("exporter")["environment"]
    )
    assert exporter.vllm_url == ("http://vllm:8000",)
    assert exporter.tap_upstream == "http://vllm:8000"
    assert exporter.tap_listen_address.startswith("0.0.0.0:")
    driver = command_args(service("driver"))
    # Straight to the simulator, usage to /v1/usage: through the tap too, it would count twice.
    base_url = flag_value(driver, "--drive.base-url") or ""
    assert resolve(url_address(base_url), "demo")[0] == "simulator"
    assert resolve(url_address(flag_value(driver, "--drive.exporter-url") or ""), "demo") == (
        "exporter",
        exporter.listen_host_port[1],
    )
    # VLLM_URL points the exporter and its tap at a vLLM outside the stack instead.
    other = build_config(
        parse_our_command(service("exporter", VLLM_URL="http://10.0.0.7:8000")),
        environ=service("exporter")["environment"],
    )
    assert other.vllm_url == ("http://10.0.0.7:8000",)
    assert other.tap_upstream == "http://10.0.0.7:8000"


def test_gpu_profile_runs_vllm_with_prefix_caching_on_a_reserved_gpu():
    vllm = service("vllm", VLLM_MODEL="org/some-model")
    args = command_args(vllm)
    assert args[0] == "org/some-model", "the model comes from VLLM_MODEL"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(args)
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    assert vllm["profiles"] == ["gpu"]


# --- Prometheus, Alertmanager, Grafana ----------------------------------------------------


def prometheus_config() -> tuple[Path, dict[str, Any]]:
    prometheus = service("prometheus")
    config_flag = flag_value(command_args(prometheus), "--config.file")
    assert config_flag, "prometheus runs without --config.file"
    path = host_path(prometheus, config_flag)
    assert path is not None and path.resolve() == ROOT / "deploy" / "prometheus.yml"
    return path, yaml.safe_load(path.read_text(encoding="utf-8"))


def test_prometheus_loads_every_committed_rule_file():
    prometheus = service("prometheus")
    config_dir = Path(flag_value(command_args(prometheus), "--config.file") or "").parent
    _path, config = prometheus_config()
    loaded: set[Path] = set()
    for pattern in config["rule_files"]:
        inside = pattern if pattern.startswith("/") else f"{config_dir.as_posix()}/{pattern}"
        on_host = host_path(prometheus, inside)
        assert on_host is not None, f"rule file {pattern} is not mounted"
        matches = set(on_host.parent.glob(on_host.name))
        assert matches, f"rule file {pattern} matches nothing in the repository"
        loaded |= {match.resolve() for match in matches}
    assert loaded == {path.resolve() for path in (ROOT / "alerts").glob("*.yaml")}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prometheus_scrapes_and_alerts_running_services(mode):
    _path, config = prometheus_config()
    jobs = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                jobs[job["job_name"]] = resolve(target, mode)
    selector_job = re.search(r'job="([^"]+)"', MonitoringConfig().selector)
    assert selector_job and jobs[selector_job.group(1)][0] == "exporter"
    # ...and the vLLM itself: the simulator in the demo, the real one in the gpu profile.
    upstream = "simulator" if mode == "demo" else "vllm"
    assert upstream in {service_name for service_name, _port in jobs.values()}
    for alerting in config["alerting"]["alertmanagers"]:
        for static in alerting["static_configs"]:
            for target in static["targets"]:
                assert resolve(target, mode)[0] == "alertmanager"


def test_promtool_accepts_the_config_as_the_container_sees_it(tmp_path):
    """prometheus.yml beside alerts/, as mounted: promtool checks the config and the rules."""
    promtool = require_tool("promtool")
    path, _config = prometheus_config()
    (tmp_path / "prometheus.yml").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    prometheus = service("prometheus")
    alerts = host_path(prometheus, "/etc/prometheus/alerts")
    assert alerts is not None and alerts.resolve() == ROOT / "alerts"
    (tmp_path / "alerts").symlink_to(alerts, target_is_directory=True)
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("mode", sorted(MODES))
def test_alertmanager_delivers_to_the_alert_logger(mode):
    alertmanager = service("alertmanager")
    config_flag = flag_value(command_args(alertmanager), "--config.file") or ""
    path = host_path(alertmanager, config_flag)
    assert path is not None and path.resolve() == ROOT / "deploy" / "alertmanager.yml"
    amtool = require_tool("amtool")
    result = subprocess.run(
        [amtool, "check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    urls = [
        hook["url"]
        for receiver in config["receivers"]
        for hook in receiver.get("webhook_configs", [])
    ]
    assert urls, "no webhook receiver to log alerts"
    for url in urls:
        assert resolve(url_address(url), mode)[0] == "alert-webhook"
    logger = service("alert-webhook")
    script = host_path(logger, command_args(logger)[0])
    assert script is not None and script.resolve() == ROOT / "deploy" / "alert-logger.py"


def provisioning(kind: str) -> list[dict[str, Any]]:
    grafana = service("grafana")
    folder = host_path(grafana, f"/etc/grafana/provisioning/{kind}")
    assert folder is not None and folder.is_dir(), f"no Grafana {kind} provisioning mounted"
    return [
        yaml.safe_load(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.y*ml"))
    ]


def test_grafana_datasource_is_the_stacks_prometheus_with_a_fixed_uid():
    sources = [source for doc in provisioning("datasources") for source in doc["datasources"]]
    assert len(sources) == 1
    source = sources[0]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    assert source["isDefault"] is True  # the dashboards' `datasource` variable picks it
    for mode in MODES:
        assert resolve(url_address(source["url"]), mode)[0] == "prometheus"
    _path, config = prometheus_config()
    assert source["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


def test_grafana_provisions_the_committed_dashboards():
    grafana = service("grafana")
    providers = [p for doc in provisioning("dashboards") for p in doc["providers"]]
    assert len(providers) == 1
    folder = host_path(grafana, providers[0]["options"]["path"])
    assert folder is not None and folder.resolve() == ROOT / "dashboards"
    uids = {json.loads(path.read_text(encoding="utf-8"))["uid"] for path in folder.glob("*.json")}
    monitoring = MonitoringConfig()
    assert {monitoring.overview_uid, monitoring.caller_uid} <= uids
    home = host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home is not None and home.is_file()
    assert json.loads(home.read_text(encoding="utf-8"))["uid"] == monitoring.overview_uid


def test_grafana_is_open_to_anonymous_viewers_with_the_admin_password_from_the_environment():
    env = service("grafana")["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    password = service("grafana", GRAFANA_ADMIN_PASSWORD="s3cret-from-env")["environment"]
    assert password["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret-from-env"
