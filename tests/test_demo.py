"""`vllm-cache-exporter demo` as a user runs it: one process, the status page's URL printed
once, per-caller series on its /metrics, the story told in plain words as it happens, and a
clean exit when --duration is up or on Ctrl-C."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys

import aiohttp

from exporter.demo.story import Story
from tests.helpers import value
from tests.replay import BASE
from tests.replay import replay as replay_scenario

URL = re.compile(r"http://127\.0\.0\.1:\d+/")
STORY = re.compile(r"^\[(\d+):(\d\d)\] (.*)$")


async def start_demo(*flags: str) -> tuple[asyncio.subprocess.Process, str, list[str]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "exporter",
        "demo",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert line, "demo ended before printing its metrics URL: " + "".join(lines)
        lines.append(line)
        match = URL.search(line)
        if match:
            return process, match.group(0) + "metrics", lines


async def wait_for_callers(url: str, callers: set[str], timeout: float = 30.0) -> str:
    """Poll the exporter (there is no event to await from outside the process)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url) as response:
                assert response.status == 200
                text = await response.text()
            seen = {
                caller
                for caller in callers
                if value(text, "vllm_cache_requests_total", caller=caller) is not None
            }
            if seen == callers:
                return text
            assert loop.time() < deadline, f"only {seen} appeared in {timeout:g}s"
            await asyncio.sleep(0.2)


async def test_demo_serves_per_caller_metrics_and_ends_by_itself():
    process, url, _ = await start_demo(
        "--scenario", "two-agents-fit", "--duration", "8", "--speed", "100", "--refresh", "1"
    )
    try:
        text = await wait_for_callers(url, {"agent-a", "agent-b"})
        assert value(text, "vllm_cache_engine_up") == 1
        assert value(text, "vllm_cache_engine_kv_pool_tokens") > 200_000
        out, errors = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, errors.decode()
    output = out.decode()
    assert "agent-a:" in output and "hit ratio" in output  # the plain summaries (no TTY)
    assert "demo stopped" in output


async def test_demo_stops_cleanly_on_ctrl_c():
    process, url, _ = await start_demo(
        "--scenario", "details-off", "--speed", "50", "--refresh", "1"
    )
    try:
        await wait_for_callers(url, {"coder"})
        process.send_signal(signal.SIGINT)
        out, errors = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, errors.decode()
    output = out.decode()
    assert "cached_tokens not reported: start vLLM with --enable-prompt-tokens-details" in output
    assert "Traceback" not in errors.decode()


def test_the_view_shows_the_engines_ttft_where_vllm_measured_it():
    """The two sources are never added up: vLLM's own TTFT where it sent one, else the
    proxy's."""
    from exporter.demo.view import parse_snapshot

    def histogram(caller: str, state: str, source: str, counts: list[int]) -> str:
        labels = f'caller="{caller}",model="m",source="{source}",state="{state}"'
        lines = [
            f'vllm_cache_ttft_seconds_bucket{{{labels},le="{le}"}} {count}'
            for le, count in zip(("1.0", "10.0", "100.0", "+Inf"), counts, strict=True)
        ]
        return "\n".join(
            [
                *lines,
                f"vllm_cache_ttft_seconds_count{{{labels}}} {counts[-1]}",
                f"vllm_cache_ttft_seconds_sum{{{labels}}} 1.0",
            ]
        )

    text = (
        "\n".join(
            [
                "# TYPE vllm_cache_ttft_seconds histogram",
                histogram("both", "warm", "engine", [4, 4, 4, 4]),  # under a second
                histogram("both", "warm", "proxy", [0, 0, 4, 4]),  # the queue in it: ~a minute
                histogram("proxy-only", "warm", "proxy", [0, 0, 4, 4]),
                histogram("engine-idle", "warm", "engine", [0, 0, 0, 0]),
                histogram("engine-idle", "warm", "proxy", [0, 4, 4, 4]),
            ]
        )
        + "\n"
    )
    callers = parse_snapshot(text, 0.0).callers
    assert callers["both"].ttft_p50("warm") == 0.5
    assert callers["proxy-only"].ttft_p50("warm") == 55.0
    assert callers["engine-idle"].ttft_p50("warm") == 5.5


