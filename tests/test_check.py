"""`check`: one read of a vLLM's /metrics, the field reports' traps named in plain words."""

from __future__ import annotations

import asyncio
import math
import re
import sys
from pathlib import Path

import pytest

from exporter.check import Report, describe, describe_exporter, read_exporter
from exporter.engine.parse import parse
from exporter.signals import advice
from tests.helpers import fixture_text, value

REAL = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")


def report_for(text: str) -> Report:
    report = Report("http://vllm/metrics")
    describe(parse(text), report)
    return report


def test_healthy_real_vllm_has_no_problem():
    report = report_for(REAL)
    assert report.problems == []
    assert any(
        "prefix caching on, block 32 tokens, KV pool 1,048,576 tokens" in line
        for line in report.lines
    )
    assert any("6,784 of 9,914 looked-up tokens were hits (68.4%)" in line for line in report.lines)


def test_prefix_caching_off_is_a_problem():
    report = report_for(
        REAL.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    )
    assert len(report.problems) == 1
    assert "--enable-prefix-caching" in report.problems[0]


def test_old_names_are_read_and_a_missing_016_metric_is_only_a_note():
    report = report_for(fixture_text("vllm-0.9-oldnames.prom"))
    assert report.problems == []
    assert any("hits (68.4%)" in line for line in report.lines)
    assert any("prompt_tokens_cached" in note and "0.16" in note for note in report.notes)


def test_a_metric_under_no_known_name_is_a_problem_not_a_zero():
    renamed = REAL.replace("vllm:num_preemptions_total", "vllm:num_preemptions_renamed_total")
    report = report_for(renamed)
    assert len(report.problems) == 1
    assert "no preemptions metric under any known name" in report.problems[0]


def test_preemptions_are_noted():
    text = REAL.replace(
        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 12.0',
    )
    report = report_for(text)
    assert report.problems == []
    assert any("preempted 12 time(s) since vLLM started" in note for note in report.notes)


async def run_check(*urls: str) -> tuple[int, str, str]:
    """check on these vLLMs (a URL after a flag is that flag's value)."""
    args: list[str] = []
    for url in urls:
        if url.startswith("--") or (args and args[-1].startswith("--exporter")):
            args.append(url)
        else:
            args += ["--vllm.url", url]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "check",
        "--vllm.timeout",
        "5",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_command_exit_codes(fake_vllm, unused_tcp_port):
    code, out, _ = await run_check(fake_vllm.url)
    assert code == 0, out
    assert out.splitlines()[0] == fake_vllm.url and "  OK" in out.splitlines()
    # What /metrics cannot tell is named, never guessed: both per-request flags, once each.
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert [
        "--enable-prompt-tokens-details" in notes[0],
        "--enable-per-request-metrics" in notes[1],
    ] == [True, True], notes
    assert out.count("--enable-per-request-metrics") == 1

    fake_vllm.body = REAL.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    code, out, _ = await run_check(fake_vllm.url)
    assert code == 1 and "PROBLEM: tiny-llama engine 0: prefix caching is off" in out

    dead = f"http://127.0.0.1:{unused_tcp_port}"
    code, out, _ = await run_check(dead)
    assert code == 1 and "cannot read vLLM's /metrics (connect)" in out

    code, _, err = await run_check("not-a-url")
    assert code == 2 and "--vllm.url" in err


# ---- foresight: the pool, the smallest pool, the budget, the live fit, declared vs used ----

SIM_TARGET = "http://vllm:8000/metrics"


def exporter_after(boots: list[str], events: list[dict], now: float) -> str:
    """A running exporter's /metrics after reading each boot's final scrape in turn and
    ingesting ``events``: what --exporter.url would read."""
    from exporter.config import Config
    from exporter.metrics import build_registry
    from exporter.metrics.exposition import generate_text
    from exporter.usage.event import validate
    from exporter.wiring import signals_state

    state = signals_state(
        Config(vllm_url=(SIM_TARGET,), usage_new_series_hold=0), clock=lambda: now
    )
    for text in boots:
        state.engine.record_success(SIM_TARGET, parse(text), 0.0, now)
    for event in events:
        state.usage.record(validate(event), "http")
    return generate_text(build_registry(state)).decode()


