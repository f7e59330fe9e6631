"""The web config file read as exporter-toolkit reads it: what is accepted, how it is
understood, and a one-line error naming the key for everything else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.web.config import (
    GO_TO_OPENSSL_CIPHERS,
    MAX_FILE_BYTES,
    WebConfig,
    WebConfigError,
    parse_web_config,
    read_web_config,
)

HASH = "$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
PATH = "/etc/exporter/web.yml"
TLS = "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"


def parse(text: str) -> WebConfig:
    return parse_web_config(text, PATH)


def test_an_empty_file_is_plain_http_without_auth():
    for text in ("", "# nothing\n", "tls_server_config:\nhttp_server_config:\n"):
        config = parse(text)
        assert not config.tls.enabled and config.users == () and config.headers == ()


def test_relative_paths_are_resolved_against_the_files_folder_absolute_kept():
    config = parse(
        TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: /pki/ca.crt\n"
    )
    assert config.tls.cert_file == "/etc/exporter/tls.crt"
    assert config.tls.key_file == "/etc/exporter/tls.key"
    assert config.tls.client_ca_file == "/pki/ca.crt"
    assert config.files == (PATH, "/etc/exporter/tls.crt", "/etc/exporter/tls.key", "/pki/ca.crt")


def test_defaults_are_the_toolkits():
    tls = parse(TLS).tls
    assert (tls.min_version, tls.max_version) == ("TLS12", "TLS13")
    assert tls.prefer_server_cipher_suites is True
    assert tls.client_auth_type == "NoClientCert"
    assert tls.cipher_suites == ()


def test_every_supported_key_is_read():
    config = parse(f"""
tls_server_config:
  cert: "-----BEGIN CERTIFICATE-----"
  key: "-----BEGIN PRIVATE KEY-----"
  client_auth_type: VerifyClientCertIfGiven
  client_ca: "-----BEGIN CERTIFICATE-----"
  client_allowed_sans: [prometheus.example, 10.0.0.1]
  min_version: TLS13
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, TLS_RSA_WITH_AES_256_CBC_SHA]
  prefer_server_cipher_suites: false
http_server_config:
  http2: false
  headers:
    X-Frame-Options: deny
    Strict-Transport-Security: max-age=31536000
basic_auth_users:
  prometheus: {HASH}
  "123": {HASH}
