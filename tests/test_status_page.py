"""The status page's model and page: what it says is wrong in each field report's scenario
(and that it says nothing on the healthy ones), since when, in the same words as check; live
counts while Prometheus' view is held back; everything from outside escaped; no fetch
allowed anywhere but the exporter."""

from __future__ import annotations

import pytest

from exporter import page
from exporter.cli import parse as parse_args
from exporter.config import Config, ConfigError, build_config
from exporter.demo.story import Story
from exporter.metrics import build_registry
from exporter.monitoring.config import load_config as load_monitoring_config
from exporter.server import RULE_KEY, collapse_rule, create_app
from exporter.signals import advice, status
from tests.helpers import scrape, value
from tests.replay import BASE, SCRAPE, Replay
from tests.replay import replay as replay_scenario

TARGET = "http://vllm:8000/metrics"


def replayed(name: str) -> Replay:
    return replay_scenario(name, TARGET)


def kinds(page: status.Status) -> list[str]:
    return [item.kind for item in page.problems]


def test_report_000_the_collapse_named_with_both_callers_and_since_when():
    replay = replayed("two-agents-collapse")
    alone = replay.status(230)
    assert kinds(alone) == []
    assert [view.caller for view in alone.callers] == ["agent-a"]
    assert alone.callers[0].ratio_window is not None and alone.callers[0].ratio_window > 0.8
    first = replay.status(300)  # agent-b's first turn alone is no conversation yet
    assert kinds(first) == []
    # agent-b's second turn is in (6:49, after its cold first one): the pair no longer fits,
    # before either hit ratio falls
    arrived = replay.status(415)
    assert kinds(arrived) == ["overflow"]
    assert "They do not all fit" in arrived.problems[0].sentence
    collapsed = replay.status(700)
    assert kinds(collapsed)[:2] == ["collapse", "overflow"]
    collapse = collapsed.problems[0]
    # the alert's condition: agent-a fell from its baseline; agent-b never had one to fall from
    # (no VllmCachePrefixCollapse can fire for it, so the page does not say it either)
    assert collapse.callers == ("agent-a",)
    a_first_cold = next(
        when
        for when, event in replay.events()
        if event["caller"] == "agent-a" and event["cached_tokens"] == 0 and when > 240
    )
    # since: the start of the 30-s slot of agent-a's first evicted turn
    assert collapse.since is not None
    assert 0 <= BASE + a_first_cold - collapse.since < 30
    a, b = (view.collapse for view in collapsed.callers)
    assert a is not None and a.ratio_now == 0.0 and a.baseline > 0.5
    assert collapsed.callers[0].models == (a.model,)
    assert b is None
    assert collapse.sentence == advice.collapse_sentence([a])


def test_without_usage_the_engine_s_own_counters_show_the_collapse():
    """No proxy reports usage: vLLM's prefix-cache counters alone show it (the engine rule of
    VllmCachePrefixCollapse), with the time it started."""
    replay = replayed("two-agents-collapse")
    replay.steps = [step for step in replay.steps if step[1] == SCRAPE]
    assert kinds(replay.status(230)) == []
    page = replay.status(replay.end)
    assert kinds(page) == ["engine_collapse"]
    item = page.problems[0]
    assert item.sentence.startswith(
        f"Prefix cache collapse on vLLM {TARGET}: 0.0% of "
        "looked-up prompt tokens were hits over the last 5 min"
    )
    assert item.since is not None and BASE + 240 <= item.since <= BASE + 600


@pytest.mark.parametrize("name", ["two-agents-fit", "pool-restarts"])
def test_healthy_scenarios_say_nothing_is_wrong(name: str):
    replay = replayed(name)
    for seconds in range(60, int(replay.end) + 60, 60):
        page = replay.status(seconds)
        assert kinds(page) == [], (seconds, [item.sentence for item in page.problems])
    assert all(view.ratio_long and view.ratio_long > 0.5 for view in page.callers)


def test_prefix_caching_off_is_said_and_no_collapse_is_made_of_it():
    page = replayed("prefix-caching-off").status(10_000)
    assert kinds(page) == ["caching_off"]
    sentence = page.problems[0].sentence
    assert sentence == advice.prefix_caching_off_sentence(f"{TARGET} (qwen3.8-27b, engine 0)")
    assert "Start vLLM with --enable-prefix-caching" in sentence


def test_cached_tokens_not_reported_names_the_callers_and_the_flag():
    replay = replayed("details-off")
    page = replay.status(replay.end)
    assert kinds(page) == ["not_reported"]
    item = page.problems[0]
    callers = tuple(view.caller for view in page.callers)
    assert item.callers == callers and item.sentence == advice.not_reported_sentence(callers)
    assert "--enable-prompt-tokens-details" in item.sentence


