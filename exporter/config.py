"""One frozen Config from flags, environment and a YAML file.

Precedence, highest first: command-line flag, ``VLLM_CACHE_EXPORTER_<FLAG>`` environment
variable, ``--config.file`` YAML, built-in default. Every flag of every subsystem is declared
once in ``FLAGS`` so that ``--help``, the environment names, the YAML keys and the README's
reference cannot drift apart. Validation happens here, up front: a bad value is reported as
one line naming the field, and the process exits 2 (see ``cli``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

ENV_PREFIX = "VLLM_CACHE_EXPORTER_"
# Not in the Prometheus default port allocations list as far as we could check; see README.
DEFAULT_PORT = 10123
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
USAGE_FORMATS = ("native", "litellm", "openai", "mapping")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration value is unusable; ``str()`` is the one line shown to the user."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field_name = field_name
        self.problem = problem


# ---------------------------------------------------------------------------------------
# Value parsers: each takes the raw value (str from flag/env, or a YAML scalar) and returns
# the typed value or raises ValueError with a short reason.


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def _to_float(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    try:
        value = float(str(raw).strip().rstrip("s")) if isinstance(raw, str) else float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"expected a whole number, got {raw!r}")
    try:
        return int(str(raw).strip().replace("_", "")) if isinstance(raw, str) else int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expected a whole number, got {raw!r}") from None


def _to_str(raw: Any) -> str:
    if isinstance(raw, (dict, list)):
        raise ValueError(f"expected a string, got {type(raw).__name__}")
    return str(raw)


def _to_list(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, (list, tuple)):
        return tuple(str(item).strip() for item in raw if str(item).strip())
    return tuple(part.strip() for part in str(raw).split(",") if part.strip())


def _to_mapping(raw: Any) -> tuple[tuple[str, str], ...]:
    """``a=b,c=d`` or a YAML mapping -> sorted pairs (hashable, so Config stays frozen)."""
    if raw is None:
        return ()
    if isinstance(raw, Mapping):
        return tuple(sorted((str(k), str(v)) for k, v in raw.items()))
    pairs = []
    for part in _to_list(raw):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"expected key=value pairs, got {part!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(sorted(pairs))


def _host_port(raw: str) -> str:
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {raw!r}")
    return raw


def _http_url(raw: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http(s) URL, got {raw!r}")
    return raw


# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    name: str  # dotted flag name without dashes, e.g. "vllm.url"
    group: str
    help: str
    parse: Callable[[Any], Any]
    default: Any = None
    kind: str = "value"  # value | list | bool
    metavar: str | None = None
    check: Callable[[Any], None] | None = None  # raises ValueError on a bad parsed value
    secret: bool = False  # never echoed back in errors or --check-config output

    @property
    def dest(self) -> str:
        return self.name.replace(".", "_").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def option(self) -> str:
        return "--" + self.name


def _positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")


def _non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")


def _each(check: Callable[[str], Any]) -> Callable[[Sequence[str]], None]:
    def run(values: Sequence[str]) -> None:
        for value in values:
            check(value)

    return run


def _one_of(choices: Sequence[str]) -> Callable[[str], None]:
    def run(value: str) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")

    return run


def _optional_host_port(value: str) -> None:
    if value:
        _host_port(value)


def _optional_url(value: str) -> None:
    if value:
        _http_url(value)


MiB = 1024 * 1024

FLAGS: tuple[Flag, ...] = (
    # --- web -----------------------------------------------------------------------------
    Flag("web.listen-address", "Web", "Address to serve /metrics, /v1/usage and the status "
         f"page on (HOST:PORT). Default {DEFAULT_LISTEN}; use 0.0.0.0:{DEFAULT_PORT} in a "
         "container.", _to_str, DEFAULT_LISTEN, metavar="HOST:PORT", check=_host_port),
    Flag("web.config.file", "Web", "exporter-toolkit web config file: TLS, client "
         "certificates, basic auth and response headers for this listener (see Security). "
         "Re-read when it or a file it names changes, and on SIGHUP.", _to_str, "",
         metavar="FILE"),
    Flag("config.file", "Web", "YAML file with any of these settings (keys are the flag names "
         "without dashes, flat or nested).", _to_str, "", metavar="FILE"),
    Flag("log.level", "Web", "Log level.", _to_str, "info", metavar="LEVEL",
         check=_one_of(LOG_LEVELS)),
    # --- vLLM engines ---------------------------------------------------------------------
    Flag("vllm.url", "vLLM engine", "vLLM server to read /metrics from (repeatable, one per "
         "server; /metrics is appended when the URL has no path).", _to_list, (), kind="list",
         metavar="URL", check=_each(_http_url)),
    Flag("vllm.timeout", "vLLM engine", "Seconds to wait for one vLLM /metrics read; also "
         "bounded by Prometheus' X-Prometheus-Scrape-Timeout-Seconds.", _to_float, 5.0,
         metavar="SECONDS", check=_positive),
    Flag("vllm.max-body-bytes", "vLLM engine", "Largest vLLM /metrics body accepted.",
         _to_int, 32 * MiB, metavar="BYTES", check=_positive),
    # --- usage (per-request records from the proxy) ---------------------------------------
    Flag("usage.ingest.format", "Usage readers", "Default format of POST /v1/usage bodies "
         "(override per request with ?format=).", _to_str, "native", metavar="FORMAT",
         check=_one_of(USAGE_FORMATS)),
    Flag("usage.ingest.token-file", "Usage readers", "File holding the bearer token POST "
         "/v1/usage requires (or set VLLM_CACHE_EXPORTER_USAGE_INGEST_TOKEN).", _to_str, "",
         metavar="FILE"),
    Flag("usage.ingest.token", "Usage readers", "Bearer token POST /v1/usage requires. Prefer "
         "the environment variable or the token file.", _to_str, "", metavar="TOKEN",
         secret=True),
    Flag("usage.ingest.max-body-bytes", "Usage readers", "Largest POST /v1/usage body (413 "
         "above it).", _to_int, 16 * MiB, metavar="BYTES", check=_positive),
    Flag("usage.file", "Usage readers", "JSONL file(s) to follow (repeatable, globs allowed).",
         _to_list, (), kind="list", metavar="GLOB"),
    Flag("usage.file.format", "Usage readers", "Format of the followed files.", _to_str,
         "native", metavar="FORMAT", check=_one_of(USAGE_FORMATS)),
    Flag("usage.file.from-start", "Usage readers", "Replay followed files from their start "
         "instead of their end.", _to_bool, False, kind="bool"),
    Flag("usage.file.poll-interval", "Usage readers", "Seconds between checks of followed "
         "files.", _to_float, 1.0, metavar="SECONDS", check=_positive),
    Flag("usage.mapping.file", "Usage readers", "YAML mapping of UsageEvent fields to dotted "
         "paths, for the 'mapping' format.", _to_str, "", metavar="FILE"),
    Flag("usage.litellm.caller-fields", "Usage readers", "Order in which LiteLLM payload fields "
         "name the caller.", _to_list,
         ("metadata.user_api_key_alias", "metadata.user_api_key_team_alias", "end_user"),
         kind="list", metavar="PATH"),
    # --- callers --------------------------------------------------------------------------
    Flag("callers.max", "Callers", "Most distinct caller label values; later callers are "
         "counted as __other__.", _to_int, 100, metavar="N", check=_positive),
    Flag("callers.allow", "Callers", "Callers that always get their own label, even past the "
         "cap (repeatable).", _to_list, (), kind="list", metavar="NAME"),
    Flag("callers.alias", "Callers", "Rename callers, NAME=ALIAS (repeatable; YAML: a "
         "mapping).", _to_mapping, (), kind="list", metavar="NAME=ALIAS"),
    # --- classification -------------------------------------------------------------------
    Flag("signals.granularity", "Classification", "Cache granularity in tokens (0: learn it "
         "from cached counts, else use vLLM's block size).", _to_int, 0, metavar="TOKENS",
         check=_non_negative),
    Flag("signals.warm-tail-granules", "Classification", "How many granules below the most a "
         "prompt can reuse still count as a full (warm) hit: a warm turn re-reads its new "
         "tokens plus the tail chunk.", _to_float, 2.0, metavar="N", check=_non_negative),
    Flag("signals.missing-cached-as-zero", "Classification", "Once a caller's events have "
         "carried cached_tokens, treat an event without it as 0 cached (vLLM < 0.24 omitted "
         "zeros).", _to_bool, True, kind="bool"),
    # --- tap ------------------------------------------------------------------------------
    Flag("tap.listen-address", "Tap proxy", "Run the transparent vLLM proxy on HOST:PORT "
         "(off when empty).", _to_str, "", metavar="HOST:PORT", check=_optional_host_port),
    Flag("tap.upstream", "Tap proxy", "vLLM base URL the tap forwards to.", _to_str, "",
         metavar="URL", check=_optional_url),
    Flag("tap.web-config.file", "Tap proxy", "Web config file for the tap's listener (same "
         "format: TLS, client certificates, headers; not basic_auth_users, as the tap's "
         "clients send their API key in the Authorization header).", _to_str, "",
         metavar="FILE"),
    Flag("tap.caller-header", "Tap proxy", "Request header naming the caller.", _to_str,
         "X-Caller", metavar="HEADER"),
    Flag("tap.session-header", "Tap proxy", "Request header naming the conversation, so each "
         "turn is judged against the previous turn of the same conversation (empty: off).",
         _to_str, "X-Session-Id", metavar="HEADER"),
    Flag("tap.key-alias", "Tap proxy", "Name callers by API key, KEY_SHA256_PREFIX=ALIAS "
         "(repeatable).", _to_mapping, (), kind="list", metavar="HASH=ALIAS"),
    Flag("tap.timeout", "Tap proxy", "Seconds to wait for upstream (whole request).",
         _to_float, 600.0, metavar="SECONDS", check=_positive),
    Flag("tap.max-request-bytes", "Tap proxy", "Largest request body forwarded.", _to_int,
         64 * MiB, metavar="BYTES", check=_positive),
    Flag("tap.max-response-bytes", "Tap proxy", "Largest non-streamed response body.",
         _to_int, 256 * MiB, metavar="BYTES", check=_positive),
)

FLAGS_BY_DEST = {flag.dest: flag for flag in FLAGS}


@dataclass(frozen=True)
class Config:
    web_listen_address: str = DEFAULT_LISTEN
    web_config_file: str = ""
    config_file: str = ""
    log_level: str = "info"
    vllm_url: tuple[str, ...] = ()
    vllm_timeout: float = 5.0
    vllm_max_body_bytes: int = 32 * MiB
    usage_ingest_format: str = "native"
    usage_ingest_token_file: str = ""
    usage_ingest_token: str = field(default="", repr=False)
    usage_ingest_max_body_bytes: int = 16 * MiB
    usage_file: tuple[str, ...] = ()
    usage_file_format: str = "native"
    usage_file_from_start: bool = False
    usage_file_poll_interval: float = 1.0
    usage_mapping_file: str = ""
    usage_litellm_caller_fields: tuple[str, ...] = (
        "metadata.user_api_key_alias", "metadata.user_api_key_team_alias", "end_user")
    callers_max: int = 100
    callers_allow: tuple[str, ...] = ()
    callers_alias: tuple[tuple[str, str], ...] = ()
    signals_granularity: int = 0
    signals_warm_tail_granules: float = 2.0
    signals_missing_cached_as_zero: bool = True
    tap_listen_address: str = ""
    tap_upstream: str = ""
    tap_web_config_file: str = ""
    tap_caller_header: str = "X-Caller"
    tap_session_header: str = "X-Session-Id"
    tap_key_alias: tuple[tuple[str, str], ...] = ()
    tap_timeout: float = 600.0
    tap_max_request_bytes: int = 64 * MiB
    tap_max_response_bytes: int = 256 * MiB

    @property
    def listen_host_port(self) -> tuple[str, int]:
        host, _, port = self.web_listen_address.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)

    @property
    def engine_targets(self) -> tuple[str, ...]:
        return tuple(metrics_url(url) for url in self.vllm_url)

    def redacted(self) -> dict[str, Any]:
        """The effective settings, secrets masked: what --check-config prints."""
        out: dict[str, Any] = {}
        for flag in FLAGS:
            value = getattr(self, flag.dest)
            if flag.secret and value:
                value = "<redacted>"
            out[flag.name] = list(value) if isinstance(value, tuple) else value
        return out


def metrics_url(url: str) -> str:
    """vLLM serves /metrics; accept a bare base URL as the operator would type it."""
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        return url.rstrip("/") + "/metrics"
    return url


def _flatten_yaml(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        dest = name.replace(".", "_").replace("-", "_")
        if isinstance(value, Mapping) and dest not in FLAGS_BY_DEST:
            flat.update(_flatten_yaml(value, prefix=name + "."))
        else:
            flat[name] = value
    return flat


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise ConfigError("--config.file", f"cannot read {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("--config.file", f"{path} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("--config.file", f"{path} must hold a mapping of settings")
    flat = _flatten_yaml(data)
    values: dict[str, Any] = {}
    for name, value in flat.items():
        dest = name.replace(".", "_").replace("-", "_")
        if dest not in FLAGS_BY_DEST:
            raise ConfigError(f"{path}: {name}", "unknown setting")
        values[dest] = value
    return values


def add_flags(parser: argparse.ArgumentParser, groups: Sequence[str] | None = None) -> None:
    """Add the flags (of the named groups, or all) to ``parser``, grouped in --help."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        if groups is not None and flag.group not in groups:
            continue
        section = sections.get(flag.group)
        if section is None:
            section = sections[flag.group] = parser.add_argument_group(flag.group)
        default_text = "" if flag.default in (None, "", ()) else f" (default: {_show(flag)})"
        help_text = f"{flag.help}{default_text} [env {flag.env}]"
        if flag.kind == "bool":
            section.add_argument(flag.option, dest=flag.dest, action="store_const", const=True,
                                 default=None, help=help_text)
            section.add_argument("--no-" + flag.name, dest=flag.dest, action="store_const",
                                 const=False, default=None, help=argparse.SUPPRESS)
        elif flag.kind == "list":
            section.add_argument(flag.option, dest=flag.dest, action="append", default=None,
                                 metavar=flag.metavar, help=help_text)
        else:
            section.add_argument(flag.option, dest=flag.dest, default=None,
                                 metavar=flag.metavar, help=help_text)


