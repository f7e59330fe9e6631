"""Every knob of the generated alerts, recording rules and dashboards, in one frozen block.

The generators read nothing else, so a YAML file with a few of these keys (``generate
--config``) is all an operator needs to adapt the shipped rules: another job selector, a
cluster label, a quieter traffic floor, a pager-free severity. Values are validated here, up
front, with one line naming the key, because a typo in a window or a severity would otherwise
only show up as a Prometheus that refuses the rule file, or as an alert that never routes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import yaml

SEVERITIES = ("critical", "warning", "info")
# The engine signals a rule or panel reads (see exporter/engine/names.py). prompt_tokens_cached
# is left out on purpose: vLLM only has it since 0.16, and no rule depends on it. So are the
# signals only some vLLMs have (by-source splits, waiting by reason: newer releases; KV
# residency: --kv-cache-metrics): their panels are empty without them, and nothing pages.
DEFAULT_REQUIRED_SIGNALS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions",
    "kv_cache_usage",
    "requests_running",
    "requests_waiting",
    "cache_config_info",
)

_DURATION = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")
_DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_UID = re.compile(r"^[a-zA-Z0-9_-]{1,40}$")
# The baseline is the quantile of the long-window ratio at this many instants over the
# baseline window, one every baseline_window / 288 (but never closer than a tenth of the
# short window): exporter/signals/history.py's BASELINE_SAMPLES and SHORT_SLOTS, which the
# status page reads the same instants by (tests/monitoring/test_generate.py holds them equal).
BASELINE_SAMPLES = 288
SHORT_SLOTS = 10
# Prometheus' default lookback: a recorded series evaluated less often than this has gaps.
LOOKBACK_SECONDS = 300.0


class MonitoringConfigError(ValueError):
    """A knob is unusable; ``str()`` is the one line shown to the user."""


@dataclass(frozen=True)
class MonitoringConfig:
    # --- what to look at --------------------------------------------------------------------
    # Label matchers every expression carries. The labels they name are also kept by every
    # aggregation, so recorded series can be selected with the same matchers.
    selector: str = 'job="vllm-cache-exporter"'
    # The operator's topology labels (target labels or a Prometheus' external labels) that
    # every aggregation keeps, so one cluster's callers and engines are never summed with
    # another's in a fleet's Prometheus; a label a series lacks costs nothing.
    topology_labels: tuple[str, ...] = ("cluster", "namespace")
    # More labels every aggregation keeps, beside the topology ones (e.g. instance).
    extra_group_labels: tuple[str, ...] = ()
    # The label an HA pair of Prometheus servers (or agents) tell their copies apart by, in
    # their external labels: the exporter's series are read through `max without (...)` of it
    # before any sum, so a store that holds both copies does not double every sum. Empty: off.
    replica_labels: tuple[str, ...] = ("prometheus_replica",)
    short_window: str = "5m"
    long_window: str = "1h"
    # How far back the collapse alerts' baseline remembers what the cache does when it works.
    # A collapse becomes the new normal only after lasting most of this; a day covers a
    # workload's daily rhythm. Longer costs Prometheus more samples read per evaluation.
    baseline_window: str = "1d"
    # Evaluation interval of the generated groups but the per-caller ones; empty: Prometheus'
    # global one.
    rule_interval: str = ""
    # The per-caller rules cost Prometheus in proportion to the series they read, ten
    # thousand callers times every model. Evaluation interval of what the collapse alert
    # compares now per caller (the short-window prompt and cached token rates and their hit
    # ratio): at 10,000 callers x 3 models one evaluation reads 60,000 series and writes
    # 90,000, over 10% of a 15 s interval; the alert (for: 5m) only gains up to this late.
    # At most 5m (Prometheus' lookback), as the next two.
    caller_interval: str = "30s"
    # Evaluation interval of the rest of the short window per caller (unreported tokens,
    # requests by state, warm share, TTFT: dashboards and the TTFT alert, for: 5m).
    caller_detail_interval: str = "2m"
    # Evaluation interval of the per-caller long windows (rates, ratios, completion tokens,
    # prompt order) and the baselines: an hour's ratio moves little in a minute. Longer than
    # a baseline step (baseline_window / 288), two baseline instants would read one ratio.
    caller_long_interval: str = "2m"
    # --- links ------------------------------------------------------------------------------
    runbook_url: str = (
        "https://github.com/vllm-cache-exporter/vllm-cache-exporter/blob/main/docs/runbook.md"
    )
    dashboard_url: str = "http://localhost:3000"
    overview_uid: str = "vllm-cache-overview"
    caller_uid: str = "vllm-cache-caller"
    # --- colour bands (dashboards and `vllm-cache-exporter demo`) ---------------------------
    # A hit ratio (engine or caller) is red below fair, orange from fair, green from good.
    hit_ratio_fair: float = 0.3
    hit_ratio_good: float = 0.6
    # The share of warm turns among the classified ones: the same three colours.
    warm_share_fair: float = 0.5
    warm_share_good: float = 0.8
    # --- VllmCachePrefixCollapse ------------------------------------------------------------
    collapse_drop_factor: float = 0.5  # short-window ratio below this x its long-window baseline
    collapse_min_baseline: float = 0.3  # ...and the baseline above this: there was a cache to lose
    collapse_engine_min_tokens_per_second: float = 100.0  # traffic floor, per vLLM target
    collapse_caller_min_tokens_per_second: float = 100.0  # traffic floor, per caller
    collapse_for: str = "5m"
    # Once firing, keep firing while the condition is briefly false (a gap in a slow caller's
    # traffic, one lucky warm turn): a page resolves when the cache recovers, not in a gap.
    # Resolution comes this much after recovery; "0s" turns it off.
    collapse_keep_firing_for: str = "10m"
    collapse_severity: str = "critical"
    # --- VllmCacheWarmTTFTCollapse ----------------------------------------------------------
    warm_ttft_seconds: float = 60.0  # median TTFT of turns that should be warm, above this
    warm_ttft_min_warm_share: float = 0.5  # "should be warm": baseline warm share above this
    warm_ttft_min_requests_per_second: float = 0.005  # ~2 turns per 5m before a median counts
    warm_ttft_for: str = "5m"
    warm_ttft_keep_firing_for: str = "10m"
    warm_ttft_severity: str = "warning"
    # --- VllmCachePrefixCachingDisabled -----------------------------------------------------
    prefix_caching_disabled_for: str = "5m"
    prefix_caching_disabled_severity: str = "warning"
    # --- VllmCacheCachedTokensNotReported ---------------------------------------------------
    not_reported_for: str = "15m"
    not_reported_severity: str = "warning"
    # --- VllmCachePreemptions ---------------------------------------------------------------
    preemptions_per_minute: float = 1.0
    preemptions_for: str = "10m"
    preemptions_severity: str = "warning"
    # --- VllmCacheKVPoolNearFull ------------------------------------------------------------
    kv_pool_full_ratio: float = 0.95
    kv_pool_full_for: str = "15m"
    kv_pool_full_severity: str = "warning"
    # --- VllmCacheConversationsExceedKVPool (foresight) --------------------------------------
    # Fires when the live conversations' demand passes the exporter's own admission budget
    # (vllm_cache_engine_admission_budget_tokens: the smallest pool seen less the exporter's
    # --signals.admission-headroom), so the headroom is set in one place, on the exporter.
    conversations_min_active: float = 2.0  # one conversation alone cannot be evicted by another
    conversations_for: str = "2m"
    conversations_severity: str = "warning"
    # How far back the smallest pool (and the admission budget under it) is looked for: long
    # enough to cover several vLLM boots.
    pool_min_window: str = "7d"
    # --- VllmCachePromptVariableTop (prompt order, the tap) ----------------------------------
    # Share of a caller's compared requests, over the long window, that share most of their
    # text with a recent one but not its beginning; and how many of those at least.
    prompt_order_share: float = 0.5
    prompt_order_min_requests: float = 2.0
    prompt_order_for: str = "15m"
    prompt_order_severity: str = "warning"
    # --- VllmCacheUnseenHistory ------------------------------------------------------------
    # Share of a model's turns, over the long window, whose cached tokens the exporter's
    # memory of their conversation cannot explain (earlier turns went to another exporter),
    # and how many of those at least.
    unseen_history_share: float = 0.25
    unseen_history_min_requests: float = 10.0
    unseen_history_for: str = "15m"
    unseen_history_severity: str = "warning"
    # --- VllmCacheConversationsDropped ------------------------------------------------------
    # The exporter dropped conversations still in use (more are live than
    # --signals.conversations-max holds), or their next turns came back unclassifiable, within
    # the short window, for this long: a single burst of new sessions stays silent.
    conversations_dropped_for: str = "10m"
    conversations_dropped_severity: str = "warning"
    # --- VllmCacheEngineDown / VllmCacheExporterDown ----------------------------------------
    engine_down_for: str = "5m"
    engine_down_severity: str = "warning"
    exporter_down_for: str = "5m"
    exporter_down_severity: str = "warning"
    # --- VllmCacheExporterAbsent ------------------------------------------------------------
    # Every exporter of a topology group (or of the whole selector) gone from the store
    # without a failed scrape: a crashed Prometheus agent, a target dropped from service
    # discovery. Remembered this long after the last sample, then it is the new normal.
    exporter_absent_window: str = "1h"
    exporter_absent_for: str = "5m"
    exporter_absent_severity: str = "warning"
    # --- VllmCacheDuplicateTarget -----------------------------------------------------------
    # Two exporters report the same vLLM target under the same topology labels (sidecars
    # without the `target` relabel all read localhost): every per-target rule merges them.
    duplicate_target_for: str = "5m"
    duplicate_target_severity: str = "warning"
    # --- VllmCacheEngineMetricAbsent --------------------------------------------------------
    required_signals: tuple[str, ...] = DEFAULT_REQUIRED_SIGNALS
    metric_absent_for: str = "10m"
    metric_absent_severity: str = "warning"
    # --- prometheus-operator output ---------------------------------------------------------
    prometheus_rule_name: str = "vllm-cache-exporter"
    prometheus_rule_namespace: str = ""
    prometheus_rule_labels: tuple[tuple[str, str], ...] = (
        ("app.kubernetes.io/name", "vllm-cache-exporter"),
        ("role", "alert-rules"),
    )

    def __post_init__(self) -> None:
        _validate(self)

    # --- derived ------------------------------------------------------------------------------
    @property
    def selector_labels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for name, _op, _value in parse_selector(self.selector)))

    @property
    def group_labels(self) -> tuple[str, ...]:
        """Labels every aggregation keeps: the selector's, the topology's, the extra ones."""
        return tuple(
            dict.fromkeys((*self.selector_labels, *self.topology_labels, *self.extra_group_labels))
        )

    @property
    def short_seconds(self) -> float:
        return duration_seconds(self.short_window)

    @property
    def long_seconds(self) -> float:
        return duration_seconds(self.long_window)

    @property
    def baseline_seconds(self) -> float:
        return duration_seconds(self.baseline_window)

    @property
    def baseline_step_seconds(self) -> float:
        """Time between the baseline's instants, in whole milliseconds (a subquery's step)."""
        step = max(self.short_seconds / SHORT_SLOTS, self.baseline_seconds / BASELINE_SAMPLES)
        return round(step, 3)

    @property
    def baseline_step(self) -> str:
        return duration_text(self.baseline_step_seconds)


def parse_selector(selector: str) -> list[tuple[str, str, str]]:
    """``job="x", env=~"a|b"`` -> [(name, op, value)]; raises ValueError on anything else."""
    text = selector.strip()
    if not text:
        return []
    matchers = []
    position = 0
    while position < len(text):
        match = _MATCHER.match(text, position)
        if match is None:
            raise ValueError(f'expected label matchers like job="x", got {selector!r}')
        matchers.append((match.group(1), match.group(2), match.group(3)))
        position = match.end()
        if position < len(text):
            if text[position] != ",":
                raise ValueError(f"expected a comma between matchers in {selector!r}")
            position += 1
    return matchers


def duration_seconds(text: str) -> float:
    if not _DURATION.match(text):
        raise ValueError(f"expected a Prometheus duration like 5m or 1h30m, got {text!r}")
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))


def duration_text(seconds: float) -> str:
    """A Prometheus duration for a whole number of milliseconds, in the largest unit that
    holds it exactly: 300 -> 5m, 2.083 -> 2083ms."""
    millis = round(seconds * 1000)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if millis % size == 0:
            return f"{millis // size}{unit}"
    return f"{millis}ms"


def _fail(name: str, problem: str) -> None:
    raise MonitoringConfigError(f"{name}: {problem}")


def _validate(config: MonitoringConfig) -> None:
    """Every check, each naming the key it is about (the first that fails is raised)."""
    _check_labels(config)
    for item in fields(config):
        _check_field(item.name, getattr(config, item.name))
    _check_windows(config)
    _check_fractions(config)
    _check_links(config)


def _check_labels(config: MonitoringConfig) -> None:
    try:
        parse_selector(config.selector)
    except ValueError as err:
        _fail("selector", str(err))
    for key in ("topology_labels", "extra_group_labels", "replica_labels"):
        for label in getattr(config, key):
            if not _LABEL.match(label):
                _fail(key, f"{label!r} is not a label name")
    for label in config.replica_labels:
        if label in config.group_labels:
            _fail("replica_labels", f"{label!r} is also a label every aggregation keeps")
    if not config.required_signals:
        _fail("required_signals", "must name at least one signal")
    for signal in config.required_signals:
        if not _LABEL.match(signal):
            _fail("required_signals", f"{signal!r} is not a signal name")


def _check_field(name: str, value: Any) -> None:
    """What a key's name says it holds: a duration, a severity, a non-negative number."""
    if name.endswith(("_for", "_window", "_interval")):
        if name == "rule_interval" and value == "":
            return
        try:
            seconds = duration_seconds(value)
        except ValueError as err:
            _fail(name, str(err))
        if name.endswith(("_window", "_interval")) and seconds <= 0:
            _fail(name, "must be longer than 0")
    elif name.endswith("_severity"):
        if value not in SEVERITIES:
            _fail(name, f"must be one of {', '.join(SEVERITIES)}, got {value!r}")
    elif isinstance(value, float) and value < 0:
        _fail(name, f"must not be negative, got {value}")