def test_preemptions_while_they_happen():
    replay = replayed("overload-preempt")
    seen = [replay.status(seconds) for seconds in range(30, int(replay.end) + 30, 30)]
    preempting = [page for page in seen if "preemptions" in kinds(page)]
    assert preempting, "no preemption ever shown"
    assert "vLLM is preempting requests" in preempting[0].problem("preemptions").sentence
    assert "preemptions" not in kinds(replay.status(replay.end + 600))  # over 5 min later


def test_declared_against_used_completions_is_advice():
    replay = replayed("max-tokens-overstated")
    page = replay.status(10_000)
    sentences = [item.sentence for item in page.advice if item.kind == "completions"]
    used = [
        event["completion_tokens"] for _, event in replay.events() if event["caller"] == "coder"
    ]
    coder = next(sentence for sentence in sentences if sentence.startswith("coder on "))
    assert (
        f"used {sum(used) / len(used):,.0f} on average ({max(used):,} at most): an overstatement of"
    ) in coder, coder


def completions_page(used: int, declared: int, count: int = 10) -> status.Status:
    from exporter.usage.event import validate
    from exporter.wiring import signals_state

    now = BASE
    state = signals_state(Config(vllm_url=(TARGET,), usage_new_series_hold=0), clock=lambda: now)
    for _ in range(count):
        state.usage.record(
            validate(
                {
                    "caller": "coder",
                    "model": "m",
                    "prompt_tokens": 4000,
                    "cached_tokens": 0,
                    "completion_tokens": used,
                    "max_tokens": declared,
                }
            ),
            "http",
        )
    return status.build(state.engine, state.usage, now, collapse_rule())


@pytest.mark.parametrize(
    ("used", "declared", "charge"),
    [
        (300, 4096, 512),  # 300 of the (256, 512] bucket: not 384 (its median), nor 509 (p99)
        (1100, 65536, 1280),  # 1,100 of (1024, 1536]: the largest seen bounds the charge
    ],
)
def test_declared_against_used_says_what_was_used(used, declared, charge):
    coder = next(
        item.sentence
        for item in completions_page(used, declared).advice
        if item.kind == "completions"
    )
    assert (
        f"declared max_tokens {declared:,} on average and used {used:,} on average "
        f"({used:,} at most): an overstatement of {declared / used:.0f}x"
    ) in coder, coder
    assert f"charge prompt + min(max_tokens, {charge:,}) instead" in coder


def test_a_small_max_tokens_fully_used_is_no_overstatement():
    """max_tokens 8, each request used all 8: bucket (0, 64] would say a median of 32, 4x
    the declared maximum; the exact mean says they agree, so the page says nothing."""
    assert [item for item in completions_page(8, 8).advice if item.kind == "completions"] == []


def ttft_seen(replay: Replay, seconds: float) -> tuple[status.Status, list[str]]:
    """The page's model at ``seconds`` and what check --exporter.url says of TTFT then."""
    from exporter.check import Report, describe_exporter, read_exporter
    from exporter.metrics import build_registry
    from exporter.metrics.exposition import generate_text
    from exporter.page import render

    page = replay.status(seconds)
    report = Report("exporter")
    describe_exporter(
        read_exporter(generate_text(build_registry(replay.state)).decode()), report, headroom=0
    )
    html = render(page, "test")
    for view in page.callers:  # what the card shows is the model's
        shown = (
            f"{advice.seconds(view.ttft_warm_p50)} / {advice.seconds(view.ttft_cold_p50)}"
            f" (median since start; {advice.ttft_source_label(view.ttft_source)})"
        )
        assert shown.replace("'", "&#x27;") in html, shown
    return page, [line for line in report.lines if "time to first token" in line]


def test_ttft_is_vllm_s_own_when_it_times_the_requests_and_check_says_the_same():
    """two-agents-collapse runs vLLM with --enable-per-request-metrics: every turn carries
    vLLM's own TTFT, so that is what the page shows (it read only the proxy's, and showed
    "- / -"), and check --exporter.url gives the same medians from /metrics' source="engine"
    buckets."""
    replay = replay_scenario(
        "two-agents-collapse", TARGET, Config(vllm_url=(TARGET,), usage_new_series_hold=0)
    )
    assert all("engine_ttft_seconds" in event for _, event in replay.events())
    page, said = ttft_seen(replay, 700)
    views = {view.caller: view for view in page.callers}
    a = views["agent-a"]
    assert a.ttft_source == "engine" and a.ttft_window_source == "engine"
    assert a.ttft_warm_p50 is not None and a.ttft_cold_p50 is not None
    assert a.ttft_warm_p50 < a.ttft_cold_p50  # what a cache is for
    assert a.ttft_window_mean is not None
    assert said == [
        advice.ttft_sentence(view.caller, view.ttft_source, view.ttft_warm_p50, view.ttft_cold_p50)
        for view in page.callers
    ]
    assert all("(vLLM's own)" in line for line in said)


