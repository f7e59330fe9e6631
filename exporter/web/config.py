"""The exporter-toolkit web configuration file, read into frozen values.

The file format is the Prometheus exporter-toolkit's (``--web.config.file`` of
node_exporter and Prometheus itself), so one file and one ``promtool check web-config``
serve every exporter of a fleet. Keys are matched exactly as the toolkit's strict YAML
decoding matches them: an unknown key, a duplicated key or a value of the wrong type is an
error, never skipped. Keys the toolkit has but this server cannot honour with Python's
``ssl`` module are errors too, each naming the key and saying why, because a security
setting that is silently dropped is worse than one that stops the process.

Relative paths are resolved against the directory of the web config file, as the toolkit
does, so a Kubernetes Secret mounted beside the file can be named by its key alone.

Deliberately stricter than the toolkit (each is a file the toolkit would take and then
serve differently from what it says): TLS settings without a certificate (the toolkit then
serves plain HTTP), ``min_version`` above ``max_version`` (no handshake could succeed),
TLS 1.3 suite names in ``cipher_suites`` (TLS 1.3 suites are not configurable in Go or
here; the toolkit ignores them) and an empty ``client_allowed_sans`` list (the toolkit then
refuses every client).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

# The largest web config file read; a real one is well under a kilobyte.
MAX_FILE_BYTES = 1024 * 1024

TLS_VERSIONS = ("TLS10", "TLS11", "TLS12", "TLS13")

# client_auth_type values Python's ssl can honour. The toolkit also has RequestClientCert
# and RequireAnyClientCert (alias RequireClientCert): they ask for a certificate without
# verifying it, and Python's ssl verifies every certificate it asks for.
CLIENT_AUTH_TYPES = ("NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
VERIFYING_CLIENT_AUTH = ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")

# Go's crypto/tls names (tls.CipherSuites(), the list the toolkit accepts) -> OpenSSL names.
# Only TLS 1.2-and-below suites: Go and OpenSSL through Python both always enable all three
# TLS 1.3 suites and let no list change that.
GO_TO_OPENSSL_CIPHERS: Mapping[str, str] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
TLS13_CIPHERS = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")

# The only response headers the toolkit lets the file set, with the values it allows
# (None: any value). Names are matched exactly, as the toolkit matches them.
ALLOWED_HEADERS: Mapping[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}

# A bcrypt hash as pyca/bcrypt verifies it: $2a$/$2b$/$2x$/$2y$, cost 04-31, 53 characters
# of salt and digest in bcrypt's base64 alphabet. (htpasswd -B writes $2y$.)
BCRYPT_HASH = re.compile(r"^\$2[abxy]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")


class WebConfigError(ValueError):
    """The web config cannot be used; ``str()`` is one line naming the file and the key."""

    def __init__(self, path: str, key: str, problem: str) -> None:
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class TLSServerConfig:
    """``tls_server_config``; file paths are absolute (resolved against the file's folder)."""

    cert_file: str = ""
    key_file: str = ""
    cert: str = ""
    key: str = field(default="", repr=False)
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    client_ca: str = ""
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()  # Go names, each a key of GO_TO_OPENSSL_CIPHERS
    prefer_server_cipher_suites: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.cert)

    @property
    def files(self) -> tuple[str, ...]:
        """The files this configuration reads: a change to any of them is a reload."""
        return tuple(path for path in (self.cert_file, self.key_file, self.client_ca_file) if path)


@dataclass(frozen=True)
class WebConfig:
    """One web config file, validated. Empty (the default) means plain HTTP, no auth."""

    path: str = ""
    tls: TLSServerConfig = field(default_factory=TLSServerConfig)
    headers: tuple[tuple[str, str], ...] = ()
    # (user name, bcrypt hash) in file order.
    users: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)

    @property
    def files(self) -> tuple[str, ...]:
        return (self.path, *self.tls.files) if self.path else self.tls.files


