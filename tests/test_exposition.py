"""Our encoders write the very bytes of client_python's, in both formats.

``exporter.metrics.exposition.generate_text`` and ``generate_openmetrics`` (what /metrics
serves, through ``generate_async``) are compared byte for byte with client_python's
``prometheus_client.exposition.generate_latest`` (0.0.4 text) and
``prometheus_client.openmetrics.exposition.generate_latest`` (OpenMetrics 1.0.0) over the same
registry: real vLLM scrapes through the fake vLLM (and what the handler served), many callers
with hostile label values, every request state, histograms with and without observations, odd
floats, the general encoder over every metric type (info, stateset, gaugehistogram, units,
exemplars, timestamps, _created), and hypothesis-drawn label and float values and families.
The sliced render equals the one-shot render, and survives the state changing between slices.
"""

from __future__ import annotations

import functools
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
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from exporter.config import Config
from exporter.metrics import build_registry, exposition, generate_text
from exporter.metrics import usage as usage_metrics
from exporter.metrics.exposition import (
    OPENMETRICS,
    TEXT,
    ExporterRegistry,
    choose_format,
    encode_families,
    format_value,
    generate,
    generate_async,
    generate_openmetrics,
)
from exporter.server import REGISTRY_KEY
from exporter.signals.callers import OTHER
from exporter.signals.classify import STATES
from exporter.signals.state import SignalsState
from exporter.signals.usage import QUEUE_BUCKETS, TTFT_BUCKETS, Histogram, Series, TargetCounts
from exporter.values import UsageEvent
from exporter.wiring import signals_state
from tests.helpers import FIXTURES

# What Prometheus 2.x sends (scrape_protocols default): OpenMetrics first.
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,"
    "application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)

ENGINE_FIXTURES = sorted(path.relative_to(FIXTURES).as_posix() for path in FIXTURES.rglob("*.prom"))

# Label values an outside caller (or an operator's model name) can put in front of us.
HOSTILE = [
    'quote"inside',
    "back\\slash",
    "new\nline",
    'all\\"three\n',
    "\\n literal",
    '"',
    "\\",
    "\n",
    "",
    " ",
    "tab\there",
    "carriage\rreturn",
    "ünïcødé",
    "日本語エージェント",
    "emoji 🚀",
    "{braces}",
    "a=b,c=d",
    "le",
    "__other__",
    "key-0123456789ab",
    "zero\x00byte",
    "trailing\\",
    "sk-" + "a" * 40,  # looks like an API key: hashed to key-...
]

# Values floatToGoString has special cases for, and its neighbours.
ODD_FLOATS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-300,
    5e-324,
    -5e-324,
    1e-05,
    1.5e-7,
    999_999.0,
    999_999.9999999999,
    1_000_000.0,
    1_234_567.0,
    1_234_567.891,
    1e15,
    1e16,
    1.7976931348623157e308,
    -1e6,
    -1_234_567.0,
    -1e16,
    -1e300,
    math.inf,
    -math.inf,
    math.nan,
    0.1 + 0.2,
    1 / 3,
    123_456.789,
    2.0**53,
    2.0**53 + 2,
]
ODD_INTS = [
    0,
    1,
    -1,
    999_999,
    1_000_000,
    1_000_001,
    12_345_678,
    2**53 - 1,
    2**53,
    2**53 + 1,
    -(2**53) + 1,
    -(2**53),
    -(2**53) - 1,
    10**15,
    10**16,
    10**20,
    -(10**20),
    2**63,
]


class Clock:
    def __init__(self, now: float = 1_800_000_000.123) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def assert_equal(got: bytes, expected: bytes) -> None:
    if got != expected:  # the first differing line, not two 7 MB blobs
        for ours, theirs in zip(got.splitlines(), expected.splitlines(), strict=False):
            assert ours == theirs
    assert got == expected


def assert_same(registry: CollectorRegistry) -> bytes:
    """Both formats equal client_python's; the text body, for more checks."""
    got = generate_text(registry)
    assert_equal(got, generate_latest(registry))
    assert_equal(generate_openmetrics(registry), openmetrics_latest(registry))
    return got


