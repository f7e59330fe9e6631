"""Our text encoder writes the very bytes of client_python's ``generate_latest``.

``exporter.metrics.exposition.generate_text`` (what /metrics serves in the 0.0.4 text format)
is compared byte for byte with ``prometheus_client.exposition.generate_latest`` over the same
registry: real vLLM scrapes through the fake vLLM, many callers with hostile label values,
every request state, histograms with and without observations, odd floats, the general
encoder over every metric type, and hypothesis-drawn label and float values.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from exporter.config import Config
from exporter.metrics import build_registry, exposition, generate_text
from exporter.metrics import usage as usage_metrics
from exporter.metrics.exposition import ExporterRegistry, encode_families, format_value
from exporter.server import REGISTRY_KEY
from exporter.signals.callers import OTHER
from exporter.signals.classify import STATES
from exporter.signals.state import SignalsState
from exporter.signals.usage import QUEUE_BUCKETS, TTFT_BUCKETS, Histogram, Series
from exporter.values import UsageEvent
from exporter.wiring import signals_state
from tests.helpers import FIXTURES

ENGINE_FIXTURES = sorted(path.relative_to(FIXTURES).as_posix()
                         for path in FIXTURES.rglob("*.prom"))

# Label values an outside caller (or an operator's model name) can put in front of us.
HOSTILE = [
    'quote"inside', "back\\slash", "new\nline", 'all\\"three\n', "\\n literal", '"', "\\",
    "\n", "", " ", "tab\there", "carriage\rreturn", "ünïcødé", "日本語エージェント", "emoji 🚀",
    "{braces}", "a=b,c=d", "le", "__other__", "key-0123456789ab", "zero\x00byte",
    "trailing\\", "sk-" + "a" * 40,  # looks like an API key: hashed to key-...
]

# Values floatToGoString has special cases for, and its neighbours.
ODD_FLOATS = [
    0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, 5e-324, -5e-324, 1e-05, 1.5e-7, 999_999.0,
    999_999.9999999999, 1_000_000.0, 1_234_567.0, 1_234_567.891, 1e15, 1e16, 1.7976931348623157e308,
    -1e6, -1_234_567.0, -1e16, -1e300, math.inf, -math.inf, math.nan, 0.1 + 0.2, 1 / 3,
    123_456.789, 2.0 ** 53, 2.0 ** 53 + 2,
]
ODD_INTS = [0, 1, -1, 999_999, 1_000_000, 1_000_001, 12_345_678, 2 ** 53 - 1, 2 ** 53,
            2 ** 53 + 1, -(2 ** 53) + 1, -(2 ** 53), -(2 ** 53) - 1, 10 ** 15, 10 ** 16,
            10 ** 20, -10 ** 20, 2 ** 63]


class Clock:
    def __init__(self, now: float = 1_800_000_000.123) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def assert_same(registry: CollectorRegistry) -> bytes:
    expected = generate_latest(registry)
    got = generate_text(registry)
    if got != expected:  # the first differing line, not two 7 MB blobs
        for ours, theirs in zip(got.splitlines(), expected.splitlines(), strict=False):
            assert ours == theirs
    assert got == expected
    return got


def record_all_states(state: SignalsState, caller: str, model: str) -> None:
    """One event of every state at G = 2048, all timed (error is never timed)."""
    assert state.usage is not None
    turns = [
        (91_070, 86_016, None),  # warm
        (60_000, 30_720, None),  # partial
        (40_000, 0, None),  # cold
        (100, 0, None),  # short
        (5_000, None, None),  # unknown
        (5_000, 0, 500),  # error
    ]
    for index, (prompt, cached, status) in enumerate(turns):
        state.usage.record(UsageEvent(caller, model, prompt, cached,
                                      ttft_seconds=0.04 + index * 7.3,
                                      queue_seconds=0.001 * index if index % 2 else None,
                                      status=status), "http")


def hostile_state(callers: int = 300) -> SignalsState:
    clock = Clock()
    state = signals_state(Config(signals_granularity=2048, callers_max=callers - 20,
                                usage_file=("/x/*.jsonl",)), clock=clock)
    usage = state.usage
    assert usage is not None
    models = ["qwen3.8-27b", 'mo"del', "mod\\el\n", "ünï"]
    for index in range(callers):
        caller = HOSTILE[index % len(HOSTILE)] + ("" if index < len(HOSTILE) else f"-{index}")
        record_all_states(state, caller, models[index % len(models)])
    # Callers past the cap land in __other__ and are counted as overflowed.
    assert (OTHER, "qwen3.8-27b") in usage.series
    assert usage.callers_overflowed > 0
    assert any(caller.startswith("key-") for caller, _ in usage.series)
    # Histograms with no observations, and series with no histogram at all.
    quiet = usage.series.setdefault(("quiet", "qwen3.8-27b"), Series())
    quiet.ttft["warm"] = Histogram(TTFT_BUCKETS)
    quiet.queue = Histogram(QUEUE_BUCKETS)
    usage.series.setdefault(("untimed", "qwen3.8-27b"), Series())
    # Odd values in every place a value is printed.
    for index, number in enumerate(ODD_FLOATS):
        series = usage.series.setdefault((f"odd-{index:02d}", "m"), Series())
        hist = series.ttft["cold"] = Histogram(TTFT_BUCKETS)
        hist.observe(abs(number) if number == number else 1.0)
        hist.total = number
        series.queue = Histogram(QUEUE_BUCKETS)
        series.queue.counts[-1] = 2_000_000 + index  # cumulative counts past 1e6
    for index, number in enumerate(ODD_INTS):
        series = usage.series.setdefault((f"int-{index:02d}", "m"), Series())
        series.prompt_tokens = series.cached_tokens = number
        series.unreported_prompt_tokens = -number
        series.requests["warm"] = number
    for reason in HOSTILE:
        usage.reject("http", reason)
        usage.reject_request(reason)
    usage.last_event_time["tap"] = math.nan
    usage.last_event_time["weird\n\"reader\\"] = 1e-300
    return state


# ---- the whole exporter, over real vLLM scrapes ------------------------------------------


@pytest.mark.parametrize("fixture", ENGINE_FIXTURES)
async def test_engine_fixtures_render_identically(fixture, fake_vllm, exporter_for):
    fake_vllm.body = (FIXTURES / fixture).read_text(encoding="utf-8")
    client = await exporter_for(fake_vllm.url, signals_granularity=2048)
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    body = await response.read()
    registry = client.app[REGISTRY_KEY]
    assert isinstance(registry, ExporterRegistry)
    assert body == generate_latest(registry)  # what the handler served is client_python's
    assert b"vllm_cache_engine_up" in body and b"# TYPE vllm_cache_ttft_seconds histogram" in body
    assert_same(registry)


async def test_engine_down_and_failing_targets_render_identically(fake_vllm, exporter_for,
                                                                  unused_tcp_port):
    dead = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    client = await exporter_for(fake_vllm.url, dead)
    await client.get("/metrics")  # one up, one down (connect error, duration, errors)
    fake_vllm.status = 500
    response = await client.get("/metrics")  # both down now, both with errors
    body = await response.read()
    assert b'reason="http_status"' in body and b'reason="connect"' in body
    assert body == generate_latest(client.app[REGISTRY_KEY])


async def test_usage_over_http_renders_identically(fake_vllm, exporter_for):
    client = await exporter_for(fake_vllm.url, signals_granularity=2048)
    lines = [f'{{"caller": "{c}", "model": "m", "prompt_tokens": 90000, '
             f'"cached_tokens": 86016, "ttft_seconds": 1.5, "queue_seconds": 0.25}}'
             for c in ("alpha", 'q\\"uote', "back\\\\slash", "日本")]
    await client.post("/v1/usage", data="\n".join(lines) + "\n{bad\n")
    body = await (await client.get("/metrics")).read()
    assert b'caller="q\\"uote"' in body  # JSON q\"uote is q"uote
    assert b'caller="back\\\\slash"' in body  # JSON back\\slash is back\slash
    assert body == generate_latest(client.app[REGISTRY_KEY])


# ---- many callers, hostile values, every state, odd floats -------------------------------


def test_empty_registry_prints_every_header():
    state = signals_state(Config(), clock=Clock())
    text = assert_same(build_registry(state)).decode()
    for name in ("vllm_cache_requests_total", "vllm_cache_ttft_seconds",
                 "vllm_cache_queue_wait_seconds", "vllm_cache_granularity_tokens"):
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text


def test_many_hostile_callers_render_identically():
    state = hostile_state()
    text = assert_same(build_registry(state)).decode()
    assert 'caller="new\\nline"' in text and 'caller="quote\\"inside"' in text
    assert 'caller="__other__"' in text and 'caller="key-' in text
    for state_name in STATES:
        assert f'state="{state_name}"}} ' in text
    assert "NaN\n" in text and "+Inf\n" in text and "-Inf\n" in text
    assert "e+06\n" in text and "e-300\n" in text


def test_cached_label_text_follows_new_series_and_values():
    state = hostile_state(60)
    registry = build_registry(state)
    first = assert_same(registry)
    assert state.usage is not None
    for index in range(5):
        record_all_states(state, f"late-{index}", "qwen3.8-27b")
        record_all_states(state, HOSTILE[index], "ünï")
    second = assert_same(registry)
    assert first != second
    state.usage.series.clear()  # fewer series than cached texts: the cache starts over
    assert_same(registry)


def test_one_thousand_callers_render_identically():
    state = signals_state(Config(signals_granularity=2048, callers_max=1000), clock=Clock())
    for index in range(1000):
        record_all_states(state, f"agent-{index}", "qwen3.8-27b")
    assert_same(build_registry(state))


def test_divergence_is_caught(monkeypatch):
    """The comparison is not vacuous: a one-character change in the fast path fails it."""
    state = hostile_state(40)
    registry = build_registry(state)
    assert_same(registry)
    monkeypatch.setattr(usage_metrics, "format_value", lambda value: floatToGoString(value) + " ")
    assert generate_text(registry) != generate_latest(registry)


# ---- the general encoder, over every metric type -----------------------------------------


class FamiliesCollector:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def every_type() -> list[Metric]:
    help_text = 'Help with a back\\slash, a "quote" and a\nnewline.'
    counter = CounterMetricFamily("c", help_text, labels=["b", "a"], created=1.5)
    counter.add_metric(["x\n", 'y"'], 3, created=1_700_000_000.25, timestamp=12.5)
    counter.add_metric(["p", "q"], 1e20)
    gauge = GaugeMetricFamily("g", help_text, labels=["zz", "aa", "mm"])
    for number in ODD_FLOATS:
        gauge.add_metric([repr(number), "\\", "ü"], number)
    info = InfoMetricFamily("i", "info", value={"version": '1"0', "build": "b\\"})
    stateset = StateSetMetricFamily("s", "stateset", value={"on": True, "off": False})
    hist = HistogramMetricFamily("h", help_text, buckets=[("0.5", 1), ("+Inf", 2)],
                                 sum_value=0.75)
    empty_hist = HistogramMetricFamily("h_empty", "no observations", labels=["caller"])
    ghist = GaugeHistogramMetricFamily("gh", "gauge histogram",
                                       buckets=[("1.0", 4), ("+Inf", 5)], gsum_value=7.0)
    summary = SummaryMetricFamily("sm", "summary", count_value=3, sum_value=1.25)
    unknown = UnknownMetricFamily("u", "unknown", value=1_234_567.0)
    dotted = GaugeMetricFamily("dotted.name", "utf-8 names", labels=["la.bel"])
    dotted.add_metric(["v"], 1.0)
    nothing = CounterMetricFamily("nothing", "")
    # OpenMetrics-only samples out of order: they print as their own families, sorted.
    mixed = Metric("mx", "om samples", "gaugehistogram")
    for suffix, number in (("_gsum", 2.5), ("_bucket", 1), ("_created", 3.0), ("_gcount", 1)):
        mixed.add_sample("mx" + suffix, {"le": "+Inf"} if suffix == "_bucket" else {}, number)
    return [counter, gauge, info, stateset, hist, empty_hist, ghist, summary, unknown,
            dotted, nothing, mixed]


def test_general_encoder_matches_every_metric_type():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamiliesCollector(every_type()))
    out: list[str] = []
    encode_families(every_type(), out)
    assert "".join(out).encode() == generate_latest(registry)
    ours = ExporterRegistry()
    ours.register(FamiliesCollector(every_type()))
    assert_same(ours)


def test_plain_registry_falls_back_to_client_python():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamiliesCollector(every_type()))
    assert generate_text(registry) == generate_latest(registry)


def test_format_value_matches_float_to_go_string():
    for number in [*ODD_FLOATS, *ODD_INTS, True, False]:
        assert format_value(number) == floatToGoString(number), number


# ---- properties --------------------------------------------------------------------------

label_values = st.text(max_size=12)  # any code point but surrogates: quotes, \, \n, unicode
any_float = st.floats(allow_nan=True, allow_infinity=True)
any_number = st.one_of(any_float, st.integers(min_value=-(2 ** 70), max_value=2 ** 70))


@given(any_number)
def test_format_value_property(number):
    assert format_value(number) == floatToGoString(number)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(label_values, label_values,
                          st.lists(st.sampled_from(STATES), max_size=4),
                          any_float, st.integers(min_value=0, max_value=2 ** 60)),
                max_size=8),
       st.lists(st.tuples(label_values, st.integers(min_value=0, max_value=2 ** 40)),
                max_size=3),
       any_float)
def test_registry_property(series_specs, rejected, now):
    state = signals_state(Config(), clock=Clock(now))
    usage = state.usage
    assert usage is not None
    for caller, model, timed_states, total, tokens in series_specs:
        series = usage.series.setdefault((caller, model), Series())
        series.prompt_tokens = tokens
        series.cached_tokens = tokens // 3
        series.requests[STATES[tokens % len(STATES)]] = tokens
        for state_name in timed_states:
            hist = series.ttft.setdefault(state_name, Histogram(TTFT_BUCKETS))
            hist.observe(abs(total) if math.isfinite(total) else 1.0)
            hist.total = total
        if tokens % 2:
            series.queue = Histogram(QUEUE_BUCKETS)
            series.queue.counts[tokens % len(series.queue.counts)] = tokens
    for reason, count in rejected:
        usage.rejected[("http", reason)] = count
        usage.ingest_requests_rejected[reason] = count
    if series_specs:
        usage.record(UsageEvent(series_specs[0][0], series_specs[0][1], 10), "file")
    registry = build_registry(state)
    assert_same(registry)
    assert_same(registry)  # second render: from the cached label text


def test_module_exports_are_what_the_handler_uses():
    assert exposition.generate_text is generate_text