# --- YAML as Go's strict decoder reads it -------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (the toolkit's decoder does too)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_web_config(path: str) -> WebConfig:
    """Read and validate ``path``; raise WebConfigError with one line on any problem."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise WebConfigError(path, "", f"cannot read the file: {err.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise WebConfigError(path, "", f"larger than {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise WebConfigError(path, "", "not UTF-8 text") from None
    return parse_web_config(text, path)


def parse_web_config(text: str, path: str) -> WebConfig:
    """Validate the file's ``text``; ``path`` names it in errors and anchors relative paths."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid"
        raise WebConfigError(path, "", f"not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise WebConfigError(path, "", "must hold a mapping of settings")
    reader = _Reader(path)
    reader.known_keys(
        data,
        "",
        ("tls_server_config", "http_server_config", "basic_auth_users"),
        unsupported={
            "rate_limit": "not supported: rate limiting is not implemented by this server"
        },
    )
    tls = _tls_config(reader, reader.section(data, "tls_server_config"))
    headers = _http_config(reader, reader.section(data, "http_server_config"))
    users = _users(reader, data.get("basic_auth_users"))
    return WebConfig(path=path, tls=tls, headers=headers, users=users)


class _Reader:
    """Typed access to the decoded YAML, every error naming ``path`` and the dotted key."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.base_dir = os.path.dirname(os.path.abspath(path))

    def error(self, key: str, problem: str) -> WebConfigError:
        return WebConfigError(self.path, key, problem)

    def known_keys(
        self,
        data: Mapping[Any, Any],
        prefix: str,
        known: tuple[str, ...],
        unsupported: Mapping[str, str] | None = None,
    ) -> None:
        for key in data:
            name = f"{prefix}{key}"
            if unsupported and key in unsupported:
                raise self.error(name, unsupported[key])
            if key not in known:
                raise self.error(name, "unknown key")

    def section(self, data: Mapping[Any, Any], key: str, name: str = "") -> Mapping[Any, Any]:
        value = data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.error(name or key, "must be a mapping")
        return value

    def string(self, data: Mapping[Any, Any], key: str, name: str) -> str:
        value = data.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self.error(name, f"expected a string, got {_type_name(value)}")
        return value

    def boolean(self, data: Mapping[Any, Any], key: str, name: str, default: bool) -> bool:
        value = data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"expected true or false, got {_type_name(value)}")
        return value

    def strings(self, data: Mapping[Any, Any], key: str, name: str) -> tuple[str, ...] | None:
        value = data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.error(name, "expected a list of strings")
        return tuple(value)

    def file(self, data: Mapping[Any, Any], key: str, name: str) -> str:
        value = self.string(data, key, name)
        if not value or os.path.isabs(value):
            return value
        return os.path.join(self.base_dir, value)


def _type_name(value: Any) -> str:
    return {
        dict: "a mapping",
        list: "a list",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)


TLS_KEYS = (
    "cert_file",
    "key_file",
    "cert",
    "key",
    "client_auth_type",
    "client_ca_file",
    "client_ca",
    "client_allowed_sans",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
)
TLS_UNSUPPORTED = {
    "curve_preferences": "not supported: Python's ssl cannot set a list of preferred "
    "curves; remove the key to use OpenSSL's defaults",
}


def _tls_config(reader: _Reader, data: Mapping[Any, Any]) -> TLSServerConfig:
    prefix = "tls_server_config."
    reader.known_keys(data, prefix, TLS_KEYS, unsupported=TLS_UNSUPPORTED)

    def name(key: str) -> str:
        return prefix + key

    cert_file = reader.file(data, "cert_file", name("cert_file"))
    key_file = reader.file(data, "key_file", name("key_file"))
    cert = reader.string(data, "cert", name("cert"))
    key = reader.string(data, "key", name("key"))
    client_ca_file = reader.file(data, "client_ca_file", name("client_ca_file"))
    client_ca = reader.string(data, "client_ca", name("client_ca"))
    client_auth = reader.string(data, "client_auth_type", name("client_auth_type"))
    for first, second, (one, other) in (
        (cert_file, cert, ("cert_file", "cert")),
        (key_file, key, ("key_file", "key")),
        (client_ca_file, client_ca, ("client_ca_file", "client_ca")),
    ):
        if first and second:
            raise reader.error(name(other), f"cannot be given together with {one}")

    config = TLSServerConfig(
        cert_file=cert_file,
        key_file=key_file,
        cert=cert,
        key=key,
        client_auth_type=_client_auth(reader, client_auth, name("client_auth_type")),
        client_ca_file=client_ca_file,
        client_ca=client_ca,
        client_allowed_sans=_allowed_sans(reader, data, name("client_allowed_sans")),
        min_version=_version(reader, data, "min_version", name("min_version"), "TLS12"),
        max_version=_version(reader, data, "max_version", name("max_version"), "TLS13"),
        cipher_suites=_ciphers(reader, data, name("cipher_suites")),
        prefer_server_cipher_suites=reader.boolean(
            data, "prefer_server_cipher_suites", name("prefer_server_cipher_suites"), True
        ),
    )
    _check_tls_consistency(reader, data, config, client_auth)
    return config


def _check_tls_consistency(
    reader: _Reader, data: Mapping[Any, Any], config: TLSServerConfig, client_auth: str
) -> None:
    prefix = "tls_server_config."
    asks_for_tls = (
        config.enabled
        or config.key_file
        or config.key
        or config.client_ca_file
        or config.client_ca
        or client_auth
    )
    if not asks_for_tls:
        if data:  # min_version & co. with no certificate: the toolkit would serve plain HTTP
            raise reader.error(
                prefix + next(iter(data)),
                "TLS settings without cert_file/key_file: TLS would be off",
            )
        return
    if not config.enabled:
        raise reader.error(prefix + "cert_file", "missing one of cert or cert_file")
    if not (config.key_file or config.key):
        raise reader.error(prefix + "key_file", "missing one of key or key_file")
    has_ca = bool(config.client_ca_file or config.client_ca)
    if has_ca and config.client_auth_type == "NoClientCert":
        raise reader.error(
            prefix + "client_auth_type", "client CAs are configured without a client auth policy"
        )
    if config.client_allowed_sans and config.client_auth_type not in VERIFYING_CLIENT_AUTH:
        raise reader.error(
            prefix + "client_allowed_sans",
            "needs client_auth_type VerifyClientCertIfGiven or RequireAndVerifyClientCert",
        )
    if TLS_VERSIONS.index(config.min_version) > TLS_VERSIONS.index(config.max_version):
        raise reader.error(
            prefix + "min_version",
            f"{config.min_version} is above max_version {config.max_version}",
        )


def _client_auth(reader: _Reader, value: str, name: str) -> str:
    if value in ("", "NoClientCert"):
        return "NoClientCert"
    if value in UNVERIFIED_CLIENT_AUTH:
        raise reader.error(
            name,
            f"{value} is not supported: Python's ssl verifies every "
            "client certificate it asks for; use "
            "VerifyClientCertIfGiven or RequireAndVerifyClientCert",
        )
    if value not in CLIENT_AUTH_TYPES:
        raise reader.error(name, f"invalid client auth type {value!r}")
    return value


def _version(reader: _Reader, data: Mapping[Any, Any], key: str, name: str, default: str) -> str:
    value = reader.string(data, key, name) or default
    if value not in TLS_VERSIONS:
        raise reader.error(
            name, f"unknown TLS version {value!r} (one of {', '.join(TLS_VERSIONS)})"
        )
    return value


def _ciphers(reader: _Reader, data: Mapping[Any, Any], name: str) -> tuple[str, ...]:
    names = reader.strings(data, "cipher_suites", name) or ()
    for cipher in names:
        if cipher in TLS13_CIPHERS:
            raise reader.error(
                name,
                f"{cipher} is a TLS 1.3 suite: TLS 1.3 suites are not "
                "configurable (all three are always on)",
            )
        if cipher not in GO_TO_OPENSSL_CIPHERS:
            raise reader.error(name, f"unknown cipher {cipher!r}")
    return names


def _allowed_sans(reader: _Reader, data: Mapping[Any, Any], name: str) -> tuple[str, ...]:
    sans = reader.strings(data, "client_allowed_sans", name)
    if sans is not None and not sans:
        raise reader.error(name, "an empty list would refuse every client; remove the key")
    return sans or ()


def _http_config(reader: _Reader, data: Mapping[Any, Any]) -> tuple[tuple[str, str], ...]:
    prefix = "http_server_config."
    reader.known_keys(data, prefix, ("http2", "headers"))
    if reader.boolean(data, "http2", prefix + "http2", False):
        raise reader.error(
            prefix + "http2",
            "true is not supported: this server speaks HTTP/1.1 only; set false or remove the key",
        )
    headers = reader.section(data, "headers", prefix + "headers")
    out = []
    for header, value in headers.items():
        key = f"{prefix}headers.{header}"
        if header not in ALLOWED_HEADERS:
            raise reader.error(
                key,
                f"this HTTP header cannot be configured (allowed: {', '.join(ALLOWED_HEADERS)})",
            )
        if not isinstance(value, str):
            raise reader.error(key, f"expected a string, got {_type_name(value)}")
        allowed = ALLOWED_HEADERS[header]
        if allowed is not None and value not in allowed:
            raise reader.error(key, f"invalid value {value!r} (one of {', '.join(allowed)})")
        if "\r" in value or "\n" in value:
            raise reader.error(key, "the value must be one line")
        out.append((header, value))
    return tuple(out)


def _users(reader: _Reader, data: Any) -> tuple[tuple[str, bytes], ...]:
    key = "basic_auth_users"
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise reader.error(key, "must be a mapping of user name to bcrypt hash")
    users = []
    for user, hashed in data.items():
        if not isinstance(user, str):
            raise reader.error(key, f"user name {user!r} must be a string (quote it)")
        if not isinstance(hashed, str) or not BCRYPT_HASH.match(hashed):
            raise reader.error(
                f"{key}.{user}", "not a bcrypt hash (htpasswd -nBC 10 USER writes one)"
            )
        if ":" in user:  # Basic credentials split at the first colon
            raise reader.error(f"{key}.{user}", "a user name cannot contain ':'")
        users.append((user, hashed.encode("ascii")))
    return tuple(users)