def _check_windows(config: MonitoringConfig) -> None:
    if config.short_seconds >= config.long_seconds:
        _fail("short_window", f"must be shorter than long_window ({config.long_window})")
    if config.long_seconds >= config.baseline_seconds:
        _fail("long_window", f"must be shorter than baseline_window ({config.baseline_window})")
    for key in ("caller_interval", "caller_detail_interval", "caller_long_interval"):
        if duration_seconds(getattr(config, key)) > LOOKBACK_SECONDS:
            _fail(key, "must be at most 5m (Prometheus' lookback)")


def _check_fractions(config: MonitoringConfig) -> None:
    for name in (
        "collapse_drop_factor",
        "collapse_min_baseline",
        "warm_ttft_min_warm_share",
        "kv_pool_full_ratio",
        "prompt_order_share",
        "unseen_history_share",
        "hit_ratio_fair",
        "hit_ratio_good",
        "warm_share_fair",
        "warm_share_good",
    ):
        if not 0 < getattr(config, name) <= 1:
            _fail(name, f"must be in (0, 1], got {getattr(config, name)}")
    for fair, good in (
        ("hit_ratio_fair", "hit_ratio_good"),
        ("warm_share_fair", "warm_share_good"),
    ):
        if getattr(config, fair) >= getattr(config, good):
            _fail(good, f"must be above {fair} ({getattr(config, fair)})")


