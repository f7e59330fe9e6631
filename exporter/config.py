"""Every flag of every subcommand, in one table; and the ``run`` command's frozen Config.

Each flag is declared once in ``FLAGS``: its name, the commands that take it, its type, its
default, its check and its help. From that one row come the argparse option, the
``VLLM_CACHE_EXPORTER_<FLAG>`` environment variable, the ``--config.file`` YAML key (``run``
only), the ``--help`` text and docs/configuration.md's reference tables, so none can drift. Names
follow node_exporter's vocabulary: a component's settings are dotted (``--vllm.url``,
``--web.listen-address``, ``--log.level``), a command's own switches are single words
(``--scenario``, ``--speed``, ``--check``). The same setting has the same name, and the
same environment variable, in every command that takes it.

Precedence, highest first: command-line flag, environment variable, ``--config.file``
YAML, default. Validation happens here, up front: a bad value is reported as one line naming
the flag or variable, and the process exits 2 (see ``cli``).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from exporter import logs
from exporter.monitoring.config import MonitoringConfigError
from exporter.monitoring.config import load_config as load_monitoring_config
from exporter.redaction import redact_text, redact_url
from exporter.signals.callers import (
    DEFAULT_CALLERS,
    DEFAULT_DETAILED,
    DEFAULT_MAX_SERIES,
    DEFAULT_MODEL_PATTERN,
    DEFAULT_NAME_PATTERN,
    DEFAULT_TARGETS,
)
from exporter.signals.foresight import (
    DEFAULT_HEADROOM_TOKENS,
    DEFAULT_IDLE_SECONDS,
    DEFAULT_MAX_CONVERSATIONS,
)
from exporter.signals.order import DEFAULT_WINDOW_SECONDS as DEFAULT_ORDER_WINDOW_SECONDS
from exporter.sim.scenario import DEFAULT_SCENARIO, DEMO_SCENARIO
from exporter.sim.scenario import available as available_scenarios
from exporter.usage.formats import MappingError, load_mapping
from exporter.web import WebConfigError
from exporter.web import load as load_web_config

ENV_PREFIX = "VLLM_CACHE_EXPORTER_"
# Not in the Prometheus default port allocations list as far as we could check (README).
DEFAULT_PORT = 10123
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
USAGE_FORMATS = ("native", "litellm", "openai", "mapping")
LOG_LEVELS = ("debug", "info", "warning", "error")


RUN, CHECK, DEMO, SIMULATE, DRIVE, GENERATE = (
    "run",
    "check",
    "demo",
    "simulate",
    "drive",
    "generate",
)
COMMANDS = (RUN, CHECK, DEMO, SIMULATE, DRIVE, GENERATE)


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
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {raw!r}")
    return value


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"expected a whole number, got {raw!r}")
    try:
        return int(str(raw).strip().replace("_", "")) if isinstance(raw, str) else int(raw)
    except (TypeError, ValueError, OverflowError):
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


def _to_token_mapping(raw: Any) -> tuple[tuple[str, int], ...]:
    """``model=12288,other=2048`` (or a YAML mapping, or repeated flags) -> sorted pairs of a
    name and a whole, non-negative number of tokens."""
    chunks = raw if isinstance(raw, list) else [raw]
    pairs: dict[str, int] = {}
    for chunk in chunks:
        for name, tokens in _to_mapping(chunk):
            try:
                count = _to_int(tokens)
            except ValueError:
                raise ValueError(
                    f"{name}: expected a whole number of tokens, got {tokens!r}"
                ) from None
            if count < 0:
                raise ValueError(f"{name}: must not be negative, got {count}")
            pairs[name] = count
    return tuple(sorted(pairs.items()))


def host_port(raw: str) -> str:
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {raw!r}")
    return raw


def http_url(raw: str) -> str:
    parts = urlsplit(raw.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL, got {redact_url(raw)!r}")
    try:
        parts.port  # noqa: B018 (raises on a port that is not one)
    except ValueError:
        raise ValueError(f"bad port in {redact_url(raw)!r}") from None
    return raw


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); an empty host or ``[::]`` style brackets handled."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


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
    check: Callable[[Any], object] | None = None  # raises ValueError on a bad parsed value
    secret: bool = False  # never echoed back in errors or --check-config output
    commands: frozenset[str] = frozenset({RUN})
    # A command whose default differs (the simulator listens on vLLM's port, say).
    command_defaults: Mapping[str, Any] = field(default_factory=dict)
    action: bool = False  # does something (--check-config) rather than set something

    @property
    def dest(self) -> str:
        return self.name.replace(".", "_").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def option(self) -> str:
        return "--" + self.name

    def default_for(self, command: str) -> Any:
        return self.command_defaults.get(command, self.default)


def _positive(value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")


def _non_negative(value: float | None) -> None:
    if value is not None and value < 0:
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


def _regex(value: str) -> None:
    try:
        re.compile(value)
    except re.error as err:
        raise ValueError(f"not a regular expression: {err}") from None


def _optional_host_port(value: str) -> None:
    if value:
        host_port(value)


def _optional_url(value: str) -> None:
    if value:
        http_url(value)


def _optional_int(raw: Any) -> int | None:
    return None if raw is None else _to_int(raw)


def _optional_float(raw: Any) -> float | None:
    return None if raw is None else _to_float(raw)


def _optional_str(raw: Any) -> str | None:
    return None if raw is None else _to_str(raw)


KiB = 1024
MiB = 1024 * 1024
ANY_COMMAND = frozenset(COMMANDS)
SCENARIO_COMMANDS = frozenset({DEMO, SIMULATE, DRIVE})


def _sim_flag(
    name: str, help_text: str, parse: Callable[[Any], Any], metavar: str | None, kind: str = "value"
) -> Flag:
    """A setting of the simulated vLLM, named after vLLM's own flag where it has one."""
    # Positivity where it matters is the engine's own check (EngineConfig), with its words.
    check = _non_negative if parse in (_optional_int, _optional_float) else None
    return Flag(
        f"sim.{name}",
        "Simulated engine",
        help_text,
        parse,
        None,
        kind=kind,
        metavar=metavar,
        check=check,
        commands=frozenset({SIMULATE}),
    )