def test_pool_smallest_pool_and_budget_from_one_read():
    """Without an exporter, the smallest pool check can know of is this read's."""
    from exporter.sim import scenario as scenarios
    from exporter.sim.virtual import play_boots

    last = play_boots(scenarios.load("pool-restarts"))[-1]
    report = Report(SIM_TARGET)
    describe(parse(last.metrics_text), report, headroom=4096)
    pool_line = next(line for line in report.lines if "Admission budget" in line)
    assert "KV pool 203,372 tokens, the smallest known (in this one read)" in pool_line
    assert "Admission budget: 199,276 tokens" in pool_line


def test_the_exporter_remembers_the_smallest_pool_across_restarts():
    """pool-restarts: three boots, pools 210,828 then 193,732 then 203,372. The exporter read
    all three; check, reading the third, budgets under the second."""
    from exporter.sim import scenario as scenarios
    from exporter.sim.virtual import play_boots

    runs = play_boots(scenarios.load("pool-restarts"))
    assert [run.simulator.config.kv_pool_tokens for run in runs] == [210_828, 193_732, 203_372]
    text = exporter_after([run.metrics_text for run in runs], [], now=1.0)
    assert value(text, "vllm_cache_engine_kv_pool_tokens") == 203_372
    assert value(text, "vllm_cache_engine_kv_pool_min_tokens") == 193_732
    assert value(text, "vllm_cache_engine_admission_budget_tokens") == 193_732 - 4096
    assert value(text, "vllm_cache_engine_restarts_total", target=SIM_TARGET) == 2
    view = read_exporter(text)
    report = Report(SIM_TARGET)
    describe(parse(runs[-1].metrics_text), report, headroom=4096, view=view)
    pool_line = next(line for line in report.lines if "Admission budget" in line)
    assert (
        "KV pool 203,372 tokens, the smallest seen by the exporter since it started is "
        "193,732, and budgets go by the smallest"
    ) in pool_line
    assert "Admission budget: 189,636 tokens" in pool_line


def test_live_fit_in_words_and_a_pool_that_does_not_hold_them_is_a_problem():
    """Report 000: a ~91k and a ~40k conversation plus their hybrid state in a 160,779 pool
    (the state as the simulator's cache configuration implies it: no flag). agent-b counts
    from its second turn: one request alone is no conversation yet."""
    from exporter.sim import scenario as scenarios
    from exporter.sim.virtual import play

    run = play(scenarios.load("two-agents-collapse"))
    now = 1_700_000_000.0
    b_turns = [i for i, (_, event) in enumerate(run.events) if event["caller"] == "agent-b"]
    b_first, b_second = b_turns[:2]
    events = [{**event, "time": now} for _, event in run.events[: b_second + 1]]
    view = read_exporter(exporter_after([run.metrics_text], events, now))
    report = Report("exporter")
    describe_exporter(view, report, headroom=4096)
    assert report.problems, report.lines
    sentence = report.problems[0]
    assert sentence.startswith(
        f"{SIM_TARGET} (qwen3.8-27b): 2 conversation(s) active (a turn within 10 min) need "
    )
    share = re.search(r"tokens of KV cache: ([0-9.]+)% of the 160,779-token pool", sentence)
    assert share and float(share[1]) > 100, sentence
    assert "They do not all fit" in sentence
    # agent-a alone fits, and says so without a problem; so with agent-b's first turn in
    alone = read_exporter(exporter_after([run.metrics_text], events[: b_first + 1], now))
    report = Report("exporter")
    describe_exporter(alone, report, headroom=4096)
    assert report.problems == []
    assert any(
        "1 conversation(s) active" in line and "cannot be evicted" in line for line in report.lines
    )