def test_ttft_is_the_proxy_s_when_vllm_does_not_time_the_requests_and_says_so():
    replay = replay_scenario(
        "two-agents-collapse", TARGET, Config(vllm_url=(TARGET,), usage_new_series_hold=0)
    )
    for _when, kind, payload in replay.steps:
        if kind != SCRAPE:
            assert isinstance(payload, dict)
            payload.pop("engine_ttft_seconds", None)
            payload.pop("engine_queue_seconds", None)
    page, said = ttft_seen(replay, 700)
    a = next(view for view in page.callers if view.caller == "agent-a")
    assert a.ttft_source == "proxy" and a.ttft_window_source == "proxy"
    assert a.ttft_warm_p50 is not None and a.ttft_cold_p50 is not None
    assert said == [
        advice.ttft_sentence(view.caller, view.ttft_source, view.ttft_warm_p50, view.ttft_cold_p50)
        for view in page.callers
    ]
    assert all("(the proxy's, vLLM's queue included)" in line for line in said)


# ---- through the server ----------------------------------------------------------------------


@pytest.mark.new_series_hold
async def test_the_page_shows_live_counts_while_prometheus_s_view_is_held(aiohttp_client):
    client = await aiohttp_client(create_app(Config(), initial_refresh=False))
    response = await client.post(
        "/v1/usage",
        json={"caller": "alice", "model": "m", "prompt_tokens": 4096, "cached_tokens": 2048},
    )
    assert response.status == 200, await response.text()
    page = await (await client.get("/")).text()
    assert 'data-caller="alice"' in page and '<dd data-field="prompt-tokens">4,096</dd>' in page
    assert value(await scrape(client), "vllm_cache_prompt_tokens_total", caller="alice") == 0


async def test_the_page_forbids_any_fetch_and_escapes_what_came_from_outside(
    aiohttp_client, fake_vllm
):
    hostile = '<script>alert("x")</script>'
    config = Config(
        vllm_url=(fake_vllm.url,), callers_alias=(("bob", hostile),), callers_name_pattern=".*"
    )
    client = await aiohttp_client(create_app(config, initial_refresh=False))
    fake_vllm.status = 500
    fake_vllm.body = "<b>boom</b>"
    for caller in (hostile, "bob"):
        await client.post(
            "/v1/usage", json={"caller": caller, "model": "<i>m</i>", "prompt_tokens": 10}
        )
    response = await client.get("/")
    page = await response.text()
    assert response.headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert "<script" not in page and "<b>" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "http://" not in page.replace(fake_vllm.url, "")  # no link or source elsewhere
    assert 'data-kind="unreadable"' in page


async def test_an_openai_base_url_on_the_page_names_the_fix(aiohttp_client, fake_vllm):
    root = fake_vllm.url.removesuffix("/metrics")
    client = await aiohttp_client(
        create_app(Config(vllm_url=(f"{root}/v1",)), initial_refresh=False)
    )
    page = await (await client.get("/")).text()
    assert f"use --vllm.url {root} (without /v1)." in page


# ---- the operator's alert thresholds ---------------------------------------------------------


def test_the_page_calls_a_collapse_what_the_operator_s_alerts_call_one(tmp_path):
    """run --monitoring.config-file: the file generate made the alerts from sets the page's
    collapse rule too. A minimum baseline above what agent-a ever reached means its drop is
    no collapse, for the alerts and so for the page."""
    strict = tmp_path / "monitoring.yml"
    strict.write_text("collapse_min_baseline: 0.99\ncollapse_drop_factor: 0.4\n")
    config = build_config(parse_args(["run", "--monitoring.config-file", str(strict)]), {})
    app = create_app(config, initial_refresh=False)
    rule = app[RULE_KEY]
    assert (rule.min_baseline, rule.drop_factor) == (0.99, 0.4)
    assert rule == collapse_rule(load_monitoring_config(str(strict)))

    replay = replayed("two-agents-collapse")
    replay.until(700)
    as_shipped = status.build(
        replay.state.engine, replay.state.usage, replay.clock[0], collapse_rule()
    )
    as_operated = status.build(replay.state.engine, replay.state.usage, replay.clock[0], rule)
    shipped_a = as_shipped.callers[0].collapse
    operated_a = as_operated.callers[0].collapse
    assert shipped_a is not None and shipped_a.baseline < 0.99
    assert operated_a is None