""")
    assert config.tls.enabled and config.tls.files == ()
    assert config.tls.client_allowed_sans == ("prometheus.example", "10.0.0.1")
    assert config.tls.cipher_suites == (
        "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
        "TLS_RSA_WITH_AES_256_CBC_SHA",
    )
    assert config.tls.prefer_server_cipher_suites is False
    assert config.headers == (
        ("X-Frame-Options", "deny"),
        ("Strict-Transport-Security", "max-age=31536000"),
    )
    assert config.users == (("prometheus", HASH.encode()), ("123", HASH.encode()))


def test_every_go_cipher_name_maps_to_one_openssl_name():
    assert len(set(GO_TO_OPENSSL_CIPHERS.values())) == len(GO_TO_OPENSSL_CIPHERS) == 14


@pytest.mark.parametrize(
    "hashed",
    [
        "$2a$10$" + "a" * 53,
        "$2b$04$" + "a" * 53,
        "$2y$31$" + "a" * 53,
        "$2x$12$" + "./" * 26 + "A",
    ],
)
def test_bcrypt_hash_forms_that_bcrypt_verifies(hashed):
    assert parse(f"basic_auth_users:\n  u: '{hashed}'\n").users == (("u", hashed.encode()),)


# (file text, the key the error must name, words the message must hold)
REJECTED = [
    # --- keys: unknown, unsupported, duplicated -----------------------------------------
    ("tls_server_config_typo: {}\n", "tls_server_config_typo", "unknown key"),
    ("rate_limit: {interval: 1s}\n", "rate_limit", "not supported"),
    (
        TLS + "  curve_preferences: [X25519]\n",
        "tls_server_config.curve_preferences",
        "not supported",
    ),
    (TLS + "  cert_files: x\n", "tls_server_config.cert_files", "unknown key"),
    ("http_server_config: {http3: true}\n", "http_server_config.http3", "unknown key"),
    ("http_server_config: {http2: true}\n", "http_server_config.http2", "HTTP/1.1 only"),
    (TLS + TLS, "", "given twice"),
    (f"basic_auth_users:\n  a: '{HASH}'\n  a: '{HASH}'\n", "", "given twice"),
    # --- client auth ------------------------------------------------------------------------
    (
        TLS + "  client_auth_type: RequestClientCert\n",
        "tls_server_config.client_auth_type",
        "verifies every client certificate",
    ),
    (
        TLS + "  client_auth_type: RequireAnyClientCert\n",
        "tls_server_config.client_auth_type",
        "not supported",
    ),
    (
        TLS + "  client_auth_type: RequireClientCert\n",
        "tls_server_config.client_auth_type",
        "not supported",
    ),
    (
        TLS + "  client_auth_type: requireandverifyclientcert\n",
        "tls_server_config.client_auth_type",
        "invalid client auth type",
    ),
    (
        TLS + "  client_ca_file: ca.crt\n",
        "tls_server_config.client_auth_type",
        "without a client auth policy",
    ),
    (
        TLS + "  client_allowed_sans: [a]\n",
        "tls_server_config.client_allowed_sans",
        "needs client_auth_type",
    ),
    (
        TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_allowed_sans: []\n",
        "tls_server_config.client_allowed_sans",
        "refuse every client",
    ),
    # --- certificates -------------------------------------------------------------------
    (
        "tls_server_config: {key_file: tls.key}\n",
        "tls_server_config.cert_file",
        "missing one of cert or cert_file",
    ),
    (
        "tls_server_config: {cert_file: tls.crt}\n",
        "tls_server_config.key_file",
        "missing one of key or key_file",
    ),
    (TLS + "  cert: x\n", "tls_server_config.cert", "together with cert_file"),
    (TLS + "  key: x\n", "tls_server_config.key", "together with key_file"),
    (
        TLS + "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: a\n"
        "  client_ca: b\n",
        "tls_server_config.client_ca",
        "together with client_ca_file",
    ),
    (
        "tls_server_config: {min_version: TLS13}\n",
        "tls_server_config.min_version",
        "TLS would be off",
    ),
    # --- versions and ciphers -----------------------------------------------------------
    (TLS + "  min_version: TLS14\n", "tls_server_config.min_version", "unknown TLS version"),
    (TLS + "  max_version: tls12\n", "tls_server_config.max_version", "unknown TLS version"),
    (
        TLS + "  min_version: TLS13\n  max_version: TLS12\n",
        "tls_server_config.min_version",
        "above max_version",
    ),
    (
        TLS + "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
        "tls_server_config.cipher_suites",
        "TLS 1.3 suite",
    ),
    (
        TLS + "  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]\n",
        "tls_server_config.cipher_suites",
        "unknown cipher",
    ),
    (
        TLS + "  cipher_suites: [TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305]\n",
        "tls_server_config.cipher_suites",
        "unknown cipher",
    ),
    (
        TLS + "  cipher_suites: TLS_RSA_WITH_AES_128_CBC_SHA\n",
        "tls_server_config.cipher_suites",
        "list of strings",
    ),
    (
        TLS + "  prefer_server_cipher_suites: maybe\n",
        "tls_server_config.prefer_server_cipher_suites",
        "true or false",
    ),
    # --- headers ------------------------------------------------------------------------
    (
        "http_server_config: {headers: {x-frame-options: deny}}\n",
        "http_server_config.headers.x-frame-options",
        "cannot be configured",
    ),
    (
        "http_server_config: {headers: {Server: x}}\n",
        "http_server_config.headers.Server",
        "cannot be configured",
    ),
    (
        "http_server_config: {headers: {X-Frame-Options: DENY}}\n",
        "http_server_config.headers.X-Frame-Options",
        "invalid value",
    ),
    (
        "http_server_config: {headers: {X-Content-Type-Options: sniff}}\n",
        "http_server_config.headers.X-Content-Type-Options",
        "invalid value",
    ),
    ("http_server_config: {headers: [X-Frame-Options]}\n", "http_server_config.headers", "mapping"),
    # --- users --------------------------------------------------------------------------
    ("basic_auth_users: {a: plaintext}\n", "basic_auth_users.a", "not a bcrypt hash"),
    ("basic_auth_users: {a: 1}\n", "basic_auth_users.a", "not a bcrypt hash"),
    (
        "basic_auth_users: {a: '$2y$03$" + "a" * 53 + "'}\n",
        "basic_auth_users.a",
        "not a bcrypt hash",
    ),
    (
        "basic_auth_users: {a: '$2$10$" + "a" * 53 + "'}\n",
        "basic_auth_users.a",
        "not a bcrypt hash",
    ),
    (f"basic_auth_users: {{123: '{HASH}'}}\n", "basic_auth_users", "must be a string"),
    (f"basic_auth_users: {{'a:b': '{HASH}'}}\n", "basic_auth_users.a:b", "':'"),
    ("basic_auth_users: [a]\n", "basic_auth_users", "mapping"),
    # --- the file as a whole ------------------------------------------------------------
    ("- a\n", "", "must hold a mapping"),
    ("tls_server_config: [\n", "", "not valid YAML at line"),
    ("tls_server_config: 3\n", "tls_server_config", "must be a mapping"),
]


@pytest.mark.parametrize(
    "text,key,words",
    REJECTED,
    ids=[f"{index}-{key or words}" for index, (_t, key, words) in enumerate(REJECTED)],
)
def test_rejected_with_one_line_naming_the_key(text, key, words):
    with pytest.raises(WebConfigError) as caught:
        parse(text)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{PATH}: {key}: " if key else f"{PATH}: "), message
    assert caught.value.key == key
    assert words in message


def test_reading_the_file(tmp_path: Path):
    missing = tmp_path / "absent.yml"
    with pytest.raises(WebConfigError, match="cannot read the file"):
        read_web_config(str(missing))
    big = tmp_path / "big.yml"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(WebConfigError, match="larger than"):
        read_web_config(str(big))
    binary = tmp_path / "binary.yml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(WebConfigError, match="not UTF-8"):
        read_web_config(str(binary))
    good = tmp_path / "web.yml"
    good.write_text(TLS)
    assert read_web_config(str(good)).tls.cert_file == os.path.join(tmp_path, "tls.crt")


def test_the_key_never_shows_in_a_repr():
    config = parse(
        "tls_server_config:\n  cert: '-----BEGIN CERTIFICATE-----'\n"
        "  key: SECRET-KEY-MATERIAL\n"
        f"basic_auth_users: {{a: '{HASH}'}}\n"
    )
    assert "SECRET-KEY-MATERIAL" not in repr(config) and HASH not in repr(config)