def test_declared_vs_used_completions_and_the_advice():
    """max-tokens-overstated: callers declare 65,536 and use 769 and 800 tokens."""
    from exporter.sim import scenario as scenarios
    from exporter.sim.virtual import play

    run = play(scenarios.load("max-tokens-overstated"))
    assert {event["max_tokens"] for _, event in run.events} == {65_536}
    assert {event["completion_tokens"] for _, event in run.events} == {769, 800}
    text = exporter_after([run.metrics_text], [event for _, event in run.events], now=1.0)
    assert value(text, "vllm_cache_completion_declared_tokens_total", caller="coder") == 10 * 65_536
    assert value(text, "vllm_cache_completion_used_tokens_count", caller="coder") == 10
    report = Report("exporter")
    describe_exporter(read_exporter(text), report, headroom=4096)
    coder = next(note for note in report.notes if note.startswith("coder on qwen3.8-27b"))
    used = [event["completion_tokens"] for _, event in run.events if event["caller"] == "coder"]
    mean = sum(used) / len(used)
    # the exact mean (the histogram's sum over its count), not a reading of the buckets
    assert coder.startswith(
        f"coder on qwen3.8-27b: 10 request(s) declared max_tokens 65,536 "
        f"on average and used {mean:,.0f} on average: an overstatement "
        f"of {65_536 / mean:.0f}x."
    ), coder
    # every request used 769 or 800: 99% stayed within the (768, 1024] bucket's bound
    assert "charge prompt + min(max_tokens, 1,024) instead" in coder
    assert any(note.startswith("reviewer on qwen3.8-27b") for note in report.notes)


def completion_events(used: int, declared: int, count: int = 10) -> list[dict]:
    return [
        {
            "caller": "coder",
            "model": "tiny-llama",
            "prompt_tokens": 4000,
            "cached_tokens": 0,
            "completion_tokens": used,
            "max_tokens": declared,
        }
        for _ in range(count)
    ]


@pytest.mark.parametrize(("used", "declared"), [(300, 4096), (300, 300), (8, 8), (5, 8)])
def test_declared_vs_used_never_reports_more_than_was_used_or_declared(used, declared):
    """Every request used exactly ``used`` of ``declared``: check says ``used``, never a
    figure read inside a bucket (384 for 300 in (256, 512], 32 for 8 in (0, 64]), and never
    advises a charge above the declared maximum."""
    text = exporter_after([REAL], completion_events(used, declared), now=1.0)
    report = Report("exporter")
    describe_exporter(read_exporter(text), report, headroom=0)
    sentence = next(
        line for line in report.notes + report.lines if line.startswith("coder on tiny-llama")
    )
    assert (
        f"declared max_tokens {declared:,} on average and used {used:,} on average" in sentence
    ), sentence
    charge = re.search(r"min\(max_tokens, ([\d,]+)\)", sentence)
    if declared / used >= advice.OVERSTATEMENT_WORTH_SAYING:
        assert charge is not None and used <= int(charge[1].replace(",", "")) <= declared
    else:
        assert charge is None and "agree well enough" in sentence


def test_histogram_quantile_is_prometheus_s():
    buckets = [(100.0, 0.0), (200.0, 10.0), (400.0, 20.0), (math.inf, 20.0)]
    assert advice.histogram_quantile(0.5, buckets) == 200.0
    assert advice.histogram_quantile(0.75, buckets) == 300.0
    assert advice.histogram_quantile(0.25, buckets) == 150.0
    assert advice.histogram_quantile(1.0, [(10.0, 0.0), (math.inf, 3.0)]) == 10.0
    assert math.isnan(advice.histogram_quantile(0.5, [(math.inf, 0.0)]))


async def test_command_with_an_exporter(fake_vllm, aiohttp_server):
    """The command line: check reads the vLLM and the running exporter, and says it."""
    from aiohttp import web

    from exporter.sim import scenario as scenarios
    from exporter.sim.virtual import play_boots

    runs = play_boots(scenarios.load("pool-restarts"))
    fake_vllm.body = runs[-1].metrics_text
    exported = exporter_after([run.metrics_text for run in runs], [], now=1.0).replace(
        SIM_TARGET, fake_vllm.url
    )

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=exported, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    exporter = await aiohttp_server(app)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "check",
        "--vllm.url",
        fake_vllm.url,
        "--exporter.url",
        str(exporter.make_url("/")),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    text = out.decode()
    assert process.returncode == 0, text + err.decode()
    assert "smallest seen by the exporter since it started is 193,732" in text
    assert "Admission budget: 189,636 tokens" in text
    assert f"exporter {exporter.make_url('/metrics')}" in text
    assert "no conversations seen yet" in text