@pytest.mark.parametrize(
    "content, problem",
    [
        ("collapse_drop_factor: lots\n", "collapse_drop_factor"),
        ("no_such_knob: 1\n", "no_such_knob"),
        ("[1, 2\n", "not valid YAML"),
    ],
)
def test_a_bad_monitoring_config_is_a_configuration_error_of_run(tmp_path, content, problem):
    bad = tmp_path / "monitoring.yml"
    bad.write_text(content)
    with pytest.raises(ConfigError) as caught:
        build_config(parse_args(["run", "--monitoring.config-file", str(bad)]), {})
    assert "--monitoring.config-file" in str(caught.value) and problem in str(caught.value)


def _fit_ratios(replay: Replay, seconds: float) -> list[tuple[int, float]]:
    """(conversations, demand / pool) of every fit the page shows, and the same from the
    exporter's /metrics (the series VllmCacheConversationsExceedKVPool reads)."""
    page = replay.status(seconds)
    fits = [(fit.fit.conversations, fit.fit.ratio) for view in page.engines for fit in view.fits]
    registry = build_registry(replay.state)
    for family in registry.collect():
        if family.name != "vllm_cache_engine_conversations_demand_tokens":
            continue
        for sample in family.samples:
            pool = registry.get_sample_value(
                "vllm_cache_engine_kv_pool_tokens", {**sample.labels, "engine": "0"}
            )
            assert pool
            fits.append((-1, sample.value / pool))
    return fits


def test_a_looped_scenario_is_a_vllm_restart_and_never_counts_the_last_loops_conversations():
    """The demo loops its scenario as a vLLM restart (new _created, counters from 0). Played
    three times, two-agents-fit's demand never exceeds the pool at any step, as the page and
    /metrics report it: each restart ends the previous loop's conversations (without it, the
    previous loop's two 91k conversations stay live ten minutes beside the new ones and the
    demand reads up to 2.4x the pool)."""
    replay = replay_scenario("two-agents-fit", TARGET, iterations=3)
    most = 0.0
    for seconds in range(0, int(replay.end) + 16, 5):
        for conversations, share in _fit_ratios(replay, seconds):
            assert share <= 1.0, (seconds, conversations, share)
            most = max(most, share)
    assert most > 0.8, "the fit was measured: two ~91k conversations in a 210k pool"
    assert replay.state.engine.targets[TARGET].restarts == 2
    assert replay.state.usage.conversations.ended_by_restart == 4  # two per restart


def test_a_looped_collapse_still_overflows_in_every_loop():
    """two-agents-collapse looped: every loop still reports its overflow, each after its own
    restart (the previous loop's conversations ended, not carried)."""
    replay = replay_scenario("two-agents-collapse", TARGET, iterations=3)
    overflowing = set()
    for seconds in range(0, int(replay.end) + 16, 15):
        replay.until(seconds)
        loop = replay.state.engine.targets[TARGET].restarts
        if "overflow" in kinds(replay.status(seconds)):
            overflowing.add(loop)
    assert overflowing == {0, 1, 2}


def test_the_demo_story_tells_its_loop_as_a_vllm_restart():
    """The demo's story over two loops of two-agents-collapse, fed the status model at each
    look: the loop is told as a vLLM restart; the previous loop's collapse is not announced
    as cured when it leaves the window (the restart ended it); right after the restart one
    conversation is live (the new loop's), not the previous loop's two; and the new loop's
    overflow and collapse are told again as they happen."""
    replay = replay_scenario("two-agents-collapse", TARGET, iterations=2)
    story = Story(BASE)
    lines = []
    for seconds in range(0, int(replay.end) + 16, 5):
        page = replay.status(seconds)
        lines += story.look(page, replay.state.engine.targets[TARGET].restarts)
    kinds_told = [line.kind for line in lines]
    assert kinds_told.count("restart") == 1
    restart = kinds_told.index("restart")
    assert "collapse" in kinds_told[:restart] and "overflow" in kinds_told[:restart]
    after = lines[restart + 1 :]
    assert not [line for line in after if line.kind == "cleared"], after
    assert "vLLM restarts" in lines[restart].sentence
    fits = [line.sentence for line in after if line.kind in ("fit", "overflow")]
    assert fits[0].startswith(f"{TARGET} (qwen3.8-27b): 1 conversation(s) active"), fits

    def told(part: list) -> list[str]:  # type: ignore[type-arg]
        return [line.kind for line in part if line.kind in ("overflow", "collapse")]

    assert told(after) == told(lines[:restart]) and told(after)[0] == "overflow"