FLAGS: tuple[Flag, ...] = (
    Flag(
        "check-config",
        "General",
        "Validate the configuration, print it (secrets redacted) and exit: 0 if valid, 2 if not.",
        _to_bool,
        False,
        kind="bool",
        action=True,
    ),
    Flag(
        "config.file",
        "General",
        "YAML file with any of these settings (keys are the flag "
        "names without dashes, flat or nested).",
        _to_str,
        "",
        metavar="FILE",
    ),
    Flag(
        "log.level",
        "General",
        "Log level.",
        _to_str,
        "info",
        metavar="LEVEL",
        check=_one_of(LOG_LEVELS),
        commands=frozenset({RUN, SIMULATE, DRIVE, DEMO}),
        command_defaults={DEMO: "warning"},
    ),
    Flag(
        "log.format",
        "General",
        "Log line format: logfmt (key=value fields, as Prometheus "
        "writes them) or json (one object a line). Fields: time, level, source, msg, and err "
        "for a traceback.",
        _to_str,
        "logfmt",
        metavar="FORMAT",
        check=_one_of(logs.FORMATS),
        commands=frozenset({RUN, SIMULATE, DRIVE, DEMO}),
    ),
    # --- web -----------------------------------------------------------------------------
    Flag(
        "web.listen-address",
        "Web",
        "Address to serve /metrics, /v1/usage and the status "
        f"page on (HOST:PORT; use 0.0.0.0:{DEFAULT_PORT} in a container). The demo's "
        "exporter picks a free port unless told one (point a Prometheus at it with this).",
        _to_str,
        DEFAULT_LISTEN,
        metavar="HOST:PORT",
        check=host_port,
        commands=frozenset({RUN, DEMO}),
        command_defaults={DEMO: "127.0.0.1:0"},
    ),
    Flag(
        "web.max-connections",
        "Web",
        "Most client connections served at once; one more is "
        "answered 503 and closed. Idle connections close after 30 s.",
        _to_int,
        512,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "web.uvloop",
        "Web",
        "Run the web server, the tap and the readers on uvloop's event "
        "loop (libuv) rather than asyncio's own: less CPU per request (--no-web.uvloop turns "
        "it off). Without uvloop installed, asyncio's is used.",
        _to_bool,
        True,
        kind="bool",
    ),
    Flag(
        "web.config.file",
        "Web",
        "exporter-toolkit web config file: TLS, client "
        "certificates, basic auth and response headers for this listener (see Security). "
        "Re-read when it or a file it names changes, and on SIGHUP.",
        _to_str,
        "",
        metavar="FILE",
    ),
    # --- vLLM engines ---------------------------------------------------------------------
    Flag(
        "vllm.url",
        "vLLM engine",
        "vLLM server to read /metrics from (repeatable, one per "
        "server; /metrics is appended when the URL has no path; one server given twice is "
        "an error).",
        _to_list,
        (),
        kind="list",
        metavar="URL",
        check=_each(http_url),
        commands=frozenset({RUN, CHECK}),
    ),
    Flag(
        "vllm.timeout",
        "vLLM engine",
        "Seconds to wait for one vLLM /metrics read; also "
        "bounded by Prometheus' X-Prometheus-Scrape-Timeout-Seconds.",
        _to_float,
        5.0,
        metavar="SECONDS",
        check=_positive,
        commands=frozenset({RUN, CHECK}),
    ),
    Flag(
        "vllm.max-body-bytes",
        "vLLM engine",
        "Largest vLLM /metrics body accepted.",
        _to_int,
        32 * MiB,
        metavar="BYTES",
        check=_positive,
        commands=frozenset({RUN, CHECK}),
    ),
    # --- usage (per-request records from the proxy) ---------------------------------------
    Flag(
        "usage.ingest.format",
        "Usage readers",
        "Default format of POST /v1/usage bodies (override per request with ?format=).",
        _to_str,
        "native",
        metavar="FORMAT",
        check=_one_of(USAGE_FORMATS),
    ),
    Flag(
        "usage.ingest.token-file",
        "Usage readers",
        "File holding the bearer token POST "
        "/v1/usage requires (or set VLLM_CACHE_EXPORTER_USAGE_INGEST_TOKEN).",
        _to_str,
        "",
        metavar="FILE",
    ),
    Flag(
        "usage.ingest.token",
        "Usage readers",
        "Bearer token POST /v1/usage requires (and "
        "drive sends). Prefer the environment variable or the token file.",
        _to_str,
        "",
        metavar="TOKEN",
        secret=True,
        commands=frozenset({RUN, DRIVE}),
    ),
    Flag(
        "usage.ingest.max-body-bytes",
        "Usage readers",
        "Largest POST /v1/usage body (413 above it).",
        _to_int,
        16 * MiB,
        metavar="BYTES",
        check=_positive,
    ),
    Flag(
        "usage.ingest.max-concurrent-bodies",
        "Usage readers",
        "Most POST /v1/usage bodies "
        "of the largest size read at once: the bodies being read or processed share this "
        "times the body limit, taken as their bytes arrive (a body trickling in holds only "
        "what it sent); one that finds no room waits up to 5 s, then gets 503 with "
        "Retry-After.",
        _to_int,
        4,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "usage.dedup.max-ids",
        "Usage readers",
        'Most event ids (the events\' "id", per '
        "caller) remembered to count a retried event once: each for at least "
        "--usage.dedup.window unless half this many newer ones came after it "
        "(vllm_cache_usage_ids_forgotten_early_total counts those); about 90 bytes each. "
        "POST /v1/usage's Idempotency-Key keeps a tenth as many batches.",
        _to_int,
        100_000,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "usage.dedup.window",
        "Usage readers",
        "Seconds an event id or an Idempotency-Key "
        "is remembered at least (at most twice that): a copy within it is counted once, as "
        '"duplicate".',
        _to_float,
        600.0,
        metavar="SECONDS",
        check=_positive,
    ),
    Flag(
        "usage.new-series-hold",
        "Usage readers",
        "Seconds a new per-caller series is exposed "
        "at zero before its counts show, so that every Prometheus scraping it sees it start "
        "at zero and rate() counts its first requests; at least your longest scrape interval "
        "(0: counts show at once, and Prometheus misses each series' first increase).",
        _to_float,
        60.0,
        metavar="SECONDS",
        check=_non_negative,
    ),
    Flag(
        "usage.file",
        "Usage readers",
        "JSONL file(s) to follow (repeatable, globs allowed).",
        _to_list,
        (),
        kind="list",
        metavar="GLOB",
    ),
    Flag(
        "usage.file.format",
        "Usage readers",
        "Format of the followed files.",
        _to_str,
        "native",
        metavar="FORMAT",
        check=_one_of(USAGE_FORMATS),
    ),
    Flag(
        "usage.file.from-start",
        "Usage readers",
        "Replay followed files from their start instead of their end.",
        _to_bool,
        False,
        kind="bool",
    ),
    Flag(
        "usage.file.poll-interval",
        "Usage readers",
        "Seconds between checks of followed files.",
        _to_float,
        1.0,
        metavar="SECONDS",
        check=_positive,
    ),
    Flag(
        "usage.file.max-open",
        "Usage readers",
        "Most followed files held open at once "
        "(never more than the followed files' share of the descriptors); past it the least "
        "recently written is closed, and reopened when it changes, read from where it was "
        "left.",
        _to_int,
        256,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "usage.mapping.file",
        "Usage readers",
        "YAML mapping of UsageEvent fields to dotted paths, for the 'mapping' format.",
        _to_str,
        "",
        metavar="FILE",
    ),
    Flag(
        "usage.litellm.caller-fields",
        "Usage readers",
        "Order in which LiteLLM payload fields name the caller.",
        _to_list,
        ("metadata.user_api_key_alias", "metadata.user_api_key_team_alias", "end_user"),
        kind="list",
        metavar="PATH",
    ),
    # --- callers --------------------------------------------------------------------------
    Flag(
        "callers.max",
        "Callers",
        "Most distinct caller label values, each with its own hit ratio and warm share (the "
        "nine series of docs/metrics.md); past it, the callers of smallest hash are kept (the "
        "same ones in every process, whatever the order they came in) and the rest counted as "
        "__other__.",
        _to_int,
        DEFAULT_CALLERS,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "callers.detailed",
        "Callers",
        "Callers whose costly families (TTFT, queue and "
        "completion histograms, prompt order) are their own, besides --callers.allow: those "
        'of smallest hash; every other caller\'s go to caller="__other__" of its model.',
        _to_int,
        DEFAULT_DETAILED,
        metavar="N",
        check=_non_negative,
    ),
    Flag(
        "callers.max-series",
        "Callers",
        "Most per-caller series exposed, each charged as it "
        "appears (9 per (caller, model) pair, 2 per vLLM target a pair's events name); a pair "
        "that would go past it is counted under caller __other__, a histogram or target entry "
        "that would under __other__'s (see docs/metrics.md).",
        _to_int,
        DEFAULT_MAX_SERIES,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "callers.targets-max",
        "Callers",
        "Most distinct vLLM targets (replicas) the per-caller prompt and cached tokens are "
        "also counted by (target label: the engine target read at the backend's origin, else "
        "its origin and /metrics, else the backend's name); the targets read come first, "
        'later ones and names over 128 characters are counted under target="__other__".',
        _to_int,
        DEFAULT_TARGETS,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "callers.name-pattern",
        "Callers",
        "Caller names that may be labels as they are "
        "(a regular expression matched against the whole name); any other name, and any "
        "name that looks like a secret, is shown as key-<12 hex of its SHA-256>.",
        _to_str,
        DEFAULT_NAME_PATTERN,
        metavar="REGEX",
        check=_regex,
    ),
    Flag(
        "callers.model-pattern",
        "Callers",
        "The same for model names.",
        _to_str,
        DEFAULT_MODEL_PATTERN,
        metavar="REGEX",
        check=_regex,
    ),
    Flag(
        "callers.keep-emails",
        "Callers",
        "Show e-mail addresses as caller names instead of "
        "their hash (personal data in your metrics).",
        _to_bool,
        False,
        kind="bool",
    ),
    Flag(
        "callers.allow",
        "Callers",
        "Callers that always get their own label, even past the cap (repeatable).",
        _to_list,
        (),
        kind="list",
        metavar="NAME",
    ),
    Flag(
        "callers.alias",
        "Callers",
        "Rename callers, NAME=ALIAS (repeatable; YAML: a mapping).",
        _to_mapping,
        (),
        kind="list",
        metavar="NAME=ALIAS",
    ),
    # --- classification -------------------------------------------------------------------
    Flag(
        "signals.granularity",
        "Classification",
        "Cache granularity in tokens (0: learn it from cached counts, else use vLLM's block size).",
        _to_int,
        0,
        metavar="TOKENS",
        check=_non_negative,
    ),
    Flag(
        "signals.warm-tail-granules",
        "Classification",
        "How many granules below the most a "
        "prompt can reuse still count as a full (warm) hit: a warm turn re-reads its new "
        "tokens plus the tail chunk.",
        _to_float,
        2.0,
        metavar="N",
        check=_non_negative,
    ),
    Flag(
        "signals.missing-cached-as-zero",
        "Classification",
        "Once a caller's events have "
        "carried cached_tokens, treat an event without it as 0 cached (vLLM < 0.24 omitted "
        "zeros).",
        _to_bool,
        True,
        kind="bool",
    ),
    # --- foresight: live conversations against the pool, the admission budget -----------
    Flag(
        "signals.conversation-idle",
        "Foresight",
        "Seconds after its last turn that a "
        "conversation still counts as active, i.e. still wants its prefix cached.",
        _to_float,
        DEFAULT_IDLE_SECONDS,
        metavar="SECONDS",
        check=_positive,
    ),
    Flag(
        "signals.conversations-max",
        "Foresight",
        "Most conversations tracked: each one's "
        "latest context (foresight) and previous turn (classification), about 280 bytes "
        "each (28 MB at 100,000; docs/limits.md). The least recently seen is forgotten "
        "first; vllm_cache_conversations_dropped_total counts active ones forgotten, whose "
        "next turns are classified unknown (VllmCacheConversationsDropped: raise this).",
        _to_int,
        DEFAULT_MAX_CONVERSATIONS,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "signals.state-tokens",
        "Foresight",
        "Override: KV-pool tokens one copy of a "
        "hybrid model's per-sequence recurrent state takes, MODEL=TOKENS (repeatable; the "
        "model as usage names it). Without it the state comes from the vLLM serving the "
        "model (vllm:cache_config_info). Each active conversation is charged one copy (the "
        "checkpoint its next turn resumes from), the turn being computed one more.",
        _to_token_mapping,
        (),
        kind="list",
        metavar="MODEL=TOKENS",
    ),
    Flag(
        "signals.admission-headroom",
        "Foresight",
        "Tokens the admission budget stays under "
        "the smallest KV pool seen (a few thousand: the conversations' next turns).",
        _to_int,
        DEFAULT_HEADROOM_TOKENS,
        metavar="TOKENS",
        check=_non_negative,
        commands=frozenset({RUN, CHECK}),
    ),
    Flag(
        "signals.prompt-order-window",
        "Foresight",
        "Seconds within which a caller's "
        "requests to one model are compared for prompt order (tap only): sharing most of "
        "their text but not its beginning means something variable sits at the top of the "
        "prompt.",
        _to_float,
        DEFAULT_ORDER_WINDOW_SECONDS,
        metavar="SECONDS",
        check=_positive,
    ),
    Flag(
        "exporter.url",
        "Foresight",
        "A running exporter to read as well (its /metrics and /api/v1/status): the "
        "live conversations' fit in the pool, the smallest pool it saw, declared vs used "
        "completion tokens, and each caller's hit ratio, baseline and warm share over the "
        "alerts' windows; exit 3 while a condition that pages holds.",
        _to_str,
        "",
        metavar="URL",
        check=_optional_url,
        commands=frozenset({CHECK}),
    ),
    # --- tap ------------------------------------------------------------------------------
    Flag(
        "tap.listen-address",
        "Tap proxy",
        "Run the transparent vLLM proxy on HOST:PORT (off when empty).",
        _to_str,
        "",
        metavar="HOST:PORT",
        check=_optional_host_port,
    ),
    Flag(
        "tap.upstream",
        "Tap proxy",
        "vLLM base URL the tap forwards to.",
        _to_str,
        "",
        metavar="URL",
        check=_optional_url,
    ),
    Flag(
        "tap.web-config.file",
        "Tap proxy",
        "Web config file for the tap's listener (same "
        "format: TLS, client certificates, headers; not basic_auth_users, as the tap's "
        "clients send their API key in the Authorization header).",
        _to_str,
        "",
        metavar="FILE",
    ),
    Flag(
        "tap.max-connections",
        "Tap proxy",
        "Most client connections the tap serves at once "
        "(each also holds one to vLLM); one more is answered 503 and closed.",
        _to_int,
        512,
        metavar="N",
        check=_positive,
    ),
    Flag(
        "tap.caller-header",
        "Tap proxy",
        "Request header naming the caller.",
        _to_str,
        "X-Caller",
        metavar="HEADER",
    ),
    Flag(
        "tap.session-header",
        "Tap proxy",
        "Request header naming the conversation, so each "
        "turn is judged against the previous turn of the same conversation (empty: off).",
        _to_str,
        "X-Session-Id",
        metavar="HEADER",
    ),
    Flag(
        "tap.key-alias",
        "Tap proxy",
        "Name callers by API key, KEY_SHA256_PREFIX=ALIAS (repeatable).",
        _to_mapping,
        (),
        kind="list",
        metavar="HASH=ALIAS",
    ),
    Flag(
        "tap.timeout",
        "Tap proxy",
        "Seconds to wait for upstream (whole request).",
        _to_float,
        600.0,
        metavar="SECONDS",
        check=_positive,
    ),
    Flag(
        "tap.max-request-bytes",
        "Tap proxy",
        "Largest request body forwarded.",
        _to_int,
        64 * MiB,
        metavar="BYTES",
        check=_positive,
    ),
    Flag(
        "tap.max-response-bytes",
        "Tap proxy",
        "Largest non-streamed response body.",
        _to_int,
        256 * MiB,
        metavar="BYTES",
        check=_positive,
    ),
    Flag(
        "tap.prompt-order-bytes",
        "Tap proxy",
        "Bytes at the start of each prompt "
        "fingerprinted (keyed digests, never the text) for the prompt-order diagnosis "
        "(0: off).",
        _to_int,
        32 * KiB,
        metavar="BYTES",
        check=_non_negative,
    ),
    # --- scenarios: demo, simulate, drive -------------------------------------------------
    Flag(
        "scenario",
        "Scenario",
        "Field-report scenario to play: a shipped one ("
        + ", ".join(available_scenarios())
        + ") or a YAML file. For simulate: take the "
        "engine settings from it.",
        _to_str,
        DEFAULT_SCENARIO,
        metavar="NAME",
        commands=SCENARIO_COMMANDS,
        # The demo tells a story, so it plays the one with a collapse in it; drive's
        # default is a workload for any server, which should stay warm where it fits.
        command_defaults={SIMULATE: "", DEMO: DEMO_SCENARIO},
    ),
    Flag(
        "speed",
        "Scenario",
        "Play X times faster than real time (demo: the scenario's own demo speed).",
        _optional_float,
        1.0,
        metavar="X",
        check=_positive,
        commands=SCENARIO_COMMANDS,
        command_defaults={DEMO: None},
    ),
    Flag(
        "duration",
        "Scenario",
        "Stop by itself after this many seconds (0: demo runs until "
        "Ctrl-C, drive until the scenario ends).",
        _to_float,
        0.0,
        metavar="SECONDS",
        check=_non_negative,
        commands=frozenset({DEMO, DRIVE}),
    ),
    Flag(
        "refresh",
        "Scenario",
        "Seconds between updates of the table (the story's lines come "
        "as they happen; default: 2 in a terminal, 10 otherwise).",
        _optional_float,
        None,
        metavar="SECONDS",
        check=_positive,
        commands=frozenset({DEMO}),
    ),
    Flag(
        "loop",
        "Scenario",
        "Start the scenario again, with new conversations, when it ends.",
        _to_bool,
        False,
        kind="bool",
        commands=frozenset({DRIVE}),
    ),
    Flag(
        "seed",
        "Scenario",
        "Seed for the conversation texts (default: from the clock, so a "
        "restarted driver does not find its old texts cached).",
        _optional_int,
        None,
        metavar="N",
        commands=frozenset({DRIVE}),
    ),
    # --- drive ----------------------------------------------------------------------------
    Flag(
        "drive.base-url",
        "Driver",
        "OpenAI-compatible server to drive: the simulator or a real vLLM.",
        _to_str,
        "http://127.0.0.1:8000",
        metavar="URL",
        check=http_url,
        commands=frozenset({DRIVE}),
    ),
    Flag(
        "drive.model",
        "Driver",
        "Model to ask for (default: the first one /v1/models lists).",
        _to_str,
        "",
        metavar="NAME",
        commands=frozenset({DRIVE}),
    ),
    Flag(
        "drive.exporter-url",
        "Driver",
        "Exporter to report usage to (POST URL/v1/usage); "
        "without it the usage events are printed to stdout as JSON lines.",
        _to_str,
        "",
        metavar="URL",
        check=_optional_url,
        commands=frozenset({DRIVE}),
    ),
    Flag(
        "drive.progress-interval",
        "Driver",
        "Seconds between two progress lines at info "
        "level: requests sent, reported (and delivered to the exporter), failed, and the "
        "scenario time (0: none).",
        _to_float,
        10.0,
        metavar="SECONDS",
        check=_non_negative,
        commands=frozenset({DRIVE}),
    ),
    # --- simulate -------------------------------------------------------------------------
    Flag(
        "sim.listen-address",
        "Simulated engine",
        "Where to serve the OpenAI API and /metrics (port 0 picks a free one).",
        _to_str,
        "127.0.0.1:8000",
        metavar="HOST:PORT",
        check=host_port,
        commands=frozenset({SIMULATE, DEMO}),
        command_defaults={DEMO: "127.0.0.1:0"},
    ),
    _sim_flag("served-model-name", "Model name the API serves.", _optional_str, "NAME"),
    _sim_flag(
        "kv-pool-tokens",
        'Tokens the KV-cache pool holds (vLLM\'s "GPU KV cache size: N tokens").',
        _optional_int,
        "N",
    ),
    _sim_flag("block-size", "KV-cache block size in tokens.", _optional_int, "N"),
    _sim_flag(
        "granularity",
        "Tokens per reusable granule, a multiple of the block size "
        "(default: the block size; on a hybrid model in align mode, the mamba block).",
        _optional_int,
        "N",
    ),
    _sim_flag(
        "max-model-len",
        "Longest prompt + completion accepted (default: the pool, at most 131072).",
        _optional_int,
        "N",
    ),
    _sim_flag("max-num-seqs", "Most requests running at once.", _optional_int, "N"),
    _sim_flag(
        "prefill-rate",
        "Prompt tokens read per second (one prompt at a time).",
        _optional_float,
        "X",
    ),
    _sim_flag("decode-rate", "Tokens per second one stream decodes alone.", _optional_float, "X"),
    _sim_flag(
        "decode-slowdown",
        "Each extra decoding stream slows every stream by this fraction.",
        _optional_float,
        "X",
    ),
    _sim_flag(
        "prefill-interference",
        "Each decoding stream slows prompt reading by this factor.",
        _optional_float,
        "X",
    ),
    _sim_flag(
        "state-tokens",
        "Tokens one recurrent-state copy of a hybrid model takes, in "
        "whole blocks, one per state group (a running request holds its live state and "
        "the checkpoint it will leave; a resumable prefix holds one). vLLM reserves the "
        "copies of each full-length request in the pool it prints, so the pool has that "
        "many more blocks.",
        _optional_int,
        "N",
    ),
    _sim_flag(
        "hybrid",
        "Simulate a hybrid (Mamba / linear-attention) model: prefix caching "
        "off by default, reuse only where a state checkpoint was saved.",
        _to_bool,
        None,
        kind="bool",
    ),
    _sim_flag(
        "enable-prefix-caching",
        "Prefix caching (default: on, off with --sim.hybrid as in vLLM before 0.26).",
        _to_bool,
        None,
        kind="bool",
    ),
    _sim_flag(
        "enable-prompt-tokens-details",
        "Report prompt_tokens_details.cached_tokens in usage (default: off, as in vLLM).",
        _to_bool,
        None,
        kind="bool",
    ),
    _sim_flag(
        "enable-per-request-metrics",
        "Add vLLM's per-request metrics object (TTFT, "
        "queue time, ...) to every response and to a stream's usage chunk (default: "
        "off, as in vLLM).",
        _to_bool,
        None,
        kind="bool",
    ),
    _sim_flag(
        "kv-cache-metrics",
        "Follow a sample of the KV blocks from allocation to "
        "eviction and serve vLLM's KV-residency histograms (vllm:kv_block_*_seconds), as "
        "vLLM's --kv-cache-metrics (default: off, as in vLLM).",
        _to_bool,
        None,
        kind="bool",
    ),
    _sim_flag(
        "kv-cache-metrics-sample",
        "Share of the KV blocks followed with "
        "--sim.kv-cache-metrics, above 0 and at most 1 (default: 0.01, as in vLLM).",
        _optional_float,
        "X",
    ),
    # --- generate -------------------------------------------------------------------------
    Flag(
        "monitoring.config-file",
        "Monitoring",
        "YAML file overriding knobs of "
        "exporter/monitoring/config.py (selector, windows, thresholds, for: durations, "
        "severities, uids, URLs). Give `run` the same file, so that the status page calls "
        "a collapse what the generated alerts call one.",
        _to_str,
        "",
        metavar="FILE",
        commands=frozenset({GENERATE, RUN}),
    ),
    Flag(
        "output-dir",
        "Generate",
        "Directory that holds alerts/ and dashboards/.",
        _to_str,
        ".",
        metavar="DIR",
        commands=frozenset({GENERATE}),
    ),
    Flag(
        "check",
        "Generate",
        "Write nothing; exit 1 and show a diff if the files on disk "
        "differ from what the generators produce.",
        _to_bool,
        False,
        kind="bool",
        commands=frozenset({GENERATE}),
    ),
    Flag(
        "format",
        "Generate",
        "prometheus: rule files + dashboards; prometheus-operator: one PrometheusRule manifest; "
        "vmalert: the two rule files for vmalert (VictoriaMetrics), keep_firing_for emulated.",
        _to_str,
        "prometheus",
        metavar="FORMAT",
        check=_one_of(("prometheus", "prometheus-operator", "vmalert")),
        commands=frozenset({GENERATE}),
    ),
    Flag(
        "output",
        "Generate",
        "With --format prometheus-operator: write the manifest here instead of stdout.",
        _to_str,
        "",
        metavar="FILE",
        commands=frozenset({GENERATE}),
    ),
)