def record_all_states(state: SignalsState, caller: str, model: str) -> None:
    """Two events of every state at G = 2048, all timed (error is never timed): one timed
    by the proxy, one by vLLM (source="proxy" and source="engine")."""
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
        state.usage.record(
            UsageEvent(
                caller,
                model,
                prompt,
                cached,
                ttft_seconds=0.04 + index * 7.3,
                queue_seconds=0.001 * index if index % 2 else None,
                status=status,
            ),
            "http",
        )
        state.usage.record(
            UsageEvent(
                caller,
                model,
                prompt,
                cached,
                ttft_seconds=9.5,
                status=status,
                engine_ttft_seconds=0.03 + index * 5.1,
                engine_queue_seconds=0.002 * index if index % 3 else None,
            ),
            "http",
        )


# Label values the encoders must escape only reach them when the name policy lets any name
# through (a key is still hashed): these tests are about the encoders, not the policy.
ANY_NAME = {"callers_name_pattern": r"(?s).{1,256}", "callers_model_pattern": r"(?s).{1,256}"}


def hostile_state(callers: int = 300) -> SignalsState:
    clock = Clock()
    state = signals_state(
        Config(
            signals_granularity=2048,
            callers_max=callers - 20,
            callers_detailed=callers - 40,  # most callers have histograms of their own
            callers_max_series=10_000_000,
            usage_file=("/x/*.jsonl",),
            **ANY_NAME,
        ),
        clock=clock,
    )
    usage = state.usage
    assert usage is not None
    models = ["qwen3.8-27b", 'mo"del', "mod\\el\n", "ünï"]
    for index in range(callers):
        caller = HOSTILE[index % len(HOSTILE)] + ("" if index < len(HOSTILE) else f"-{index}")
        record_all_states(state, caller, models[index % len(models)])
    # Callers past the cap land in __other__ (refused, or evicted by one of smaller rank).
    assert (OTHER, "qwen3.8-27b") in usage.series
    assert usage.callers_overflowed > 0 or usage.callers.ranked.evictions > 0
    assert any(caller.startswith("key-") for caller, _ in usage.series)
    # Histograms with no observations, and series with no histogram at all.
    quiet = usage.series.setdefault(("quiet", "qwen3.8-27b"), Series())
    quiet.ttft["warm"] = Histogram(TTFT_BUCKETS)
    quiet.queue = Histogram(QUEUE_BUCKETS)
    quiet.engine_ttft["cold"] = Histogram(TTFT_BUCKETS)
    quiet.engine_queue = Histogram(QUEUE_BUCKETS)
    engine_only = usage.series.setdefault(("engine-only", "qwen3.8-27b"), Series())
    engine_only.engine_ttft["partial"] = Histogram(TTFT_BUCKETS)
    engine_only.engine_queue = Histogram(QUEUE_BUCKETS)
    usage.series.setdefault(("untimed", "qwen3.8-27b"), Series())
    # Odd values in every place a value is printed.
    for index, number in enumerate(ODD_FLOATS):
        series = usage.series.setdefault((f"odd-{index:02d}", "m"), Series())
        hist = series.ttft["cold"] = Histogram(TTFT_BUCKETS)
        hist.observe(abs(number) if number == number else 1.0)
        hist.total = number
        series.queue = Histogram(QUEUE_BUCKETS)
        series.queue.counts[-1] = 2_000_000 + index  # cumulative counts past 1e6
        engine = series.engine_ttft["cold"] = Histogram(TTFT_BUCKETS)
        engine.counts[index % len(engine.counts)] = 1_999_999 + index
        engine.total = number
        series.engine_queue = Histogram(QUEUE_BUCKETS)
        series.engine_queue.total = -number if number == number else number
    for index, number in enumerate(ODD_INTS):
        series = usage.series.setdefault((f"int-{index:02d}", "m"), Series())
        series.prompt_tokens = series.cached_tokens = number
        series.unreported_prompt_tokens = -number
        series.requests["warm"] = number
        counts = series.targets[f"odd-target-{index:02d}"] = TargetCounts(0.0)
        counts.prompt_tokens, counts.cached_tokens = number, -number
    # Per-replica label values: hostile names and URLs (what the encoder must escape; a
    # line break never passes validation, but the encoder must not rely on it), a URL's
    # origin, past the target cap.
    backends = [*HOSTILE[:-1], 'http://q"h:8000/v1', "http://BACK\\slash:1/", "x" * 200]
    for index, backend in enumerate(backends):
        for caller in (HOSTILE[index % len(HOSTILE)], "agent-backends"):
            usage.record(UsageEvent(caller, "qwen3.8-27b", 4096, 2048, backend=backend), "http")
    for reason in HOSTILE:
        usage.reject("http", reason)
        usage.reject_request(reason)
    usage.last_event_time["tap"] = math.nan
    usage.last_event_time['weird\n"reader\\'] = 1e-300
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
    response = await client.get("/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    body = await response.read()
    assert body == openmetrics_latest(registry)  # served in OpenMetrics: client_python's bytes
    assert b"# TYPE vllm_cache_requests counter" in body and body.endswith(b"# EOF\n")


async def test_engine_down_and_failing_targets_render_identically(
    fake_vllm, exporter_for, unused_tcp_port
):
    dead = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    client = await exporter_for(fake_vllm.url, dead)
    await client.get("/metrics")  # one up, one down (connect error, duration, errors)
    fake_vllm.status = 500
    response = await client.get("/metrics")  # both down now, both with errors
    body = await response.read()
    assert b'reason="http_status"' in body and b'reason="connect"' in body
    assert body == generate_latest(client.app[REGISTRY_KEY])


async def test_usage_over_http_renders_identically(fake_vllm, exporter_for):
    client = await exporter_for(fake_vllm.url, signals_granularity=2048, **ANY_NAME)
    lines = [
        f'{{"caller": "{c}", "model": "m", "prompt_tokens": 90000, '
        f'"cached_tokens": 86016, "ttft_seconds": 1.5, "queue_seconds": 0.25}}'
        for c in ("alpha", 'q\\"uote', "back\\\\slash", "日本")
    ]
    await client.post("/v1/usage", data="\n".join(lines) + "\n{bad\n")
    body = await (await client.get("/metrics")).read()
    assert b'caller="q\\"uote"' in body  # JSON q\"uote is q"uote
    assert b'caller="back\\\\slash"' in body  # JSON back\\slash is back\slash
    assert body == generate_latest(client.app[REGISTRY_KEY])
    response = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert await response.read() == openmetrics_latest(client.app[REGISTRY_KEY])


# ---- many callers, hostile values, every state, odd floats -------------------------------


def test_empty_registry_prints_every_header():
    state = signals_state(Config(), clock=Clock())
    text = assert_same(build_registry(state)).decode()
    for name in (
        "vllm_cache_requests_total",
        "vllm_cache_ttft_seconds",
        "vllm_cache_queue_wait_seconds",
        "vllm_cache_granularity_tokens",
    ):
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text


def test_many_hostile_callers_render_identically():
    state = hostile_state()
    text = assert_same(build_registry(state)).decode()
    assert 'caller="new\\nline"' in text and 'caller="quote\\"inside"' in text
    assert 'caller="__other__"' in text and 'caller="key-' in text
    for state_name in STATES:
        assert f'state="{state_name}"}} ' in text
    for source in ("engine", "proxy"):
        assert f'source="{source}",state="warm"}} ' in text
        assert f'source="{source}"}} ' in text  # the queue waits
    assert "NaN\n" in text and "+Inf\n" in text and "-Inf\n" in text
    assert "e+06\n" in text and "e-300\n" in text
    assert 'target="new\\nline"' in text and 'target="quote\\"inside"' in text
    assert 'target="http://q\\"h:8000/metrics"' in text
    assert (
        'vllm_cache_target_cached_tokens_total{caller="agent-backends",model="qwen3.8-27b",target="__other__"}'
        in text
    )


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
    registry = build_registry(state)  # nothing rendered yet: no line reused from before
    assert generate_text(registry) != generate_latest(registry)
    assert generate_openmetrics(registry) != openmetrics_latest(registry)


def test_one_byte_in_an_openmetrics_header_is_caught(monkeypatch):
    """The per-caller families' OpenMetrics HELP/TYPE lines are compared, not assumed."""
    state = hostile_state(40)
    registry = build_registry(state)
    assert_same(registry)
    headers = list(usage_metrics._OPENMETRICS_HEADERS)
    assert "# TYPE vllm_cache_requests counter\n" in headers[0]  # no _total in OpenMetrics
    headers[0] = headers[0].replace("counter", "gauge")
    monkeypatch.setattr(usage_metrics, "_OPENMETRICS_HEADERS", tuple(headers))
    assert generate_text(registry) == generate_latest(registry)  # the text format untouched
    assert generate_openmetrics(registry) != openmetrics_latest(registry)


def test_one_byte_in_the_general_openmetrics_encoder_is_caught(monkeypatch):
    registry = ExporterRegistry()
    registry.register(FamiliesCollector(every_type()))
    assert_same(registry)
    original = exposition.openmetrics_header
    monkeypatch.setattr(
        exposition, "openmetrics_header", lambda *args: original(*args).replace("# TYPE", "# TYPE ")
    )
    assert generate_openmetrics(registry) != openmetrics_latest(registry)


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
    hist = HistogramMetricFamily("h", help_text, buckets=[("0.5", 1), ("+Inf", 2)], sum_value=0.75)
    empty_hist = HistogramMetricFamily("h_empty", "no observations", labels=["caller"])
    ghist = GaugeHistogramMetricFamily(
        "gh", "gauge histogram", buckets=[("1.0", 4), ("+Inf", 5)], gsum_value=7.0
    )
    summary = SummaryMetricFamily("sm", "summary", count_value=3, sum_value=1.25)
    unknown = UnknownMetricFamily("u", "unknown", value=1_234_567.0)
    with_unit = GaugeMetricFamily("room_temperature_celsius", 'a "unit"', unit="celsius")
    with_unit.add_metric([], 21.5, timestamp=1_700_000_000)
    # Exemplars (OpenMetrics prints them, the text format drops them): client_python's job.
    exemplars = HistogramMetricFamily(
        "hx",
        "exemplars",
        buckets=[
            ("1.0", 1, Exemplar({"trace_id": 'a"b\n'}, 0.5, 12.0)),
            ("+Inf", 2, Exemplar({}, 7.0)),
        ],
        sum_value=7.5,
    )
    counted = Metric("cx", "counter with an exemplar", "counter")
    counted.add_sample("cx_total", {"a": "b"}, 2.0, exemplar=Exemplar({"span": "1"}, 1.0))
    nothing = CounterMetricFamily("nothing", "")
    # OpenMetrics-only samples out of order: they print as their own families, sorted.
    mixed = Metric("mx", "om samples", "gaugehistogram")
    for suffix, number in (("_gsum", 2.5), ("_bucket", 1), ("_created", 3.0), ("_gcount", 1)):
        mixed.add_sample("mx" + suffix, {"le": "+Inf"} if suffix == "_bucket" else {}, number)
    families = [
        counter,
        gauge,
        info,
        stateset,
        hist,
        empty_hist,
        ghist,
        summary,
        unknown,
        with_unit,
        exemplars,
        counted,
        nothing,
        mixed,
    ]
    try:  # UTF-8 names: client_python >= 0.22 accepts them, and escapes them per release
        dotted = GaugeMetricFamily("dotted.name", "utf-8 names", labels=["la.bel"])
        dotted.add_metric(["v"], 1.0)
        colon = GaugeMetricFamily("colon:name", "a legacy name client_python 0.23+ rewrites")
        colon.add_metric([], 2.0)
    except ValueError:
        return families
    return [*families, dotted, colon]


# Families of every_type() our encoder hands to client_python, and why.
HANDED_OVER = {"hx": "exemplars", "cx": "exemplar", "dotted.name": "name", "colon:name": "name"}


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
    assert generate_openmetrics(registry) == openmetrics_latest(registry)


@pytest.mark.parametrize("fmt", [TEXT, OPENMETRICS], ids=["text", "openmetrics"])
def test_only_what_we_do_not_write_goes_to_client_python(monkeypatch, fmt):
    """The equality above is not client_python compared with itself: plain families are ours."""
    handed: list[str] = []
    original = exposition.Format.reference_family

    def spy(self, metric):
        handed.append(metric.name)
        return original(self, metric)

    monkeypatch.setattr(exposition.Format, "reference_family", spy)
    families = every_type()
    out: list[str] = []
    encode_families(families, out, fmt)
    assert set(handed) == {family.name for family in families} & set(HANDED_OVER)
    assert "hx" in handed and "cx" in handed


def test_a_misplaced_exemplar_fails_as_in_client_python():
    """An exemplar on a summary is refused by client_python's OpenMetrics encoder: ours too."""
    bad = Metric("s_ex", "summary with an exemplar", "summary")
    bad.add_sample("s_ex_count", {}, 1.0, exemplar=Exemplar({"a": "b"}, 1.0))
    registry = ExporterRegistry()
    registry.register(FamiliesCollector([bad]))
    with pytest.raises(ValueError):
        openmetrics_latest(registry)
    with pytest.raises(ValueError):
        generate_openmetrics(registry)
    assert generate_text(registry) == generate_latest(registry)  # text drops exemplars


# ---- negotiation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        ("", False),
        ("text/plain;version=0.0.4", False),
        ("*/*", False),
        (PROMETHEUS_2_ACCEPT, True),
        ("application/openmetrics-text", True),
        (
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
            "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.5",
            True,
        ),  # Prometheus 3.x
        ("text/plain;version=1.0.0;escaping=underscores", False),
    ],
)
def test_formats_we_write(accept, openmetrics):
    fmt = choose_format(accept)
    assert fmt.openmetrics is openmetrics
    assert fmt.ours
    assert fmt.content_type == choose_encoder(accept)[1]
    registry = build_registry(hostile_state(60))
    assert generate(registry, fmt) == choose_encoder(accept)[0](registry)


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text;version=1.0.0;escaping=dots",
        "text/plain;version=1.0.0;escaping=dots",
        "application/openmetrics-text;version=1.0.0;escaping=values",  # 0.26: U__vllm__cache__...
        "text/plain;version=1.0.0;escaping=values",
        "application/openmetrics-text;version=2.0.0",
    ],
)
async def test_formats_we_do_not_write_are_client_pythons(accept):
    encoder, content_type = choose_encoder(accept)
    fmt = choose_format(accept)
    registry = build_registry(hostile_state(60))
    expected = encoder(registry)
    assert fmt.content_type == content_type
    assert generate(registry, fmt) == expected
    assert await generate_async(registry, fmt) == expected
    if isinstance(encoder, functools.partial):  # client_python >= 0.23 honours these
        assert not fmt.ours