def _show(flag: Flag) -> str:
    if isinstance(flag.default, tuple):
        return ",".join(str(item) for item in flag.default)
    return str(flag.default)


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Config:
    """Layer defaults < YAML < environment < flags, parse and validate every field."""
    environ = os.environ if environ is None else environ
    raw: dict[str, tuple[str, Any]] = {}  # dest -> (source shown in errors, raw value)

    config_file = getattr(args, "config_file", None) or environ.get(
        FLAGS_BY_DEST["config_file"].env, "")
    if config_file:
        for dest, value in load_yaml(config_file).items():
            raw[dest] = (f"{config_file}: {FLAGS_BY_DEST[dest].name}", value)
    for flag in FLAGS:
        if flag.env in environ:
            raw[flag.dest] = (flag.env, environ[flag.env])
        cli_value = getattr(args, flag.dest, None)
        if cli_value is not None:
            raw[flag.dest] = (flag.option, cli_value)

    # The token file is read here so that "file unreadable" is a configuration error.
    values: dict[str, Any] = {}
    for flag in FLAGS:
        if flag.dest not in raw:
            continue
        source, value = raw[flag.dest]
        try:
            if flag.kind == "list" and isinstance(value, list) and flag.parse is _to_list:
                parsed = tuple(item for chunk in value for item in _to_list(chunk))
            elif flag.kind == "list" and isinstance(value, list) and flag.parse is _to_mapping:
                parsed = tuple(sorted(pair for chunk in value for pair in _to_mapping(chunk)))
            else:
                parsed = flag.parse(value)
            if flag.check is not None:
                flag.check(parsed)
        except ValueError as err:
            raise ConfigError(source, str(err) if not flag.secret else "invalid value") from None
        values[flag.dest] = parsed
    values["config_file"] = config_file or ""
    config = Config(**values)
    return _cross_checks(config)