# Flags holding URLs, shown with their credentials redacted.
URL_FLAGS = frozenset(
    {"vllm.url", "tap.upstream", "drive.base-url", "drive.exporter-url", "exporter.url"}
)
# The run command's settings (the fields of Config).
FLAGS_BY_DEST = {flag.dest: flag for flag in FLAGS if RUN in flag.commands and not flag.action}


def flags_for(command: str) -> list[Flag]:
    return [flag for flag in FLAGS if command in flag.commands]


def _default(name: str) -> Any:
    """The default of a ``run`` flag, as declared in FLAGS (so it is written once)."""
    flag = FLAGS_BY_DEST[name.replace(".", "_").replace("-", "_")]
    return flag.default


@dataclass(frozen=True)
class Config:
    """The ``run`` command's settings: one field per ``run`` flag, defaults from FLAGS."""

    web_listen_address: str = _default("web.listen-address")
    web_max_connections: int = _default("web.max-connections")
    web_uvloop: bool = _default("web.uvloop")
    web_config_file: str = _default("web.config.file")
    config_file: str = _default("config.file")
    log_level: str = _default("log.level")
    log_format: str = _default("log.format")
    vllm_url: tuple[str, ...] = _default("vllm.url")
    vllm_timeout: float = _default("vllm.timeout")
    vllm_max_body_bytes: int = _default("vllm.max-body-bytes")
    usage_ingest_format: str = _default("usage.ingest.format")
    usage_ingest_token_file: str = _default("usage.ingest.token-file")
    usage_ingest_token: str = field(default=_default("usage.ingest.token"), repr=False)
    usage_ingest_max_body_bytes: int = _default("usage.ingest.max-body-bytes")
    usage_ingest_max_concurrent_bodies: int = _default("usage.ingest.max-concurrent-bodies")
    usage_dedup_max_ids: int = _default("usage.dedup.max-ids")
    usage_dedup_window: float = _default("usage.dedup.window")
    usage_new_series_hold: float = _default("usage.new-series-hold")
    usage_file: tuple[str, ...] = _default("usage.file")
    usage_file_format: str = _default("usage.file.format")
    usage_file_from_start: bool = _default("usage.file.from-start")
    usage_file_poll_interval: float = _default("usage.file.poll-interval")
    usage_file_max_open: int = _default("usage.file.max-open")
    usage_mapping_file: str = _default("usage.mapping.file")
    usage_litellm_caller_fields: tuple[str, ...] = _default("usage.litellm.caller-fields")
    callers_max: int = _default("callers.max")
    callers_detailed: int = _default("callers.detailed")
    callers_max_series: int = _default("callers.max-series")
    callers_targets_max: int = _default("callers.targets-max")
    callers_name_pattern: str = _default("callers.name-pattern")
    callers_model_pattern: str = _default("callers.model-pattern")
    callers_keep_emails: bool = _default("callers.keep-emails")
    callers_allow: tuple[str, ...] = _default("callers.allow")
    callers_alias: tuple[tuple[str, str], ...] = _default("callers.alias")
    signals_granularity: int = _default("signals.granularity")
    signals_warm_tail_granules: float = _default("signals.warm-tail-granules")
    signals_missing_cached_as_zero: bool = _default("signals.missing-cached-as-zero")
    signals_conversation_idle: float = _default("signals.conversation-idle")
    signals_conversations_max: int = _default("signals.conversations-max")
    signals_state_tokens: tuple[tuple[str, int], ...] = _default("signals.state-tokens")
    signals_admission_headroom: int = _default("signals.admission-headroom")
    signals_prompt_order_window: float = _default("signals.prompt-order-window")
    tap_listen_address: str = _default("tap.listen-address")
    tap_upstream: str = _default("tap.upstream")
    tap_web_config_file: str = _default("tap.web-config.file")
    monitoring_config_file: str = _default("monitoring.config-file")
    tap_max_connections: int = _default("tap.max-connections")
    tap_caller_header: str = _default("tap.caller-header")
    tap_session_header: str = _default("tap.session-header")
    tap_key_alias: tuple[tuple[str, str], ...] = _default("tap.key-alias")
    tap_timeout: float = _default("tap.timeout")
    tap_max_request_bytes: int = _default("tap.max-request-bytes")
    tap_max_response_bytes: int = _default("tap.max-response-bytes")
    tap_prompt_order_bytes: int = _default("tap.prompt-order-bytes")

    @property
    def listen_host_port(self) -> tuple[str, int]:
        return split_host_port(self.web_listen_address)

    @property
    def engine_targets(self) -> tuple[str, ...]:
        """The targets read, normalised (``metrics_url``), each once; build_config has
        refused duplicates already (``duplicate_targets``)."""
        return tuple(dict.fromkeys(metrics_url(url) for url in self.vllm_url))

    def redacted(self) -> dict[str, Any]:
        """The effective settings, secrets masked: what --check-config prints."""
        out: dict[str, Any] = {}
        for flag in FLAGS_BY_DEST.values():
            value = getattr(self, flag.dest)
            if flag.secret and value:
                value = "<redacted>"
            elif flag.name in URL_FLAGS:
                value = (
                    tuple(redact_url(url) for url in value)
                    if isinstance(value, tuple)
                    else redact_url(value)
                )
            out[flag.name] = list(value) if isinstance(value, tuple) else value
        return out