def test_format_value_matches_float_to_go_string():
    for number in [*ODD_FLOATS, *ODD_INTS, True, False]:
        assert format_value(number) == floatToGoString(number), number


# ---- properties --------------------------------------------------------------------------

label_values = st.text(max_size=12)  # any code point but surrogates: quotes, \, \n, unicode
any_float = st.floats(allow_nan=True, allow_infinity=True)
any_number = st.one_of(any_float, st.integers(min_value=-(2**70), max_value=2**70))


@given(any_number)
def test_format_value_property(number):
    assert format_value(number) == floatToGoString(number)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            label_values,
            label_values,
            st.lists(st.sampled_from(STATES), max_size=4),
            any_float,
            st.integers(min_value=0, max_value=2**60),
        ),
        max_size=8,
    ),
    st.lists(st.tuples(label_values, st.integers(min_value=0, max_value=2**40)), max_size=3),
    any_float,
)
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


plain_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,6}", fullmatch=True)
# Legal in client_python's Metric (every release) but not plain: handed to client_python.
legacy_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,6}", fullmatch=True)
timestamps = st.one_of(st.none(), st.floats(min_value=0, max_value=4e9), st.integers(0, 2**40))


@st.composite
def families(draw) -> Metric:
    """A family of a drawn type, name, labels, values and timestamps, as collectors build."""
    kind = draw(
        st.sampled_from(
            [
                "gauge",
                "counter",
                "unknown",
                "histogram",
                "summary",
                "info",
                "stateset",
                "gaugehistogram",
            ]
        )
    )
    name = draw(st.one_of(plain_names, legacy_names))
    documentation = draw(label_values)
    label_names = draw(
        st.lists(plain_names.filter(lambda n: n not in ("le", "quantile")), max_size=3, unique=True)
    )
    rows = draw(
        st.lists(
            st.tuples(
                st.lists(label_values, min_size=len(label_names), max_size=len(label_names)),
                any_float,
                timestamps,
            ),
            max_size=4,
        )
    )
    if kind in ("gauge", "counter", "unknown"):
        family_type = {
            "gauge": GaugeMetricFamily,
            "counter": CounterMetricFamily,
            "unknown": UnknownMetricFamily,
        }[kind]
        family = family_type(name, documentation, labels=label_names)
        for labels, number, stamp in rows:
            if kind == "counter":
                family.add_metric(labels, number, created=stamp, timestamp=stamp)
            else:
                family.add_metric(labels, number, timestamp=stamp)
        return family
    if kind in ("histogram", "gaugehistogram"):
        family = (HistogramMetricFamily if kind == "histogram" else GaugeHistogramMetricFamily)(
            name, documentation, labels=label_names
        )
        for labels, number, stamp in rows:
            buckets = [("1.0", 1), ("+Inf", 2)]
            if kind == "histogram":
                family.add_metric(labels, buckets, number, timestamp=stamp)
            else:
                family.add_metric(labels, buckets, number, timestamp=stamp)
        return family
    if kind == "summary":
        family = SummaryMetricFamily(name, documentation, labels=label_names)
        for labels, number, stamp in rows:
            family.add_metric(labels, 3, number, timestamp=stamp)
        return family
    if kind == "info":
        family = InfoMetricFamily(name, documentation, labels=label_names)
        for labels, _, stamp in rows:
            family.add_metric(labels, {"version": draw(label_values)}, timestamp=stamp)
        return family
    family = StateSetMetricFamily(name, documentation, labels=label_names)
    for labels, number, stamp in rows:
        family.add_metric(labels, {"a": number > 0, "b": number <= 0}, timestamp=stamp)
    return family


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(families(), max_size=5))
def test_general_encoder_property(drawn):
    registry = ExporterRegistry()
    registry.register(FamiliesCollector(drawn))
    assert_same(registry)