def _check_links(config: MonitoringConfig) -> None:
    for name in ("overview_uid", "caller_uid"):
        if not _UID.match(getattr(config, name)):
            _fail(name, "must be 1-40 letters, digits, '-' or '_' (a Grafana uid)")
    if config.overview_uid == config.caller_uid:
        _fail("caller_uid", "must differ from overview_uid")
    for name in ("runbook_url", "dashboard_url"):
        if not getattr(config, name).startswith(("http://", "https://")):
            _fail(name, "must be an http(s) URL")


# --- YAML override ------------------------------------------------------------------------


def _coerce(name: str, default: Any, raw: Any) -> Any:
    if isinstance(default, float):
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise MonitoringConfigError(f"{name}: expected a number, got {raw!r}")
        return float(raw)
    if isinstance(default, str):
        if not isinstance(raw, str):
            raise MonitoringConfigError(f"{name}: expected a string, got {raw!r}")
        return raw
    if name == "prometheus_rule_labels":
        if not isinstance(raw, Mapping):
            raise MonitoringConfigError(f"{name}: expected a mapping of label: value")
        return tuple(sorted((str(k), str(v)) for k, v in raw.items()))
    if isinstance(default, tuple):
        if isinstance(raw, str):
            raw = [part.strip() for part in raw.split(",") if part.strip()]
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise MonitoringConfigError(f"{name}: expected a list of strings, got {raw!r}")
        return tuple(raw)
    raise MonitoringConfigError(f"{name}: unsupported setting")