DEFAULT_PORTS = {"http": 80, "https": 443}
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost", "ip6-loopback"})


def metrics_url(url: str) -> str:
    """A --vllm.url as the exporter reads and labels it: scheme and host lower-cased, the
    scheme's default port dropped, ``/metrics`` for a bare base URL (``http://h:8000``,
    ``http://h:8000/``), the fragment dropped. Any other path is kept as typed, a trailing
    slash too (``/metrics/`` may answer differently from ``/metrics``)."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    netloc = host if port is None or port == DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at:
        netloc = f"{userinfo}@{netloc}"
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return f"{scheme}://{netloc}{path}" + (f"?{parts.query}" if parts.query else "")


def _same_endpoint(url: str) -> tuple[str, str, int | None, str, str]:
    """What makes two target URLs one vLLM endpoint: credentials aside, and a trailing slash
    of the path aside."""
    parts = urlsplit(metrics_url(url))
    port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    return (parts.scheme, parts.hostname or "", port, parts.path.rstrip("/") or "/", parts.query)


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def duplicate_targets(urls: Sequence[str]) -> str | None:
    """The first --vllm.url that names an endpoint an earlier one already names (after
    metrics_url; credentials and a trailing slash aside), as a problem to report, or None.
    Read twice, one vLLM's counters would be counted twice in every sum over targets."""
    seen: dict[tuple[str, str, int | None, str, str], str] = {}
    for url in urls:
        key = _same_endpoint(url)
        if key in seen:
            return (
                f"{redact_url(url)} is the same vLLM endpoint as {redact_url(seen[key])} "
                f"(both read as {redact_url(metrics_url(url))}); give each vLLM once"
            )
        seen[key] = url
    return None