def test_residency_metrics_off_is_said_in_words():
    report = report_for(REAL)
    assert report.problems == []
    off = [note for note in report.notes if "KV residency metrics are off" in note]
    assert len(off) == 1 and "start vLLM with --kv-cache-metrics" in off[0]


def test_residency_evicted_before_reuse_is_named():
    report = report_for(fixture_text("vllm-0.33.0-kv-cache-metrics.prom"))
    assert not any("KV residency metrics are off" in note for note in report.notes)
    (line,) = [line for line in report.lines if "KV residency:" in line]
    # The fixture's evictions: 150 sampled blocks, idle 2-30 s, reused about every 45 s.
    assert "150 sampled block(s) evicted since vLLM started" in line
    idle = float(line.split("median idle before eviction ")[1].split(" s")[0])
    gap = float(line.split("median gap between reuses ")[1].split(" s")[0])
    assert 10 < idle < 20 < 40 < gap < 60
    evicted_early = [note for note in report.notes if "sooner than blocks are reused" in note]
    assert len(evicted_early) == 1 and "too small" in evicted_early[0]
    assert report.problems == []


def test_residency_on_without_evictions_yet():
    text = fixture_text("vllm-0.33.0-kv-cache-metrics.prom")
    empty = re.sub(
        r"^(vllm:kv_block_\w+_(?:bucket|count|sum)\{[^}]*\}) \S+$", r"\1 0.0", text, flags=re.M
    )
    report = report_for(empty)
    assert any("KV residency: no sampled block evicted" in line for line in report.lines)
    assert not any("KV residency metrics are off" in note for note in report.notes)


# ---- the messages that name their fix --------------------------------------------------------


async def test_an_openai_base_url_gets_told_to_drop_v1(fake_vllm):
    """The URL users copy from their OpenAI client ends in /v1; vLLM's /metrics is at the
    root. The 404 says which --vllm.url to give instead."""
    root = fake_vllm.url.removesuffix("/metrics")
    for given in (f"{root}/v1", f"{root}/v1/"):
        code, out, _ = await run_check(given)
        assert code == 1, out
        assert "HTTP 404" in out
        assert (
            f"vLLM serves /metrics at its root, not under /v1: use --vllm.url {root} "
            "(without /v1)." in out
        )
    code, out, _ = await run_check(f"{root}/v2")  # another wrong path: no /v1 advice
    assert code == 1 and "HTTP 404" in out and "without /v1" not in out