def _cross_checks(config: Config) -> Config:
    if bool(config.tap_listen_address) != bool(config.tap_upstream):
        raise ConfigError("--tap.upstream", "--tap.listen-address and --tap.upstream go together")
    if config.usage_ingest_token_file:
        try:
            with open(config.usage_ingest_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as err:
            raise ConfigError("--usage.ingest.token-file",
                              f"cannot read {config.usage_ingest_token_file}: {err.strerror}"
                              ) from None
        if not token:
            raise ConfigError("--usage.ingest.token-file",
                              f"{config.usage_ingest_token_file} is empty")
        config = dataclasses.replace(config, usage_ingest_token=token)
    if config.usage_file_format == "mapping" or config.usage_ingest_format == "mapping":
        if not config.usage_mapping_file:
            raise ConfigError("--usage.mapping.file", "the 'mapping' format needs a mapping file")
    if config.usage_mapping_file:  # read now so that a bad mapping is a configuration error
        from exporter.usage.formats import load_mapping

        load_mapping(config.usage_mapping_file)
    _check_web_configs(config)
    return config


def _check_web_configs(config: Config) -> None:
    """Load the web config files now (certificates included), as promtool check web-config
    does, so that a bad one is a configuration error and --check-config catches it."""
    if config.tap_web_config_file and not config.tap_listen_address:
        raise ConfigError("--tap.web-config.file", "needs --tap.listen-address")
    from exporter.web import WebConfigError, load

    for option, path, basic_auth in (("--web.config.file", config.web_config_file, True),
                                     ("--tap.web-config.file", config.tap_web_config_file,
                                      False)):
        if not path:
            continue
        try:
            load(path, allow_basic_auth=basic_auth)
        except WebConfigError as err:
            raise ConfigError(option, str(err)) from None


def flags_markdown() -> str:
    """The README's configuration reference, generated so it cannot drift from FLAGS."""
    lines = ["| Flag | Environment | Default | Meaning |", "|---|---|---|---|"]
    current = None
    for flag in FLAGS:
        if flag.group != current:
            current = flag.group
            lines.append(f"| **{current}** | | | |")
        default = _show(flag) if flag.default not in (None, "", ()) else ""
        option = flag.option + ("" if flag.kind == "bool" else f" {flag.metavar or 'VALUE'}")
        meaning = flag.help.replace("|", "\\|")
        lines.append(f"| `{option}` | `{flag.env}` | {f'`{default}`' if default else ''} "
                     f"| {meaning} |")
    return "\n".join(lines) + "\n"