def loopback_aliases(urls: Sequence[str]) -> list[str]:
    """Warnings for targets that differ only in how they name this machine (``localhost``,
    ``127.0.0.1``, ``::1``, ``0.0.0.0``): probably one vLLM read twice. Names are not
    resolved (a name may resolve elsewhere later), so this only warns."""
    by_rest: dict[tuple[str, int | None, str, str], str] = {}
    warnings = []
    for url in urls:
        scheme, host, port, path, query = _same_endpoint(url)
        if not _is_loopback(host):
            continue
        rest = (scheme, port, path, query)
        if rest in by_rest:
            warnings.append(
                f"--vllm.url {redact_url(url)} and {redact_url(by_rest[rest])} "
                "both name this machine: if they are one vLLM, its counters are "
                "counted twice; give it once"
            )
        else:
            by_rest[rest] = url
    return warnings


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


def add_flags(parser: argparse.ArgumentParser, command: str = RUN) -> None:
    """Add ``command``'s flags to ``parser``, grouped in --help, each naming its variable."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags_for(command):
        section = sections.get(flag.group)
        if section is None:
            section = sections[flag.group] = parser.add_argument_group(flag.group)
        default = flag.default_for(command)
        default_text = "" if default in (None, "", ()) else f" (default: {_show(default)})"
        help_text = f"{flag.help}{default_text} [env {flag.env}]"
        if flag.kind == "bool":
            section.add_argument(
                flag.option,
                dest=flag.dest,
                action="store_const",
                const=True,
                default=None,
                help=help_text,
            )
            section.add_argument(
                "--no-" + flag.name,
                dest=flag.dest,
                action="store_const",
                const=False,
                default=None,
                help=argparse.SUPPRESS,
            )
        elif flag.kind == "list":
            section.add_argument(
                flag.option,
                dest=flag.dest,
                action="append",
                default=None,
                metavar=flag.metavar,
                help=help_text,
            )
        else:
            section.add_argument(
                flag.option, dest=flag.dest, default=None, metavar=flag.metavar, help=help_text
            )


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    return str(value)


def _parse(flag: Flag, source: str, value: Any) -> Any:
    parsed: Any
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
        problem = redact_text(str(err)) if not flag.secret else "invalid value"
        raise ConfigError(source, problem) from None
    return parsed


def resolve(
    command: str,
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, tuple[str, Any]] | None = None,
) -> dict[str, Any]:
    """Every flag of ``command``: defaults < file < environment < flags, parsed and checked."""
    environ = os.environ if environ is None else environ
    raw: dict[str, tuple[str, Any]] = dict(file_values or {})
    for flag in flags_for(command):
        if flag.env in environ:
            raw[flag.dest] = (flag.env, environ[flag.env])
        cli_value = getattr(args, flag.dest, None)
        if cli_value is not None:
            raw[flag.dest] = (flag.option, cli_value)
    values: dict[str, Any] = {}
    for flag in flags_for(command):
        if flag.dest in raw:
            values[flag.dest] = _parse(flag, *raw[flag.dest])
        else:
            values[flag.dest] = flag.default_for(command)
    return values


def settings(
    command: str, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """A subcommand's validated settings, as attributes named after the flags' dests."""
    return argparse.Namespace(**resolve(command, args, environ))


def action_requested(
    command: str, name: str, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether an action flag (``--check-config``) was given, on the command line or in its
    environment variable."""
    environ = os.environ if environ is None else environ
    flag = next(flag for flag in flags_for(command) if flag.name == name and flag.action)
    given = getattr(args, flag.dest, None)
    if given is not None:
        return bool(given)
    return bool(_parse(flag, flag.env, environ[flag.env])) if flag.env in environ else False


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Config:
    """The ``run`` command's Config: defaults < YAML < environment < flags, all checked."""
    environ = os.environ if environ is None else environ
    config_file = getattr(args, "config_file", None) or environ.get(
        FLAGS_BY_DEST["config_file"].env, ""
    )
    file_values: dict[str, tuple[str, Any]] = {}
    if config_file:
        for dest, value in load_yaml(config_file).items():
            file_values[dest] = (f"{config_file}: {FLAGS_BY_DEST[dest].name}", value)
    values = resolve(RUN, args, environ, file_values)
    values["config_file"] = config_file or ""
    return _cross_checks(Config(**{dest: values[dest] for dest in FLAGS_BY_DEST}))