async def test_the_prompt_tokens_details_hint_only_when_it_is_known_to_be_off(
    fake_vllm, aiohttp_server
):
    """From /metrics alone check cannot tell whether vLLM reports cached tokens per request:
    it says so once, whatever the number of vLLMs. With --exporter.url it can: callers whose
    usage came without cached_tokens are a problem naming them and the flag; when every
    caller's usage has them, nothing is said about the flag at all."""
    from aiohttp import web

    code, out, _ = await run_check(fake_vllm.url, fake_vllm.url)
    assert code == 0, out
    assert out.count("--enable-prompt-tokens-details") == 1
    assert "does not show in /metrics: add --exporter.url" in out

    def event(caller: str, cached: int | None) -> dict:
        return {
            "caller": caller,
            "model": "tiny-llama",
            "prompt_tokens": 4000,
            "cached_tokens": cached,
            "completion_tokens": 10,
        }

    exposition = {"text": ""}

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=exposition["text"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    exporter = await aiohttp_server(app)

    async def check_with_exporter() -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "exporter",
            "check",
            "--vllm.url",
            fake_vllm.url,
            "--exporter.url",
            str(exporter.make_url("/")),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, _err = await asyncio.wait_for(process.communicate(), timeout=60)
        return process.returncode or 0, out.decode()

    exposition["text"] = exporter_after(
        [REAL], [event("coder", 2048), event("writer", None), event("tester", None)], now=1.0
    )
    code, out = await check_with_exporter()
    assert code == 1, out
    assert (
        "PROBLEM: cached_tokens not reported: start vLLM with --enable-prompt-tokens-details"
    ) in out
    assert "requests for tester and writer show as unknown" in out

    exposition["text"] = exporter_after([REAL], [event("coder", 2048)], now=1.0)
    code, out = await check_with_exporter()
    assert code == 0, out
    assert "every caller's usage reports cached_tokens" in out
    assert "--enable-prompt-tokens-details is on" in out
    assert "start vLLM with --enable-prompt-tokens-details" not in out


async def test_the_readme_example_is_what_check_prints(fake_vllm):
    """The README shows check on the recorded vLLM 0.32 scrape: it must be the real output."""
    readme = (Path(__file__).parent.parent / "README.md").read_text("utf-8")
    block = readme.split("$ vllm-cache-exporter check --vllm.url http://127.0.0.1:8000\n", 1)[1]
    shown = block.split("```", 1)[0]
    code, out, _ = await run_check(fake_vllm.url)
    assert code == 0, out
    assert out.replace(fake_vllm.url, "http://127.0.0.1:8000/metrics") == shown


@pytest.mark.parametrize(
    ("name", "granule", "default_too_big"),
    [("granite-2048", 2048, False), ("nemotron-h-384", 384, True)],
)
def test_a_hybrid_engine_is_told_its_granule_and_the_cpu_batching_limit(
    name: str, granule: int, default_too_big: bool
) -> None:
    """Real vLLM 0.32 (CPU) captures of two hybrid models: check names the granule
    (block_size, not the stale mamba_block_size of 16), and the CPU Mamba2 kernel's limit on
    batching, which the 384-token granule's engine only meets when started with
    --max-num-batched-tokens 384: the default, 2,048, ends the engine at a long prompt."""
    report = Report("http://vllm:8000/metrics")
    describe(parse(fixture_text(f"vllm-0.32.0-cpu-hybrid/{name}.prom")), report, 4096)
    (line,) = [line for line in report.lines if "hybrid model" in line]
    assert (
        f"cached in whole {granule:,}-token granules: a warm turn re-reads its last granule" in line
    )
    assert "mamba_block_size label, 16, is stale" in line
    (note,) = [note for note in report.notes if "--max-num-batched-tokens" in note]
    assert f"keep --max-num-batched-tokens at {granule:,} or below" in note
    assert (f"start it with --max-num-batched-tokens {granule}" in note) is default_too_big
    assert not report.problems


def test_a_dense_engine_gets_no_hybrid_advice() -> None:
    report = Report("http://vllm:8000/metrics")
    describe(parse(fixture_text("vllm-0.32.0-cpu/metrics_after.prom")), report, 4096)
    assert not any(
        "hybrid" in line or "max-num-batched" in line for line in report.lines + report.notes
    )


async def test_check_exits_3_while_the_collapse_alert_s_condition_holds(fake_vllm, aiohttp_server):
    """check --exporter.url reads the exporter's status model (GET /api/v1/status): each
    caller's figures over the alerts' windows as the page shows them, and, while the
    VllmCachePrefixCollapse condition holds, a PAGE: line naming it and exit status 3."""
    from exporter.config import Config
    from exporter.server import create_app
    from tests.replay import replay as replay_scenario

    config = Config(vllm_url=(fake_vllm.url,))
    replay = replay_scenario("two-agents-collapse", config=config)
    replay.on_scrape = lambda text: setattr(fake_vllm, "body", text)
    server = await aiohttp_server(create_app(config, state=replay.state, initial_refresh=False))
    exporter = str(server.make_url("/"))

    replay.until(250)  # agent-a alone and warm
    code, text, _ = await run_check(fake_vllm.url, "--exporter.url", exporter)
    assert code == 0, text
    assert "PAGE:" not in text
    page = replay.status(250).callers[0].pairs[0]
    assert page.ratio_window is not None
    assert (
        f"agent-a on {page.model}: hit ratio {advice.percent(page.ratio_window)} over the last "
        "5 min" in text
    ), text

    replay.until(700)  # agent-b arrived; agent-a's ratio fell under half its baseline
    code, text, _ = await run_check(fake_vllm.url, "--exporter.url", exporter)
    assert code == 3, text
    paged = [line for line in text.splitlines() if line.strip().startswith("PAGE:")]
    assert (
        len(paged) == 1 and "VllmCachePrefixCollapse: Prefix cache collapse: agent-a." in (paged[0])
    ), text
    shown = replay.status(700)
    collapse = shown.callers[0].collapse
    assert collapse is not None
    assert f"baseline {advice.percent(collapse.baseline)}" in text, text
