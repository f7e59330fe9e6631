"""The status page in a real browser (Debian's chromium, headless) while report 000's
collapse plays: the plain words name who collapsed, the numbers are /metrics' at the same
moment, nothing is fetched from anywhere but the exporter, no console error, and it fits a
phone's width. A screenshot is saved in the test's tmp folder (docs/status-page.png is one).

The scenario is played in virtual time first, then replayed into a real exporter on a frozen
clock, step by step (tests/replay.py: its usage events, and the simulator's /metrics as a
fake vLLM serves them): between two steps nothing moves, so the page and /metrics are read at
the same moment. The exporter keeps its new-series hold: the page shows live counts, and by
the time of each step /metrics shows them too.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.check import read_exporter
from exporter.config import Config
from exporter.server import create_app
from exporter.signals import advice, timing
from exporter.usage.ingest import ROUTE
from tests.browser import chromium
from tests.replay import replay as replay_scenario

pytestmark = [pytest.mark.e2e, pytest.mark.new_series_hold]

# What the page shows, read from the DOM as a user would see it (the visible text).
READ = """(() => {
  const problems = [...document.querySelectorAll('#problems .item.problem')].map(item => ({
    kind: item.dataset.kind, callers: item.dataset.callers, text: item.innerText}));
  const callers = {};
  for (const card of document.querySelectorAll('[data-caller]')) {
    const shown = name => card.querySelector(`[data-field="${name}"]`).innerText;
    const number = name => Number(shown(name).replace(/,/g, ''));
    callers[card.dataset.caller] = {
      warm: number('warm'), partial: number('partial'), cold: number('cold'),
      other: number('other'), prompt: number('prompt-tokens'), cached: number('cached-tokens'),
      ratio: shown('ratio-window'), ttft: shown('ttft'), ttft_window: shown('ttft-window')};
  }
  return {problems, callers, title: document.title,
          nothing_wrong: document.getElementById('no-problem') !== null};
})()"""


def ttft_medians(text: str) -> dict[str, timing.Medians]:
    """Each caller's TTFT medians as check --exporter.url reads them from /metrics."""
    view = read_exporter(text)
    return {
        caller: timing.medians(
            {key: sorted(buckets.items()) for key, buckets in view.ttft[caller].items()}
        )
        for caller in view.ttft
    }


def per_caller(text: str) -> dict[str, dict[str, float]]:
    """/metrics' per-caller counts, summed over models, in the page's terms."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            caller = sample.labels.get("caller")
            if caller is None:
                continue
            row = out.setdefault(
                caller, dict.fromkeys(("warm", "partial", "cold", "other", "prompt", "cached"), 0.0)
            )
            if sample.name == "vllm_cache_requests_total":
                state = sample.labels["state"]
                row[state if state in row else "other"] += sample.value
            elif sample.name == "vllm_cache_prompt_tokens_total":
                row["prompt"] += sample.value
            elif sample.name == "vllm_cache_cached_tokens_total":
                row["cached"] += sample.value
    return out


async def test_the_status_page_in_a_browser_during_a_collapse(
    tmp_path: Path, fake_vllm, aiohttp_server
):
    config = Config(vllm_url=(fake_vllm.url,))
    replay = replay_scenario("two-agents-collapse", config=config)
    replay.on_scrape = lambda text: setattr(fake_vllm, "body", text)
    state = replay.state
    assert state.usage.new_series_hold == 60.0  # Prometheus' view lags; the page's does not
    server = await aiohttp_server(create_app(config, state=state, initial_refresh=False))
    base = str(server.make_url("/"))

    async def metrics() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "metrics") as response:
                return await response.text()

    async with chromium(tmp_path / "profile") as page:
        # agent-a alone, warm turn after warm turn: nothing wrong
        replay.until(250)
        await page.open(base)
        alone = await page.evaluate(READ)
        assert alone["nothing_wrong"] and alone["problems"] == [], alone
        assert "vLLM's own" in alone["callers"]["agent-a"].pop("ttft")
        alone["callers"]["agent-a"].pop("ttft_window")
        assert alone["title"].startswith("OK")
        exported = per_caller(await metrics())
        # the last 5 min reach back before agent-a's first turn: all of its turns so far
        assert (
            alone["callers"]["agent-a"].pop("ratio")
            == f"{exported['agent-a']['cached'] / exported['agent-a']['prompt']:.1%}"
        )
        assert alone["callers"] == exported
        assert exported["agent-a"]["warm"] == 6

        # agent-b has arrived, neither fits beside the other, both read their prompts again
        replay.until(700)
        await page.open(base)
        shown = await page.evaluate(READ)
        exported = per_caller(await metrics())
        kinds = [problem["kind"] for problem in shown["problems"]]
        assert kinds[:2] == ["collapse", "overflow"], shown["problems"]
        collapse = shown["problems"][0]
        # the alert's condition: agent-a fell from its baseline, agent-b never had one
        assert collapse["callers"] == "agent-a"
        assert collapse["text"].startswith("Prefix cache collapse: agent-a. agent-a on ")
        assert "against its baseline of" in collapse["text"]
        assert "since " in collapse["text"] and " ago)" in collapse["text"]
        assert "They do not all fit" in shown["problems"][1]["text"]
        assert shown["title"].startswith("2 problem(s)")
        # vLLM times the requests itself (--enable-per-request-metrics): its own TTFT, the
        # medians check --exporter.url reads from /metrics' source="engine" buckets
        medians = ttft_medians(await metrics())
        for caller, numbers in shown["callers"].items():
            assert numbers.pop("ratio") == "0.0%"  # nothing cached over the last 5 min
            found = medians[caller]
            assert found.source == "engine", caller
            assert numbers.pop("ttft") == (
                f"{advice.seconds(found.warm)} / {advice.seconds(found.cold)} (median since "
                "start; vLLM's own)"
            ), caller
            assert found.cold is not None  # a value, not "- / -"
            window = numbers.pop("ttft_window")
            assert window.endswith("(mean of warm and cold turns; vLLM's own)"), window
            assert not window.startswith("-"), window
            assert numbers == exported[caller], caller
        assert set(shown["callers"]) == {"agent-a", "agent-b"}
        assert exported["agent-b"]["cold"] >= 3 and exported["agent-a"]["cold"] >= 3

        await page.screenshot(tmp_path / "status-page.png", width=1000)
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            width=390,
            height=800,
            deviceScaleFactor=2,
            mobile=True,
        )
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390
        await page.screenshot(tmp_path / "status-page-phone.png", width=390)

    assert (tmp_path / "status-page.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert page.console_errors == []
    assert page.requests, "the browser recorded no request at all"
    outside = [url for url in page.requests if not url.startswith(base)]
    assert outside == [], outside
    assert ROUTE not in " ".join(page.requests)