# Keys an older release had, and where their setting went.
REMOVED = {
    "conversations_headroom_tokens": "removed: VllmCacheConversationsExceedKVPool reads the "
    "exporter's vllm_cache_engine_admission_budget_tokens; set the headroom with the "
    "exporter's --signals.admission-headroom",
}


def config_from_mapping(data: Mapping[str, Any], source: str = "config") -> MonitoringConfig:
    """Defaults overridden by ``data``; unknown keys and wrong types are errors, not ignored."""
    defaults = MonitoringConfig()
    known = {item.name: item for item in fields(MonitoringConfig)}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = str(key).replace("-", "_")
        if name in REMOVED:
            raise MonitoringConfigError(f"{source}: {key}: {REMOVED[name]}")
        if name not in known:
            raise MonitoringConfigError(f"{source}: {key}: unknown setting")
        try:
            values[name] = _coerce(name, getattr(defaults, name), raw)
        except MonitoringConfigError as err:
            raise MonitoringConfigError(f"{source}: {err}") from None
    try:
        return dataclasses.replace(defaults, **values)
    except MonitoringConfigError as err:
        raise MonitoringConfigError(f"{source}: {err}") from None


def load_config(path: str | None) -> MonitoringConfig:
    if not path:
        return MonitoringConfig()
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise MonitoringConfigError(f"{path}: cannot read: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise MonitoringConfigError(f"{path}: not valid YAML{where}") from None
    if data is None:
        return MonitoringConfig()
    if not isinstance(data, Mapping):
        raise MonitoringConfigError(f"{path}: must hold a mapping of settings")
    return config_from_mapping(data, source=path)
