"""A vLLM that lies: absurd but finite values, counters that fall without restarting, a series
sent twice, and more label values than any vLLM has. The carried totals stay finite and
honest, each lie is counted with its reason, and what the exporter serves stays bounded.
Built on the real vLLM 0.32 scrape of tests/fixtures."""

from __future__ import annotations

import math
import re

from exporter import values
from exporter.engine import parse as engine_parse
from exporter.engine.parse import (
    MAX_ENGINES,
    MAX_LABEL_VALUE_CHARS,
    MAX_MODEL_NAMES,
    MAX_ROWS,
    OVERFLOW_VALUE,
    LabelCaps,
    read,
)
from exporter.signals import engine as carrier
from exporter.signals.engine import MAX_INCREASE_PER_SECOND, EngineState
from exporter.values import PREFIX_CACHE_QUERIES
from tests.engine.test_failures import _with_counters, restarted, without_created
from tests.helpers import fixture_text, scrape, value

BASE = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
ROW = {"model_name": "tiny-llama", "engine": "0"}
HITS = "vllm_cache_engine_prefix_cache_hits_tokens_total"
QUERIES = "vllm_cache_engine_prefix_cache_queries_tokens_total"
TARGET = "http://vllm:8000/metrics"
LABELS = '{engine="0",model_name="tiny-llama"}'


def invalid(text: str, target: str, reason: str) -> float | None:
    return value(text, "vllm_cache_engine_invalid_samples_total", target=target, reason=reason)


def test_the_carrier_counts_every_reason_the_parser_gives():
    """The reasons the counter starts at 0 with are the parser's (exporter/values.py, which
    the parser and the carrier share) and the carrier's own."""
    assert set(values.PARSE_INVALID_REASONS) <= set(carrier.INVALID_REASONS)
    assert len(set(carrier.INVALID_REASONS)) == len(carrier.INVALID_REASONS)
    assert carrier.FOLD_REASONS == values.FOLD_REASONS


# --- fail 7: finite but absurd readings ------------------------------------------------------


async def test_absurd_finite_readings_leave_the_totals_finite_and_as_they_were(
    fake_vllm, exporter_for
):
    """1e308, then 1.7e308 after a fall: before, the carried totals went to +Inf for good."""
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    fake_vllm.body = BASE
    await scrape(client)
    fake_vllm.body = _with_counters(BASE, 1e308, 1e308)
    await scrape(client)
    fake_vllm.body = _with_counters(BASE, 0, 0)
    await scrape(client)
    fake_vllm.body = _with_counters(BASE, 1.7e308, 1.7e308)
    lied = await scrape(client)
    # Dropped like a NaN: absent for those reads, never +Inf.
    assert value(lied, HITS, **row) is None and value(lied, QUERIES, **row) is None
    assert invalid(lied, fake_vllm.url, "too_large") == 4
    assert all(
        math.isfinite(float(line.rsplit(" ", 1)[1]))
        for line in lied.splitlines()
        if line.startswith("vllm_cache_engine_")
    )
    fake_vllm.body = _with_counters(BASE, 10_000, 6800)  # vLLM's own next reading
    honest = await scrape(client)
    assert value(honest, HITS, **row) == 6800 and value(honest, QUERIES, **row) == 10_000
    assert value(honest, "vllm_cache_engine_restarts_total", target=fake_vllm.url) == 0


def test_a_sample_above_2_to_the_53_is_dropped_and_one_at_it_is_kept():
    at = read(_with_counters(BASE, float(2**53), 1.0))
    past = read(_with_counters(BASE, float(2**53) * 2, 1.0))
    assert at.snapshot.engines[("tiny-llama", "0")].values[PREFIX_CACHE_QUERIES] == 2**53
    assert PREFIX_CACHE_QUERIES not in past.snapshot.engines[("tiny-llama", "0")].values
    assert past.invalid == {"too_large": 1} and at.invalid == {}


def test_an_increase_past_the_per_second_bound_is_ignored_until_time_explains_it():
    state = EngineState((TARGET,))

    def carried(queries: float, now: float) -> float:
        parsed = read(_with_counters(BASE, queries, 1.0))
        state.record_success(TARGET, parsed.snapshot, 0.01, now, invalid=parsed.invalid)
        row = state.targets[TARGET].rows[0]
        return row.counters[PREFIX_CACHE_QUERIES]

    assert carried(1_000, now=100.0) == 1_000
    jump = 1_000 + 20 * MAX_INCREASE_PER_SECOND
    assert carried(jump, now=110.0) == 1_000  # 20 s worth of increase in 10 s: not believed
    assert state.targets[TARGET].invalid["implausible_increase"] == 1
    assert carried(jump, now=125.0) == jump  # 25 s since the last believed reading: it is
    assert state.targets[TARGET].restarts == 0


