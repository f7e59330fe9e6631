"""deploy/kubernetes/, offline: every object validates against the Kubernetes schemas (core
kinds) or the Prometheus Operator's CRD schemas (tests/deploy/schemas/), the generated
objects match their generators, and the objects fit together the way a cluster would wire
them: ServiceMonitor -> Service -> pod port -> sidecar flags -> the job the rules select.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter import __version__
from exporter.cli import parse
from exporter.config import build_config
from exporter.monitoring.config import MonitoringConfig, parse_selector
from tests.deploy.helpers import K8S_DIR, ROOT, flag_value, raw_compose

SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.yaml",
}
# The oldest Kubernetes we claim (1.29: still in the major clouds' extended support) and the
# newest schema kubernetes-validate bundles.
OLDEST_KUBERNETES = "1.29.0"
# kubectl apply keeps the whole object in this annotation, which Kubernetes caps at 256 KiB.
LAST_APPLIED_LIMIT = 262_144


def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate as module
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is in the test extra: pip install -e '.[test]'")
        pytest.skip("kubernetes-validate not installed")
    return module


def manifest_files() -> list[Path]:
    return sorted(path for path in K8S_DIR.glob("*.yaml") if path.name != "kustomization.yaml")


@cache
def documents() -> tuple[tuple[str, dict[str, Any]], ...]:
    out = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                out.append((path.name, doc))
    return tuple(out)


def objects(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    found = [
        doc
        for _file, doc in documents()
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert found, f"no {kind} {name or ''} in deploy/kubernetes"
    return found


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = objects(kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec() -> dict[str, Any]:
    return one("Deployment", "vllm")["spec"]["template"]["spec"]


def container(name: str) -> dict[str, Any]:
    return next(item for item in pod_spec()["containers"] if item["name"] == name)


def container_port(name: str) -> int:
    for item in pod_spec()["containers"]:
        for port in item.get("ports", []):
            if port["name"] == name:
                return port["containerPort"]
    raise AssertionError(f"no container port named {name!r}")


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def crd_validator(doc: Mapping[str, Any]) -> Any:
    """A Draft 2020-12 validator for a custom resource, resolving ObjectMeta/LabelSelector
    from the Kubernetes definitions kubernetes-validate bundles (offline)."""
    import jsonschema
    from referencing import Registry, Resource

    utils = kubernetes_validate().utils
    key = (doc["apiVersion"], doc["kind"])
    assert key in CRD_SCHEMAS, f"no schema for {key}: add one to tests/deploy/schemas/"
    schema = yaml.safe_load((SCHEMAS / CRD_SCHEMAS[key]).read_text(encoding="utf-8"))
    version = utils.latest_version()
    definitions = utils.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version
    )
    registry = Registry().with_resource(
        "https://kubernetes.io/api/_definitions.json", Resource.from_contents(definitions)
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(doc: Mapping[str, Any], version: str) -> None:
    """Raise if the object is not valid: core kinds strictly, custom resources by schema."""
    if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
        crd_validator(doc).validate(doc)
    else:
        kubernetes_validate().validate(dict(doc), version, strict=True)


def bundled_versions() -> Iterator[str]:
    yield OLDEST_KUBERNETES
    try:
        import kubernetes_validate as module
    except ImportError:
        return
    yield module.utils.latest_version()


# --- structure ----------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_pins_the_exporter_image():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text(encoding="utf-8"))
    assert sorted(kustomization["resources"]) == [path.name for path in manifest_files()]
    images = {image["name"]: image for image in kustomization["images"]}
    assert images["vllm-cache-exporter"]["newTag"] == __version__
    assert container("vllm-cache-exporter")["image"] == f"vllm-cache-exporter:{__version__}"


@pytest.mark.parametrize("version", list(bundled_versions()))
def test_every_object_validates_offline(version):
    validated = []
    for filename, doc in documents():
        try:
            validate(doc, version)
        except Exception as err:  # show which object, then the validator's own message
            pytest.fail(f"{filename}: {doc['kind']} {doc['metadata'].get('name')}: {err}")
        validated.append(doc["kind"])
    assert {"Deployment", "Service", "ServiceMonitor", "PrometheusRule", "ConfigMap"} <= set(
        validated
    )


def broken(kind: str, change: Any) -> dict[str, Any]:
    doc = copy.deepcopy(objects(kind)[0])
    change(doc)
    return doc


@pytest.mark.parametrize(
    "case",
    [
        (
            "Deployment",
            lambda d: d["spec"]["template"]["spec"]["containers"][1]["ports"][0].update(
                containerPort="10123"
            ),
        ),
        (
            "Deployment",
            lambda d: d["spec"]["template"]["spec"]["containers"][1].update(livenesProbe={}),
        ),
        ("Service", lambda d: d["spec"].update(selecter={})),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(scrapeTimout="10s")),
        ("ServiceMonitor", lambda d: d["spec"].pop("selector")),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds")),
        ("ServiceMonitor", lambda d: d["metadata"].update(labels={"a": 1})),
        ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].update(alert="X")),
        ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr")),
        ("PrometheusRule", lambda d: d["spec"]["groups"][0].pop("name")),
    ],
    ids=[
        "port-as-string",
        "typo-in-container",
        "typo-in-service",
        "typo-in-endpoint",
        "no-selector",
        "bad-duration",
        "label-not-string",
        "record-and-alert",
        "no-expr",
        "group-without-name",
    ],
)
def test_validation_rejects_broken_objects(case):
    kind, change = case
    with pytest.raises(Exception) as caught:
        validate(broken(kind, change), OLDEST_KUBERNETES)
    assert "ValidationError" in type(caught.value).__name__


# --- generated objects --------------------------------------------------------------------


def rule_file_groups() -> list[dict[str, Any]]:
    groups = []
    for path in sorted((ROOT / "alerts").glob("*.yaml")):
        groups.extend(yaml.safe_load(path.read_text(encoding="utf-8"))["groups"])
    return groups


def test_prometheusrule_groups_equal_the_generated_rule_files():
    manifest_groups = one("PrometheusRule")["spec"]["groups"]
    files_groups = rule_file_groups()
    assert files_groups, "no rule files in alerts/"
    by_name = {group["name"]: group for group in files_groups}
    assert len(by_name) == len(files_groups), "duplicate group names in alerts/*.yaml"
    assert sorted(group["name"] for group in manifest_groups) == sorted(by_name)
    for group in manifest_groups:
        assert group == by_name[group["name"]], f"group {group['name']} differs from alerts/"


def test_prometheusrule_is_exactly_what_generate_writes():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "exporter",
            "generate",
            "--format",
            "prometheus-operator",
            "--output",
            "deploy/kubernetes/prometheusrule.yaml",
            "--check",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_manifests_are_up_to_date():
    """`generate` writes the Kubernetes forms too; `generate --check` covers them."""
    from exporter.monitoring.config import MonitoringConfig
    from exporter.monitoring.render import (
        K8S_DASHBOARDS_PATH,
        K8S_RULE_PATH,
        prometheus_files,
    )

    files = prometheus_files(MonitoringConfig())
    for relative in (K8S_RULE_PATH, K8S_DASHBOARDS_PATH):
        assert (ROOT / relative).read_text(encoding="utf-8") == files[relative], (
            f"{relative} is stale: run 'vllm-cache-exporter generate'"
        )


def test_dashboards_configmaps_carry_every_committed_dashboard_for_the_sidecar():
    committed = {
        path.name: path.read_text(encoding="utf-8")
        for path in sorted((ROOT / "dashboards").glob("*.json"))
    }
    assert len(committed) >= 2, "the overview and per-caller dashboards"
    shipped: dict[str, str] = {}
    for configmap in objects("ConfigMap"):
        assert configmap["metadata"]["labels"].get("grafana_dashboard") == "1"
        shipped.update(configmap["data"])
        # kubectl apply stores the object in an annotation capped at 256 KiB.
        assert len(json.dumps(configmap)) < LAST_APPLIED_LIMIT, configmap["metadata"]["name"]
    assert shipped == committed
    for text in shipped.values():
        assert json.loads(text)["uid"]


# --- how the objects fit together ---------------------------------------------------------


def sidecar_config() -> Any:
    sidecar = container("vllm-cache-exporter")
    args = parse(list(sidecar["args"]))
    assert args.command == "run"
    env = {item["name"]: item["value"] for item in sidecar.get("env", []) if "value" in item}
    return build_config(args, environ=env)


def test_sidecar_reads_vllm_on_localhost_and_serves_on_its_named_ports():
    config = sidecar_config()  # the real flag parser: a renamed flag fails here
    vllm_port = container_port("http")
    assert config.vllm_url == (f"http://127.0.0.1:{vllm_port}",)
    assert config.tap_upstream == f"http://127.0.0.1:{vllm_port}"
    assert config.listen_host_port == ("0.0.0.0", container_port("metrics"))
    assert config.tap_listen_address == f"0.0.0.0:{container_port('tap')}"
    sidecar = container("vllm-cache-exporter")
    for probe, path in (("livenessProbe", "/-/healthy"), ("readinessProbe", "/-/ready")):
        assert sidecar[probe]["httpGet"] == {"path": path, "port": "metrics"}
    assert sidecar["securityContext"]["runAsNonRoot"] is True


def test_vllm_container_reports_cached_tokens_and_matches_the_compose_pin():
    vllm = container("vllm")
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(vllm["args"])
    assert flag_value(vllm["args"], "--port") == str(container_port("http"))
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert vllm["image"] == raw_compose()["services"]["vllm"]["image"]
    assert not vllm["image"].endswith(":latest") and ":" in vllm["image"]


def test_servicemonitor_scrapes_every_sidecar_as_the_job_the_rules_select():
    monitor = one("ServiceMonitor")
    services = [
        service
        for service in objects("Service")
        if selects(
            monitor["spec"]["selector"]["matchLabels"], service["metadata"].get("labels", {})
        )
    ]
    assert len(services) == 1, "the ServiceMonitor must select exactly the metrics Service"
    service = services[0]
    assert service["spec"].get("clusterIP") == "None", "headless: one target per pod"
    template_labels = one("Deployment", "vllm")["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], template_labels)
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        target = ports[endpoint["port"]]["targetPort"]
        assert target == "metrics"
        assert container_port(target) == sidecar_config().listen_host_port[1]
        assert endpoint.get("path", "/metrics") == "/metrics"
    # The operator names the job after the Service unless spec.jobLabel says otherwise.
    job = (
        service["metadata"]["labels"].get(monitor["spec"]["jobLabel"])
        if "jobLabel" in monitor["spec"]
        else service["metadata"]["name"]
    )
    wanted = [
        value
        for name, op, value in parse_selector(MonitoringConfig().selector)
        if name == "job" and op == "="
    ]
    assert wanted == [job]


def test_clients_reach_vllm_through_the_tap():
    service = one("Service", "vllm")
    assert selects(
        service["spec"]["selector"],
        one("Deployment", "vllm")["spec"]["template"]["metadata"]["labels"],
    )
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["tap"]


def relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str]:
    """Prometheus' `replace` relabeling (the only action we ship), as metric_relabel_configs
    applies it: source values joined by the separator, the regex anchored at both ends."""
    out = dict(labels)
    for rule in rules:
        assert rule.get("action", "replace").lower() == "replace", rule
        joined = rule.get("separator", ";").join(out.get(name, "") for name in rule["sourceLabels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), joined)
        if match is None:
            continue
        groups = (match.group(0), *match.groups(default=""))
        value = re.sub(
            r"\$\{?(\d+)\}?",
            lambda ref, groups=groups: groups[int(ref.group(1))],
            rule.get("replacement", "$1"),
        )
        if value:
            out[rule["targetLabel"]] = value
        else:
            out.pop(rule["targetLabel"], None)
    return out


def test_a_callers_replica_series_get_the_pod_name_their_engine_gets():
    """The tap's per-caller counters split by replica carry the engine series' `target` (the
    tap's upstream is the vLLM the sidecar reads, both on 127.0.0.1): relabelled alike, a
    caller on pod a joins pod a's engine, and the same caller on pod b stays apart, as the
    caller_target rules need; their `__other__` overflow is no URL and stays as it is."""
    rules = one("ServiceMonitor")["spec"]["endpoints"][0]["metricRelabelings"]
    config = sidecar_config()
    engine_target = config.engine_targets[0]
    # The exporter labels a backend at the origin of a --vllm.url with that engine's target.
    assert engine_target == config.tap_upstream + "/metrics"
    caller = {"job": "vllm-cache-exporter", "caller": "agent-a", "model": "qwen3.8-27b"}
    for pod in ("vllm-7c9d-a", "vllm-7c9d-b"):
        engine = relabel(rules, {"pod": pod, "target": engine_target, "model_name": "m"})
        replica = relabel(rules, {**caller, "pod": pod, "target": engine_target})
        assert replica["target"] == engine["target"] == pod
    other = {**caller, "pod": "vllm-7c9d-a", "target": "__other__"}
    assert relabel(rules, other) == other
    # And the rules keep the target of the series they sum, to join on it.
    recorded = [
        rule["expr"]
        for group in rule_file_groups()
        for rule in group["rules"]
        if rule.get("record", "").startswith("caller_model_target:") and "rate(" in rule["expr"]
    ]
    assert len(recorded) == 2
    assert all(re.search(r"by \(job(, [a-z_]+)*, caller, model, target\)", e) for e in recorded)


def test_each_replicas_engine_keeps_its_own_identity_through_the_rules():
    """Every sidecar reads vLLM at the same localhost URL; the rules keep engines apart by
    `target`, so the ServiceMonitor must make it unique per pod, and leave callers alone."""
    rules = one("ServiceMonitor")["spec"]["endpoints"][0]["metricRelabelings"]
    target = sidecar_config().engine_targets[0]
    assert target.startswith("http://127.0.0.1:")
    scraped = {
        "job": "vllm-cache-exporter",
        "namespace": "llm",
        "target": target,
        "model_name": "qwen3.8-27b",
    }
    engines = {
        relabel(rules, {**scraped, "pod": pod, "instance": f"{ip}:10123"})["target"]
        for pod, ip in (("vllm-7c9d-a", "10.1.0.4"), ("vllm-7c9d-b", "10.1.0.5"))
    }
    assert engines == {"vllm-7c9d-a", "vllm-7c9d-b"}
    caller = {
        "job": "vllm-cache-exporter",
        "pod": "vllm-7c9d-a",
        "caller": "agent-a",
        "model": "qwen3.8-27b",
    }
    assert relabel(rules, caller) == caller, "per-caller series must sum across pods as they are"
    remote = {**scraped, "pod": "vllm-7c9d-a", "target": "http://vllm-0.vllm:8000/metrics"}
    assert relabel(rules, remote) == remote, "an exporter reading a remote vLLM keeps its URL"
    # The engine rules really do aggregate by target, which is why this matters.
    engine_rules = [
        rule["expr"]
        for group in rule_file_groups()
        for rule in group["rules"]
        if "vllm_cache_engine_" in rule["expr"] and "record" in rule
    ]
    # (after the selector's and the topology labels, cluster and namespace by default)
    assert any(
        re.search(r"by \(job(, [a-z_]+)*, target, model_name\)", expr) for expr in engine_rules
    )