def test_module_exports_are_what_the_handler_uses():
    assert exposition.generate_text is generate_text


# ---- the sliced render ------------------------------------------------------------------


class Pauses:
    """A pause between slices that counts them and may change the state meanwhile."""

    def __init__(self, change=None) -> None:
        self.count = 0
        self.change = change

    async def __call__(self) -> None:
        self.count += 1
        if self.change is not None:
            self.change(self.count)


@pytest.mark.parametrize("fmt", [TEXT, OPENMETRICS], ids=["text", "openmetrics"])
async def test_sliced_render_equals_one_shot(monkeypatch, fmt):
    state = hostile_state(120)
    registry = build_registry(state)
    monkeypatch.setattr(usage_metrics, "SERIES_PER_SLICE", 3)
    monkeypatch.setattr(usage_metrics, "SERIES_PER_PIECE", 5)
    pauses = Pauses()
    body = await generate_async(registry, fmt, pauses)
    assert body == generate(registry, fmt)
    assert body == (openmetrics_latest if fmt.openmetrics else generate_latest)(registry)
    assert state.usage is not None
    series = len(state.usage.series)  # a slice per 3 series, a piece per 5 of each family
    assert pauses.count > series // 3 + 4 * (series // 5)


@pytest.mark.parametrize("fmt", [TEXT, OPENMETRICS], ids=["text", "openmetrics"])
async def test_state_changing_between_slices(monkeypatch, fmt):
    """New series and new events between slices: no error, a well-formed body, and what a
    scrape is documented to see (series that existed when it began; later ones next time)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    state = signals_state(Config(signals_granularity=2048, callers_max=500), clock=Clock())
    for index in range(100):
        record_all_states(state, f"{HOSTILE[index % len(HOSTILE)]}-{index}", "qwen3.8-27b")
    usage = state.usage
    assert usage is not None
    registry = build_registry(state)
    monkeypatch.setattr(usage_metrics, "SERIES_PER_SLICE", 2)
    began: set[tuple[str, str]] = set()  # the series when the per-caller render began
    render_slices = usage_metrics.UsageCollector.render_slices

    def spy(collector, out, fmt, series_per_slice=None):
        began.update(collector.usage.series)
        yield from render_slices(collector, out, fmt, series_per_slice)

    monkeypatch.setattr(usage_metrics.UsageCollector, "render_slices", spy)

    def change(count: int) -> None:
        record_all_states(state, f"late-{count}", "qwen3.8-27b")  # a new series
        record_all_states(state, f"{HOSTILE[1]}-1", "qwen3.8-27b")  # more on one that exists

    pauses = Pauses(change)
    body = (await generate_async(registry, fmt, pauses)).decode()
    assert pauses.count > 10 and len(began) >= 100
    parse = parse_om if fmt.openmetrics else parse_text
    rendered = {
        (sample.labels["caller"], sample.labels["model"])
        for family in parse(body)
        for sample in family.samples
        if family.name == "vllm_cache_requests"
    }
    assert rendered == began  # every series that existed, none added during the render
    assert set(usage.series) - began  # (there were some)
    assert_same(registry)  # the next render has them all
