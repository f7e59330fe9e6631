"""deploy/kubernetes-web-config: the base manifests with TLS and basic auth on the sidecar,
rendered by kustomize itself (kubectl kustomize, offline), then checked as the other
manifests are: valid objects, a sidecar configuration our CLI accepts with the mounted
files, HTTPS probes, and a ServiceMonitor that scrapes over HTTPS with basic auth."""

from __future__ import annotations

import base64
import posixpath
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from exporter.cli import parse
from exporter.config import build_config
from tests.deploy.helpers import ROOT, require_tool
from tests.deploy.test_kubernetes import OLDEST_KUBERNETES, validate
from tests.web.certs import make_pki

OVERLAY = ROOT / "deploy" / "kubernetes-web-config"
SIDECAR = "vllm-cache-exporter"


@cache
def rendered() -> tuple[dict[str, Any], ...]:
    kubectl = require_tool("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def one(kind: str, name: str) -> dict[str, Any]:
    found = [doc for doc in rendered() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def sidecar() -> dict[str, Any]:
    containers = one("Deployment", "vllm")["spec"]["template"]["spec"]["containers"]
    return next(container for container in containers if container["name"] == SIDECAR)


def test_every_rendered_object_validates():
    kinds = set()
    for doc in rendered():
        validate(doc, OLDEST_KUBERNETES)
        kinds.add(doc["kind"])
    assert {"Deployment", "Secret", "ServiceMonitor"} <= kinds


def test_the_secret_carries_the_shipped_example_unchanged():
    secret = one("Secret", "vllm-cache-exporter-web-config")
    shipped = (ROOT / "deploy" / "web-config" / "tls-basic-auth.yml").read_bytes()
    assert base64.b64decode(secret["data"]["web-config.yml"]) == shipped
    assert (OVERLAY / "web-config.yml").read_bytes() == shipped


def test_sidecar_starts_with_the_mounted_web_config(tmp_path: Path):
    """The pod's folder rebuilt on disk: the Secret's web-config.yml beside a certificate
    under the keys the projected volume maps; the real CLI must accept it."""
    container = sidecar()
    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    in_pod = env["VLLM_CACHE_EXPORTER_WEB_CONFIG_FILE"]
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    folder = mounts["web-config"]["mountPath"]
    assert posixpath.dirname(in_pod) == folder and mounts["web-config"]["readOnly"]
    pod = one("Deployment", "vllm")["spec"]["template"]["spec"]
    volume = next(item for item in pod["volumes"] if item["name"] == "web-config")
    pki = make_pki(tmp_path / "pki")
    local = tmp_path / "mounted"
    local.mkdir()
    on_disk = {"tls.crt": pki.server_cert, "tls.key": pki.server_key}
    for source in volume["projected"]["sources"]:
        name = source["secret"]["name"]
        if name == "vllm-cache-exporter-web-config":
            data = one("Secret", name)["data"]
            for key, encoded in data.items():
                (local / key).write_bytes(base64.b64decode(encoded))
        else:  # the TLS Secret the user creates: only the keys the volume maps
            for item in source["secret"]["items"]:
                (local / item["path"]).write_bytes(on_disk[item["key"]].read_bytes())
    env["VLLM_CACHE_EXPORTER_WEB_CONFIG_FILE"] = str(local / posixpath.basename(in_pod))
    args = parse(list(container["args"]))
    config = build_config(args, environ=env)  # loads the web config and the certificate
    assert config.web_config_file.endswith("web-config.yml")
    assert pod["securityContext"]["fsGroup"] == container["securityContext"]["runAsGroup"]


def test_probes_use_https_and_stay_on_the_open_paths():
    container = sidecar()
    for probe, path in (("livenessProbe", "/-/healthy"), ("readinessProbe", "/-/ready")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics", "scheme": "HTTPS"}


def test_servicemonitor_scrapes_over_https_with_basic_auth():
    (endpoint,) = one("ServiceMonitor", "vllm-cache-exporter")["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {
        "name": "vllm-cache-exporter-tls",
        "key": "ca.crt",
    }
    assert endpoint["tlsConfig"]["serverName"]
    auth = endpoint["basicAuth"]
    assert auth["username"]["name"] == auth["password"]["name"] == "vllm-cache-exporter-scrape-auth"
    # The base's relabeling survives the patch.
    assert endpoint["metricRelabelings"]


def test_the_base_is_untouched_by_the_overlay():
    base = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    base_sidecar = next(
        container
        for container in base["spec"]["template"]["spec"]["containers"]
        if container["name"] == SIDECAR
    )
    assert "volumeMounts" not in base_sidecar
    assert base_sidecar["args"] == sidecar()["args"]