# --- falls that are not restarts -------------------------------------------------------------


async def test_a_fall_under_the_same_created_time_is_a_glitch_not_a_restart(
    fake_vllm, exporter_for
):
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    fake_vllm.body = BASE
    await scrape(client)
    fake_vllm.body = _with_counters(BASE, 100, 50)  # _created times unchanged
    glitch = await scrape(client)
    assert value(glitch, HITS, **row) == 6784 and value(glitch, QUERIES, **row) == 9914
    assert value(glitch, "vllm_cache_engine_restarts_total", target=fake_vllm.url) == 0
    assert invalid(glitch, fake_vllm.url, "fell_without_restart") == 2
    fake_vllm.body = _with_counters(BASE, 10_014, 6884)
    later = await scrape(client)
    assert value(later, HITS, **row) == 6884 and value(later, QUERIES, **row) == 10_014


async def test_two_replicas_answering_in_turn_are_not_counted_three_times(fake_vllm, exporter_for):
    """Behind one URL, an older and a newer vLLM answer in turn: the newer _created is one
    restart, each return of the older is a glitch, and the total follows the newer one."""
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    older, newer = BASE, restarted(BASE)
    reads = [
        (older, 9914, 6784),
        (newer, 2000, 1000),
        (older, 9924, 6790),
        (newer, 2100, 1100),
        (older, 9934, 6800),
        (newer, 2200, 1200),
    ]
    for body, queries, hits in reads:
        fake_vllm.body = _with_counters(body, queries, hits)
        text = await scrape(client)
    assert value(text, HITS, **row) == 6784 + 1200
    assert value(text, "vllm_cache_engine_restarts_total", target=fake_vllm.url) == 1
    assert invalid(text, fake_vllm.url, "created_went_back") > 0


async def test_one_family_falling_while_another_rises_is_a_glitch(fake_vllm, exporter_for):
    """Without _created times only the drop can tell: one family alone is no restart."""
    base = without_created(BASE)
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    fake_vllm.body = base
    await scrape(client)
    fake_vllm.body = _with_counters(base, 10_000, 10)  # hits fall, queries rise
    text = await scrape(client)
    assert value(text, HITS, **row) == 6784 and value(text, QUERIES, **row) == 10_000
    assert value(text, "vllm_cache_engine_restarts_total", target=fake_vllm.url) == 0
    assert invalid(text, fake_vllm.url, "fell_without_restart") == 1


# --- a series sent twice ---------------------------------------------------------------------


async def test_a_series_sent_twice_fails_the_read_and_costs_no_false_restart(
    fake_vllm, exporter_for
):
    """As Prometheus does ("duplicate sample for timestamp"), the whole read is refused: no
    hits above queries, and the next honest read is no restart."""
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    fake_vllm.body = BASE
    await scrape(client)
    hits_line = f"vllm:prefix_cache_hits_total{LABELS} 6784.0"
    fake_vllm.body = BASE.replace(hits_line, f"{hits_line}\n{hits_line}")
    twice = await scrape(client)
    assert value(twice, "vllm_cache_engine_up", target=fake_vllm.url) == 0
    assert (
        value(twice, "vllm_cache_engine_scrape_errors_total", target=fake_vllm.url, reason="parse")
        == 1
    )
    # The same labels in another order are the same series.
    reordered = 'vllm:prefix_cache_hits_total{model_name="tiny-llama",engine="0"} 1.0'
    fake_vllm.body = BASE.replace(hits_line, f"{hits_line}\n{reordered}")
    await scrape(client)
    fake_vllm.body = _with_counters(BASE, 10_000, 6800)
    honest = await scrape(client)
    assert value(honest, HITS, **row) == 6800
    assert value(honest, "vllm_cache_engine_restarts_total", target=fake_vllm.url) == 0
    assert (
        value(honest, "vllm_cache_engine_scrape_errors_total", target=fake_vllm.url, reason="parse")
        == 2
    )


def test_the_duplicate_is_named_in_the_error():
    hits_line = f"vllm:prefix_cache_hits_total{LABELS} 6784.0"
    try:
        read(BASE.replace(hits_line, f"{hits_line}\n{hits_line}"))
    except engine_parse.ParseError as err:
        assert "duplicate sample for timestamp: vllm:prefix_cache_hits_total" in str(err)
        assert err.line_number == BASE.splitlines().index(hits_line) + 2
    else:
        raise AssertionError("a duplicate series was accepted")