async def test_the_default_demo_tells_the_collapse_as_it_happens():
    """The first run, as the Quick start says: the default scenario is report 000's, and the
    story comes in order with its scenario times: agent-a alone fits, agent-b arrives (at
    4 min: its first turn ends after its cold read), the two no longer fit, the collapse
    names both, and the loop back to the start is announced as a restart."""
    process, url, header = await start_demo("--speed", "100", "--refresh", "30")
    lines: list[str] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while not any("starts again" in line for line in lines):
            assert loop.time() < deadline, "no restart announced:\n" + "".join(lines)
            line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
            assert line, "demo ended early:\n" + "".join(lines)
            lines.append(line)
        process.send_signal(signal.SIGINT)
        out, errors = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, errors.decode()
    assert header[0].startswith("vllm-cache-exporter demo: scenario two-agents-collapse")
    page = url.removesuffix("metrics")
    assert sum(line.count(page) for line in header + lines) == 1, "the URL printed more than once"
    assert f"Status page: {page}" in "".join(header)
    story = [
        (int(match[1]) * 60 + int(match[2]), match[3])
        for match in (STORY.match(line.rstrip("\n")) for line in lines)
        if match
    ]

    def first(*words: str) -> int:
        found = [
            index
            for index, (_, sentence) in enumerate(story)
            if all(word in sentence for word in words)
        ]
        assert found, f"no story line with {words}:\n" + "\n".join(s for _, s in story)
        return found[0]

    fit = first("1 conversation(s) active", "One conversation alone cannot be evicted")
    arrival = first("agent-b arrives")
    demand = first("2 conversation(s) active", "They do not all fit")
    collapse = first("Prefix cache collapse: agent-a.", "against its baseline of")
    restart = first("vLLM restarts", "the scenario starts again")
    assert fit < arrival < demand < collapse < restart
    times = [story[index][0] for index in (fit, arrival, demand, collapse, restart)]
    # Told in order; the collapse's line carries the time it began (the 30-s slot of agent-a's
    # first evicted turn), which can precede the demand's: agent-b counts as a conversation
    # from its second turn (one request alone is none), after agent-a's first eviction.
    assert times[:3] == sorted(times[:3]) and times[3] < times[4] and times[2] < times[4]
    assert 240 <= times[1] <= 360, times  # agent-b starts at 4:00 and its first turn takes ~35 s
    assert times[2] >= times[1] and times[3] > times[1], times
    assert "Traceback" not in errors.decode()


async def test_the_fanout_demo_goes_through_the_tap_and_names_the_varying_top():
    """fanout-order's clients go through the exporter's tap, which sees their prompts: the
    status page says the per-agent part sits at the top of fanout-task-first's, and nothing
    of the kind about fanout-shared-first's."""
    process, url, header = await start_demo(
        "--scenario", "fanout-order", "--speed", "50", "--refresh", "30"
    )
    page_url = url.removesuffix("metrics")
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        said: list[str] = []
        async with aiohttp.ClientSession() as session:
            while not said:  # no event to await from outside the process
                assert loop.time() < deadline, "no prompt-order advice on the status page"
                async with session.get(page_url) as response:
                    page = await response.text()
                said = [line for line in page.splitlines() if "variable sits at the top" in line]
                await asyncio.sleep(0.2)
            async with session.get(url) as response:
                text = await response.text()
        process.send_signal(signal.SIGINT)
        out, errors = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, errors.decode()
    assert "The scenario's clients go through the tap: http://" in "".join(header) + out.decode()
    assert "fanout-task-first on qwen3.8-27b" in said[0]
    assert "fanout-shared-first" not in " ".join(said)
    # ... and the story says it too, once, in the same words
    notes = [line for line in out.decode().splitlines() if "variable sits at the top" in line]
    assert len(notes) == 1 and "] note: fanout-task-first on qwen3.8-27b: " in notes[0], notes
    assert value(text, "vllm_cache_usage_events_total", reader="tap") > 0
    assert (
        value(text, "vllm_cache_prompt_order_variable_top_total", caller="fanout-shared-first") == 0
    )


def test_the_story_tells_the_advice_a_scenario_is_there_to_show_once():
    """max-tokens-overstated: the declared-against-used note is a story line when it first
    appears, in the status page's words, and not again while its figures move."""
    replay = replay_scenario("max-tokens-overstated")
    story = Story(BASE)
    told: list[str] = []
    for seconds in range(60, 3_600, 60):
        told += [
            line.render()
            for line in story.look(replay.status(seconds))
            if line.kind == "completions"
        ]
    page = replay.status(3_600)
    callers = sorted(item.callers[0] for item in page.advice if item.kind == "completions")
    assert callers == ["coder", "reviewer"]
    assert len(told) == 2, told  # one line per caller, however long the scenario runs
    for caller, line in zip(
        callers, sorted(told, key=lambda line: line.split("note: ")[1]), strict=True
    ):
        assert line.split("] ", 1)[1].startswith(f"note: {caller} on qwen3.8-27b: ")
        assert "overstatement" in line


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_the_demo_listens_where_it_is_told():
    """--web.listen-address and --sim.listen-address fix the demo's ports, so a Prometheus can
    be pointed at its exporter (and at the simulated vLLM) before it starts."""
    web_port, sim_port = free_port(), free_port()
    process, url, _header = await start_demo(
        "--scenario",
        "details-off",
        "--speed",
        "50",
        "--refresh",
        "30",
        "--web.listen-address",
        f"127.0.0.1:{web_port}",
        "--sim.listen-address",
        f"127.0.0.1:{sim_port}",
    )
    try:
        assert url == f"http://127.0.0.1:{web_port}/metrics"
        sim_line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert sim_line.startswith(f"Simulated vLLM: http://127.0.0.1:{sim_port} "), sim_line
        text = await wait_for_callers(url, {"coder"})
        assert value(text, "vllm_cache_engine_up") == 1  # the exporter reads that simulator
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{sim_port}/metrics") as response:
                assert response.status == 200
                assert "vllm:prefix_cache_queries_total" in await response.text()
        process.send_signal(signal.SIGINT)
        _out, errors = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, errors.decode()


async def test_a_demo_port_in_use_is_a_clear_error():
    """A fixed port another process holds: one line naming the address, exit 1, no
    traceback (and the simulator it had started is stopped: the process ends)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "exporter",
            "demo",
            "--web.listen-address",
            f"127.0.0.1:{port}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _out, errors = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 1
    message = errors.decode()
    assert message.startswith("demo: cannot start: ") and str(port) in message, message
    assert "Traceback" not in message