def _cross_checks(config: Config) -> Config:
    duplicate = duplicate_targets(config.vllm_url)
    if duplicate:
        raise ConfigError("--vllm.url", duplicate)
    if bool(config.tap_listen_address) != bool(config.tap_upstream):
        raise ConfigError("--tap.upstream", "--tap.listen-address and --tap.upstream go together")
    if config.usage_ingest_token_file:
        try:
            with open(config.usage_ingest_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as err:
            raise ConfigError(
                "--usage.ingest.token-file",
                f"cannot read {config.usage_ingest_token_file}: {err.strerror}",
            ) from None
        if not token:
            raise ConfigError(
                "--usage.ingest.token-file", f"{config.usage_ingest_token_file} is empty"
            )
        config = dataclasses.replace(config, usage_ingest_token=token)
    if config.usage_file_format == "mapping" or config.usage_ingest_format == "mapping":
        if not config.usage_mapping_file:
            raise ConfigError("--usage.mapping.file", "the 'mapping' format needs a mapping file")
    if config.usage_mapping_file:  # read now so that a bad mapping is a configuration error
        try:
            load_mapping(config.usage_mapping_file)
        except MappingError as err:
            raise ConfigError(err.where, err.problem) from None
    _check_web_configs(config)
    if config.monitoring_config_file:  # read now: the status page's collapse thresholds
        try:
            load_monitoring_config(config.monitoring_config_file)
        except MonitoringConfigError as err:
            raise ConfigError("--monitoring.config-file", str(err)) from None
    return config


def _check_web_configs(config: Config) -> None:
    """Load the web config files now (certificates included), as promtool check web-config
    does, so that a bad one is a configuration error and --check-config catches it."""
    if config.tap_web_config_file and not config.tap_listen_address:
        raise ConfigError("--tap.web-config.file", "needs --tap.listen-address")
    for option, path, basic_auth in (
        ("--web.config.file", config.web_config_file, True),
        ("--tap.web-config.file", config.tap_web_config_file, False),
    ):
        if not path:
            continue
        try:
            load_web_config(path, allow_basic_auth=basic_auth)
        except WebConfigError as err:
            raise ConfigError(option, str(err)) from None


def flags_markdown(command: str = RUN) -> str:
    """A docs/configuration.md reference table, generated so it cannot drift from FLAGS."""
    lines = ["| Flag | Environment | Default | Meaning |", "|---|---|---|---|"]
    current = None
    for flag in flags_for(command):
        if flag.group != current:
            current = flag.group
            lines.append(f"| **{current}** | | | |")
        default_value = flag.default_for(command)
        default = _show(default_value) if default_value not in (None, "", ()) else ""
        option = flag.option + ("" if flag.kind == "bool" else f" {flag.metavar or 'VALUE'}")
        meaning = flag.help.replace("|", "\\|")
        lines.append(
            f"| `{option}` | `{flag.env}` | {f'`{default}`' if default else ''} | {meaning} |"
        )
    return "\n".join(lines) + "\n"