# --- label values past the caps --------------------------------------------------------------


def counter_lines(model_name: str, engine: str, queries: float = 10.0) -> str:
    labels = f'{{engine="{engine}",model_name="{model_name}"}}'
    return (
        f"vllm:prefix_cache_queries_total{labels} {queries}\n"
        f"vllm:prefix_cache_hits_total{labels} {queries / 2}\n"
    )


def test_model_names_past_the_cap_are_summed_into_other():
    caps = LabelCaps()
    body = BASE + "".join(counter_lines(f"m-{index}", "0") for index in range(2_000))
    parsed = read(body, caps)
    models = {key[0] for key in parsed.snapshot.engines}
    assert len(models) == MAX_MODEL_NAMES + 1 and OVERFLOW_VALUE in models
    other = parsed.snapshot.engines[(OVERFLOW_VALUE, "0")].values
    kept = sum(1 for model in models if model.startswith("m-"))
    assert other[PREFIX_CACHE_QUERIES] == 10.0 * (2_000 - kept)  # nothing lost, only folded
    assert parsed.folded == {"model_name_cap": 2 * (2_000 - kept)}
    # The next read shows the same model names: what was admitted stays admitted.
    again = read(body, caps)
    assert set(again.snapshot.engines) == set(parsed.snapshot.engines)


def test_engines_and_rows_past_their_caps_are_folded():
    parsed = read(
        BASE + "".join(counter_lines("tiny-llama", str(index)) for index in range(1, 10_001))
    )
    rows = parsed.snapshot.engines
    assert len(rows) == MAX_ROWS + 1
    assert len({engine for _model, engine in rows}) <= MAX_ENGINES + 1
    assert (
        sum(values.values[PREFIX_CACHE_QUERIES] for values in rows.values()) == 9914 + 10.0 * 10_000
    )
    # Engine "0" comes with every family of the fixture; each other engine with two samples.
    assert parsed.folded == {"engine_cap": 2 * (10_000 + 1 - MAX_ENGINES)}


def test_cache_config_rows_past_the_engine_cap_are_dropped_and_counted():
    config = next(line for line in BASE.splitlines() if line.startswith("vllm:cache_config_info"))
    extra = "\n".join(
        config.replace('engine="0"', f'engine="{index}"') for index in range(1, 5_000)
    )
    parsed = read(BASE + extra + "\n")
    assert len(parsed.snapshot.cache_configs) == MAX_ENGINES
    assert parsed.folded == {"engine_cap": 5_000 - MAX_ENGINES}
    # Of a row with thousands of labels, the allow-listed ones and others up to the cap.
    wide = config.replace(
        'engine="0"', 'engine="0",' + ",".join(f'extra_{index}="1"' for index in range(5_000))
    )
    fields = read(BASE.replace(config, wide)).snapshot.cache_configs["0"].fields
    assert len(fields) == engine_parse.MAX_CONFIG_LABELS
    assert set(engine_parse.CACHE_CONFIG_KEYS) <= set(fields)


def test_a_label_value_of_a_megabyte_is_never_copied_into_a_series():
    huge = "x" * 1_000_000
    body = BASE.replace('model_name="tiny-llama"', f'model_name="{huge}"')
    body = body.replace('cache_dtype="auto"', f'cache_dtype="{"y" * 1_000_000}"')
    parsed = read(body)
    assert set(parsed.snapshot.engines) == {(OVERFLOW_VALUE, "0")}
    assert parsed.snapshot.cache_configs["0"].fields["cache_dtype"] == OVERFLOW_VALUE
    assert parsed.folded["too_long"] > 0
    at_limit = read(
        BASE.replace('model_name="tiny-llama"', f'model_name="{"z" * MAX_LABEL_VALUE_CHARS}"')
    )
    assert {model for model, _ in at_limit.snapshot.engines} == {"z" * MAX_LABEL_VALUE_CHARS}


async def test_folds_are_counted_per_target_and_served(fake_vllm, exporter_for):
    fake_vllm.body = BASE + "".join(counter_lines(f"m-{index}", "0") for index in range(100))
    client = await exporter_for(fake_vllm.url)
    text = await scrape(client)
    folded = value(
        text,
        "vllm_cache_engine_samples_folded_total",
        target=fake_vllm.url,
        reason="model_name_cap",
    )
    assert folded == 2 * (100 + 1 - MAX_MODEL_NAMES)
    served = {match for match in re.findall(r'model_name="([^"]*)"', text)}
    assert len(served) == MAX_MODEL_NAMES + 1
    assert all(
        math.isfinite(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("vllm_cache_engine_")
    )