def test_the_demo_page_says_scenario_time_and_a_real_one_utc():
    """The demo's exporter runs on a sped-up clock: its page tells scenario time, never a
    UTC time 15 minutes ahead of the real one; a real deployment's page is unchanged."""
    replay = replayed("two-agents-collapse")
    seen = replay.status(750)
    assert seen.problems and seen.problems[0].since is not None
    demo = page.render(seen, "test", scenario_origin=BASE)
    assert "Status at scenario time 0:12:30," in demo
    assert "since scenario time 0:" in demo
    assert "UTC" not in demo
    real = page.render(seen, "test")
    assert "Status at 22:25:50 UTC," in real  # BASE + 750 s
    assert "scenario time" not in real


def test_past_the_detailed_callers_the_page_says_where_the_others_are():
    """At a platform's size the page keeps the history of the detailed callers (and
    __other__'s) only, and says how many more Prometheus has, as check does."""
    from exporter.signals.callers import OTHER
    from exporter.values import UsageEvent
    from exporter.wiring import signals_state

    now = 1_800_000_000.0
    state = signals_state(Config(callers_detailed=5), clock=lambda: now)
    for index in range(12):
        state.usage.record(UsageEvent(f"agent-{index}", "m", 4096, 2048), "http")
    found = status.build(state.engine, state.usage, now, collapse_rule())
    shown = {view.caller for view in found.callers}
    assert shown == set(state.usage.detailed.members)
    assert found.callers_not_shown == 12 - 5
    assert OTHER not in shown  # no __other__ traffic: every caller is named
    html = page.render(found, "test")
    assert 'id="callers-not-shown">7 more callers' in html
    assert found.as_json()["callers_not_shown"] == 7


def test_prefill_time_saved_and_lost_on_the_page_in_check_and_in_json():
    """Issue 35: each pair's prefill seconds saved and lost to evictions over the long window,
    at its model's measured prefill rate (signals/prefill.py), in the page's model and JSON,
    its card, and check --exporter.url's sentence, which reads that JSON."""
    from exporter.check import Report, _describe_status
    from exporter.signals import prefill

    replay = replay_scenario(
        "two-agents-collapse", TARGET, Config(vllm_url=(TARGET,), usage_new_series_hold=0)
    )
    found = replay.status(900)
    views = {view.caller: view for view in found.callers}
    a = views["agent-a"].pairs[0]
    assert a.prefill_seconds_saved is not None and a.prefill_seconds_saved > 0
    assert a.prefill_seconds_lost is not None and a.prefill_seconds_lost > 60
    data = found.as_json()
    pair = data["callers"][0]["pairs"][0]
    assert pair["prefill_seconds_saved"] == a.prefill_seconds_saved
    assert pair["prefill_seconds_lost"] == a.prefill_seconds_lost
    report = Report("exporter")
    _describe_status(data, report)
    assert (
        f"agent-a: over the last 1 h the cache saved it {prefill.minutes(a.prefill_seconds_saved)}"
        f" of prefill; evictions cost it {prefill.minutes(a.prefill_seconds_lost)}."
    ) in report.lines, report.lines
    html = page.render(found, "test")
    assert (
        f'data-field="prefill">{prefill.minutes(a.prefill_seconds_saved)} / '
        f"{prefill.minutes(a.prefill_seconds_lost)}"
    ) in html


def test_prefill_time_is_none_without_a_measured_prefill_rate():
    """No vLLM read (or none timing its prefill): no rate, so neither figure, never a 0; and
    check says nothing of them."""
    from exporter.check import Report, _describe_status
    from exporter.values import UsageEvent
    from exporter.wiring import signals_state

    now = 1_800_000_000.0
    state = signals_state(Config(), clock=lambda: now)
    state.usage.record(UsageEvent("agent-a", "m", 4096, 2048), "http")
    found = status.build(state.engine, state.usage, now, collapse_rule())
    (pair,) = found.callers[0].pairs
    assert pair.prefill_seconds_saved is None and pair.prefill_seconds_lost is None
    report = Report("exporter")
    _describe_status(found.as_json(), report)
    assert not any("of prefill" in line for line in report.lines)
