"""Every way a vLLM target can fail: a clear, counted error, up=0, no engine series for it,
and nothing else lost (other targets, the process, the counters when it comes back)."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.helpers import fixture_text, scrape, value

ROW = {"model_name": "tiny-llama", "engine": "0"}


def engine_series(text: str, target: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line.startswith("vllm_cache_engine_")
        and f'target="{target}"' in line
        and not line.startswith(
            (
                "vllm_cache_engine_up",
                "vllm_cache_engine_scrape_",
                "vllm_cache_engine_restarts",
                "vllm_cache_engine_invalid",
                "vllm_cache_engine_samples_folded",
            )
        )
    ]


async def assert_down(client, target: str, reason: str) -> str:
    text = await scrape(client)
    assert value(text, "vllm_cache_engine_up", target=target) == 0
    assert value(text, "vllm_cache_engine_scrape_errors_total", target=target, reason=reason) == 1
    assert value(text, "vllm_cache_engine_scrape_duration_seconds", target=target) is not None
    assert engine_series(text, target) == []
    return text


async def test_connection_refused(exporter_for, unused_tcp_port):
    target = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    client = await exporter_for(target)
    await assert_down(client, target, "connect")


async def test_http_500(fake_vllm, exporter_for):
    fake_vllm.status = 500
    client = await exporter_for(fake_vllm.url)
    await assert_down(client, fake_vllm.url, "http_status")


async def test_slower_than_timeout(fake_vllm, exporter_for):
    fake_vllm.hang = True
    client = await exporter_for(fake_vllm.url, vllm_timeout=0.2)
    text = await assert_down(client, fake_vllm.url, "timeout")
    assert value(text, "vllm_cache_engine_scrape_duration_seconds", target=fake_vllm.url) < 5


async def test_prometheus_scrape_timeout_bounds_the_read(fake_vllm, exporter_for):
    """A 10 s own timeout must not outlast a 0.5 s Prometheus scrape timeout."""
    fake_vllm.hang = True
    client = await exporter_for(fake_vllm.url, vllm_timeout=10.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    text = await scrape(client, headers={"X-Prometheus-Scrape-Timeout-Seconds": "0.5"})
    assert loop.time() - started < 2.0
    assert (
        value(text, "vllm_cache_engine_scrape_errors_total", target=fake_vllm.url, reason="timeout")
        == 1
    )


async def test_truncated_body(exporter_for):
    """The connection closes before Content-Length bytes arrive."""
    body = fixture_text("vllm-0.32.0-cpu/metrics_after.prom").encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = f"http://127.0.0.1:{port}/metrics"
    try:
        client = await exporter_for(target)
        await assert_down(client, target, "truncated")
    finally:
        server.close()
        await server.wait_closed()


async def test_body_over_cap(fake_vllm, exporter_for):
    client = await exporter_for(fake_vllm.url, vllm_max_body_bytes=10_000)
    await assert_down(client, fake_vllm.url, "body_too_large")


async def test_garbage_text(fake_vllm, exporter_for):
    fake_vllm.body = "<html><body>502 Bad Gateway</body></html>\n"
    client = await exporter_for(fake_vllm.url)
    await assert_down(client, fake_vllm.url, "parse")


async def test_body_cut_mid_line_is_rejected_whole(fake_vllm, exporter_for):
    text = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
    cut = text.index('vllm:prefix_cache_hits_total{engine="0",mod') + 40
    fake_vllm.body = text[:cut]
    client = await exporter_for(fake_vllm.url)
    await assert_down(client, fake_vllm.url, "parse")


async def test_lying_values_are_dropped_not_exported(fake_vllm, exporter_for):
    text = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
    fake_vllm.body = text.replace(
        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} -5',
    ).replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} NaN',
    )
    client = await exporter_for(fake_vllm.url)
    out = await scrape(client)
    row = {"target": fake_vllm.url, **ROW}
    assert value(out, "vllm_cache_engine_up", target=fake_vllm.url) == 1
    assert (
        value(
            out, "vllm_cache_engine_invalid_samples_total", target=fake_vllm.url, reason="negative"
        )
        == 1
    )
    assert (
        value(
            out,
            "vllm_cache_engine_invalid_samples_total",
            target=fake_vllm.url,
            reason="not_finite",
        )
        == 1
    )
    assert value(out, "vllm_cache_engine_preemptions_total", **row) is None
    assert value(out, "vllm_cache_engine_kv_usage_ratio", **row) is None
    assert value(out, "vllm_cache_engine_prefix_cache_hits_tokens_total", **row) == 6784


async def test_one_bad_target_costs_the_others_nothing(fake_vllm, exporter_for, unused_tcp_port):
    dead = f"http://127.0.0.1:{unused_tcp_port}/metrics"
    client = await exporter_for(fake_vllm.url, dead)
    text = await scrape(client)
    assert value(text, "vllm_cache_engine_up", target=dead) == 0
    assert value(text, "vllm_cache_engine_up", target=fake_vllm.url) == 1
    assert (
        value(text, "vllm_cache_engine_prefix_cache_hits_tokens_total", target=fake_vllm.url, **ROW)
        == 6784
    )


def _with_counters(text: str, queries: float, hits: float, created: str | None = None) -> str:
    labels = '{engine="0",model_name="tiny-llama"}'
    text = text.replace(
        f"vllm:prefix_cache_queries_total{labels} 9914.0",
        f"vllm:prefix_cache_queries_total{labels} {queries}",
    )
    text = text.replace(
        f"vllm:prefix_cache_hits_total{labels} 6784.0",
        f"vllm:prefix_cache_hits_total{labels} {hits}",
    )
    if created is not None:
        text = text.replace("1.7959921637417994e+09", created)
    return text


def restarted(text: str, seconds: float = 3600.0) -> str:
    """The exposition of a vLLM started ``seconds`` later: every _created time moved."""
    return re.sub(
        r"^(\S+_created(?:\{[^}]*\})?) (\S+)$",
        lambda m: f"{m.group(1)} {float(m.group(2)) + seconds!r}",
        text,
        flags=re.M,
    )


def without_created(text: str) -> str:
    """As a vLLM run with PROMETHEUS_DISABLE_CREATED_SERIES (or an old one) exposes it."""
    return "\n".join(line for line in text.splitlines() if "_created" not in line) + "\n"


@pytest.mark.parametrize("created", ["new", "absent"])
async def test_vllm_restart_never_goes_backwards_or_spikes(fake_vllm, exporter_for, created):
    """A restart told by its new _created times, or without them by every counter that
    moved falling at once."""
    base = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
    if created == "absent":
        base = without_created(base)
    after = restarted(base) if created == "new" else base
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    name = "vllm_cache_engine_prefix_cache_hits_tokens_total"

    fake_vllm.body = _with_counters(base, 9914, 6784)
    first = value(await scrape(client), name, **row)
    # vLLM restarts: its counters start again from 0, then grow to 100.
    fake_vllm.body = _with_counters(after, 0, 0)
    after_reset = value(await scrape(client), name, **row)
    fake_vllm.body = _with_counters(after, 200, 100)
    later = await scrape(client)

    assert first == 6784
    assert after_reset == 6784  # not 0 (a drop) and not 6784 + 6784 (a spike)
    assert value(later, name, **row) == 6884  # only what happened since the restart
    assert value(later, "vllm_cache_engine_restarts_total", target=fake_vllm.url) == 1


async def test_restart_detected_by_created_time_even_when_counter_grew(fake_vllm, exporter_for):
    """A vLLM that restarted and already served more than before between two scrapes."""
    base = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    name = "vllm_cache_engine_prefix_cache_hits_tokens_total"
    fake_vllm.body = _with_counters(base, 9914, 6784)
    await scrape(client)
    fake_vllm.body = _with_counters(base, 20000, 7000, created="1.7959999999e+09")
    text = await scrape(client)
    # All 7000 hits are new: the old 6784 are kept, not subtracted.
    assert value(text, name, **row) == 6784 + 7000


async def test_target_that_comes_back(fake_vllm, exporter_for):
    client = await exporter_for(fake_vllm.url)
    row = {"target": fake_vllm.url, **ROW}
    assert value(await scrape(client), "vllm_cache_engine_up", target=fake_vllm.url) == 1
    fake_vllm.status = 503
    down = await scrape(client)
    assert value(down, "vllm_cache_engine_up", target=fake_vllm.url) == 0
    assert value(down, "vllm_cache_engine_prefix_cache_hits_tokens_total", **row) is None
    fake_vllm.status = 200
    back = await scrape(client)
    assert value(back, "vllm_cache_engine_up", target=fake_vllm.url) == 1
    assert value(back, "vllm_cache_engine_prefix_cache_hits_tokens_total", **row) == 6784
    assert (
        value(
            back,
            "vllm_cache_engine_scrape_errors_total",
            target=fake_vllm.url,
            reason="http_status",
        )
        == 1
    )


async def test_concurrent_scrapes_share_one_read(fake_vllm, exporter_for):
    client = await exporter_for(fake_vllm.url)
    fake_vllm.hang = True
    pending = [asyncio.ensure_future(scrape(client)) for _ in range(5)]
    while fake_vllm.requests == 0:
        await asyncio.sleep(0)
    fake_vllm.release.set()
    results = await asyncio.gather(*pending)
    assert fake_vllm.requests == 1
    assert all(value(text, "vllm_cache_engine_up", target=fake_vllm.url) == 1 for text in results)
