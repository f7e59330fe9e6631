"""The demo's live view reads vLLM's KV residency from the exporter's /metrics: sampled
evictions over its window and how idle the evicted blocks were, and says so in words when
blocks are evicted before any turn comes back to them."""

from __future__ import annotations

from exporter.demo.view import DemoView

ROW = 'engine="0",model_name="m",target="http://vllm:8000/metrics"'


def scrape(evicted: int, idle_seconds: float, lifetime_seconds: float) -> str:
    return (
        "\n".join(
            [
                'vllm_cache_engine_up{target="http://vllm:8000/metrics"} 1.0',
                f"vllm_cache_engine_kv_block_idle_before_evict_seconds_count{{{ROW}}} {evicted}",
                f"vllm_cache_engine_kv_block_idle_before_evict_seconds_sum{{{ROW}}} {idle_seconds}",
                f"vllm_cache_engine_kv_block_lifetime_seconds_count{{{ROW}}} {evicted}",
                f"vllm_cache_engine_kv_block_lifetime_seconds_sum{{{ROW}}} {lifetime_seconds}",
            ]
        )
        + "\n"
    )


def test_evicted_before_reuse_is_shown_and_named():
    view = DemoView("t", "http://exporter/metrics", window_seconds=30)
    view.update(scrape(40, 400.0, 4000.0), 0.0)  # healthy: blocks used most of their life
    summary = view.update(scrape(60, 1400.0, 5000.0), 20.0)  # 20 more, idle 1000 of 1000 s
    assert summary.evicted_window == 20
    assert summary.evicted_idle_share_window == 1.0
    assert any("evicted before any turn comes back" in warning for warning in summary.warnings)
    assert "evicted blocks 20 (idle 100.0% of their life)" in view.render_plain(summary)


def test_a_few_evictions_or_blocks_in_use_say_nothing():
    view = DemoView("t", "http://exporter/metrics", window_seconds=30)
    view.update(scrape(40, 400.0, 4000.0), 0.0)
    few = view.update(scrape(45, 650.0, 4250.0), 10.0)  # 5 evicted unused: too few to tell
    assert not any("evicted before" in warning for warning in few.warnings)
    used = view.update(scrape(80, 1000.0, 9000.0), 20.0)  # 40 evicted, idle 600 of 5000 s
    assert used.evicted_window == 40
    assert not any("evicted before" in warning for warning in used.warnings)


def test_without_kv_cache_metrics_nothing_is_shown():
    view = DemoView("t", "http://exporter/metrics")
    summary = view.update('vllm_cache_engine_up{target="x"} 1.0\n', 0.0)
    assert summary.evicted_window is None
    assert "evicted" not in view.render_plain(summary)


def test_the_demo_colours_a_hit_ratio_as_the_dashboards_do() -> None:
    """One set of colour bands: the monitoring config's, read by the dashboards and the demo."""
    from exporter.demo import view
    from exporter.monitoring.config import MonitoringConfig
    from exporter.monitoring.dashboards.panels import hit_ratio_thresholds

    config = MonitoringConfig()
    (_, fair), (_, good) = hit_ratio_thresholds(config)[1:]
    assert (fair, good) == (config.hit_ratio_fair, config.hit_ratio_good)
    colours = {
        value: view._ratio_text(value).style for value in (fair - 0.01, fair, good - 0.01, good)
    }
    assert colours == {fair - 0.01: "red", fair: "yellow", good - 0.01: "yellow", good: "green"}


def test_the_table_s_hit_ratio_and_baseline_are_the_status_page_s():
    """The demo's table says the page's figures (the alerts' windows and baseline), not a
    ratio of its own over its own scrapes: at 700 s of report 000 agent-a's row shows the
    page's 0.0% now against its baseline, and the plain view says both."""
    from prometheus_client import generate_latest

    from exporter.metrics import build_registry
    from exporter.signals import advice
    from tests.replay import replay

    replayed = replay("two-agents-collapse")
    page = replayed.status(700)
    text = generate_latest(build_registry(replayed.state)).decode()
    view = DemoView("demo", "http://page/")
    summary = view.update(text, 700.0, [item.sentence for item in page.problems], page)
    rows = {row.caller: row for row in summary.rows}
    shown = {caller.caller: caller for caller in page.callers}
    assert set(rows) == set(shown) == {"agent-a", "agent-b"}
    for caller, row in rows.items():
        assert row.ratio_window == shown[caller].ratio_window
        assert row.baseline == shown[caller].baseline
    assert rows["agent-a"].baseline is not None and rows["agent-a"].ratio_window == 0.0
    plain = view.render_plain(summary)
    assert f"baseline {advice.percent(rows['agent-a'].baseline)}" in plain
