"""The shipped example web configs, and agreement with ``promtool check web-config``
(Prometheus 2.42's exporter-toolkit): every file it accepts that uses keys this server
supports, the exporter accepts; what it rejects, the exporter rejects too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from exporter.web import WebConfigError, load
from exporter.web.config import GO_TO_OPENSSL_CIPHERS
from tests.monitoring.common import ROOT, require_tool
from tests.web.certs import make_pki

EXAMPLES = sorted((ROOT / "deploy" / "web-config").glob("*.yml"))
HASH = "$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
TLS = "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"
MTLS = TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"

# Files both must accept: every supported key and value, one or a few at a time.
BOTH_ACCEPT = {
    "empty": "",
    "users-only": f"basic_auth_users:\n  prometheus: '{HASH}'\n",
    "tls": TLS,
    "mtls": MTLS,
    "verify-if-given": TLS + "  client_auth_type: VerifyClientCertIfGiven\n"
    "  client_ca_file: ca.crt\n",
    "no-client-cert": TLS + "  client_auth_type: NoClientCert\n",
    "no-ca-required": TLS + "  client_auth_type: RequireAndVerifyClientCert\n",
    "versions": TLS + "  min_version: TLS13\n  max_version: TLS13\n",
    "old-versions": TLS + "  min_version: TLS10\n  max_version: TLS11\n",
    "prefer-client": TLS + "  prefer_server_cipher_suites: false\n",
    "http2-off": "http_server_config:\n  http2: false\n",
    "headers": "http_server_config:\n  headers:\n    Strict-Transport-Security: max-age=1\n"
    "    X-Content-Type-Options: nosniff\n    X-Frame-Options: sameorigin\n"
    "    X-XSS-Protection: '1; mode=block'\n"
    "    Content-Security-Policy: default-src 'self'\n",
    "everything": MTLS + "  min_version: TLS12\n  cipher_suites: [TLS_RSA_WITH_AES_128_CBC_SHA]\n"
    "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
    f"basic_auth_users:\n  a: '{HASH}'\n  b: '{HASH}'\n",
}
BOTH_ACCEPT.update(
    {
        f"cipher-{name}": TLS + f"  max_version: TLS12\n  cipher_suites: [{name}]\n"
        for name in GO_TO_OPENSSL_CIPHERS
    }
)

BOTH_REJECT = {
    "unknown-key": "tls_config: {}\n",
    "typo-in-tls": TLS + "  certfile: x\n",
    "duplicate": TLS + TLS,
    "ca-without-auth": TLS + "  client_ca_file: ca.crt\n",
    "bad-auth-type": TLS + "  client_auth_type: Sometimes\n",
    "bad-version": TLS + "  min_version: TLS9\n",
    "insecure-cipher": TLS + "  cipher_suites: [TLS_RSA_WITH_AES_128_CBC_SHA256]\n",
    "old-go-cipher-name": TLS + "  cipher_suites: [TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305]\n",
    "header-case": "http_server_config:\n  headers:\n    x-frame-options: deny\n",
    "header-value": "http_server_config:\n  headers:\n    X-Frame-Options: DENY\n",
    "header-not-allowed": "http_server_config:\n  headers:\n    Server: x\n",
    "not-a-hash": "basic_auth_users:\n  a: secret\n",
    "missing-cert": "tls_server_config:\n  cert_file: absent.crt\n  key_file: tls.key\n",
    "missing-key": "tls_server_config:\n  cert_file: tls.crt\n",
    "key-of-another-cert": "tls_server_config:\n  cert_file: tls.crt\n  key_file: client.key\n",
}

# Accepted by promtool, refused here on purpose, each for a reason given in the error.
ONLY_PROMTOOL_ACCEPTS = {
    "RequestClientCert": TLS + "  client_auth_type: RequestClientCert\n",
    "RequireAnyClientCert": TLS + "  client_auth_type: RequireAnyClientCert\n",
    "curve_preferences": TLS + "  curve_preferences: [CurveP256]\n",
    "http2-on": "http_server_config:\n  http2: true\n",
    "tls13-cipher-name": TLS + "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
    "tls-settings-without-cert": "tls_server_config:\n  min_version: TLS13\n",
    "min-above-max": TLS + "  min_version: TLS13\n  max_version: TLS12\n",
}


def promtool_verdicts(folder: Path, files: dict[str, str]) -> dict[str, bool]:
    """One promtool run over every file: name -> accepted."""
    promtool = require_tool("promtool")
    paths = []
    for name, text in files.items():
        path = folder / f"{name}.yml"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    result = subprocess.run(
        [promtool, "check", "web-config", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    verdicts = {}
    for name, path in zip(files, paths, strict=True):
        if f"{path} SUCCESS" in output:
            verdicts[name] = True
        else:
            assert f"{path} FAILED" in output or f"{path}:" in output, output
            verdicts[name] = False
    return verdicts


def exporter_accepts(folder: Path, name: str) -> bool:
    try:
        load(str(folder / f"{name}.yml"))
    except WebConfigError:
        return False
    return True


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_pki(tmp_path / "web").folder


def test_promtool_and_the_exporter_accept_every_shipped_example(folder):
    assert {path.name for path in EXAMPLES} == {"tls.yml", "tls-basic-auth.yml", "mtls.yml"}
    files = {path.stem: path.read_text(encoding="utf-8") for path in EXAMPLES}
    verdicts = promtool_verdicts(folder, files)
    assert verdicts == dict.fromkeys(files, True)
    for name in files:
        config, context = load(str(folder / f"{name}.yml"))
        assert context is not None and config.tls.min_version == "TLS12"
    assert load(str(folder / "tls-basic-auth.yml"))[0].users
    assert load(str(folder / "mtls.yml"))[0].tls.client_auth_type == "RequireAndVerifyClientCert"


def test_what_promtool_accepts_with_supported_keys_the_exporter_accepts(folder):
    verdicts = promtool_verdicts(folder, BOTH_ACCEPT)
    assert [name for name, ok in verdicts.items() if not ok] == [], "promtool disagrees"
    assert [name for name in BOTH_ACCEPT if not exporter_accepts(folder, name)] == []


def test_what_promtool_rejects_the_exporter_rejects(folder):
    verdicts = promtool_verdicts(folder, BOTH_REJECT)
    assert [name for name, ok in verdicts.items() if ok] == [], "promtool accepts these"
    assert [name for name in BOTH_REJECT if exporter_accepts(folder, name)] == []


def test_the_deliberate_differences_are_still_differences(folder):
    verdicts = promtool_verdicts(folder, ONLY_PROMTOOL_ACCEPTS)
    assert all(verdicts.values()), verdicts
    assert [name for name in ONLY_PROMTOOL_ACCEPTS if exporter_accepts(folder, name)] == []


def test_examples_are_usable_as_a_kubernetes_tls_secret_names_its_keys():
    for path in EXAMPLES:
        text = path.read_text(encoding="utf-8")
        assert "cert_file: tls.crt" in text and "key_file: tls.key" in text
