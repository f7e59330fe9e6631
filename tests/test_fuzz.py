"""Generated hostile input against every reader: POST /v1/usage in every format, the file
follower and the tap. Whatever arrives (deep nesting, numbers beyond any float, NaN and
Infinity, invalid UTF-8, wrong types, truncated bodies; bodies chunked anyhow, sent slowly,
in any content coding; HEAD on any path), nothing answers 5xx, nothing raises, and every
event is either counted or counted as rejected, exactly once."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import zlib
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.config import Config
from exporter.server import STATE_KEY, create_app
from exporter.usage import body as request_body
from exporter.usage.event import FIELDS, validate
from exporter.usage.tail import FileFollower
from exporter.wiring import signals_state, tap_app

HOSTILE_NUMBERS = st.sampled_from(
    [2**1024, -(2**1024), 10**400, float("nan"), float("inf"), -0.0, 1e308, 5e-324, -1, 0, 2**63]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    HOSTILE_NUMBERS,
    st.text(max_size=40),
    st.sampled_from(["", "   ", "sk-1234", "\x00", "²", "NaN", "a@b.co"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
NATIVE = st.fixed_dictionaries({}, optional={key: VALUES for key in FIELDS})
LITELLM = st.fixed_dictionaries(
    {},
    optional={
        "end_user": VALUES,
        "model": VALUES,
        "prompt_tokens": VALUES,
        "completion_tokens": VALUES,
        "startTime": VALUES,
        "completionStartTime": VALUES,
        "endTime": VALUES,
        "stream": VALUES,
        "status": VALUES,
        "session_id": VALUES,
        "metadata": st.fixed_dictionaries(
            {}, optional={"usage_object": VALUES, "user_api_key_alias": VALUES}
        ),
        "response": VALUES,
    },
)
USAGE = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": VALUES,
        "completion_tokens": VALUES,
        "input_tokens": VALUES,
        "cache_read_input_tokens": VALUES,
        "prompt_tokens_details": st.one_of(
            VALUES, st.fixed_dictionaries({}, optional={"cached_tokens": VALUES})
        ),
    },
)
OPENAI = st.fixed_dictionaries(
    {"caller": st.one_of(st.just("alice"), VALUES)},
    optional={
        "status": VALUES,
        "ttft_seconds": VALUES,
        "response": st.one_of(
            VALUES,
            st.fixed_dictionaries({"usage": USAGE}, optional={"model": VALUES, "metrics": VALUES}),
        ),
    },
)
DEEP = st.integers(min_value=1, max_value=3000).map(lambda depth: "[" * depth + "]" * depth)


def encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def mangle(line: bytes, how: int) -> bytes:
    """Damage one encoded line: truncate it, put bytes that are not UTF-8 in, or a BOM."""
    if how == 1:
        return line[: len(line) // 2]
    if how == 2:
        return line[:3] + b"\xff\xfe" + line[3:]
    if how == 3:
        return b"\xef\xbb\xbf" + line
    return line


LINES = st.lists(
    st.tuples(
        st.one_of(
            NATIVE.map(encode), LITELLM.map(encode), OPENAI.map(encode), DEEP.map(str.encode)
        ),
        st.integers(min_value=0, max_value=4),
    ),
    min_size=1,
    max_size=12,
).map(lambda items: [mangle(line, how) for line, how in items])
SHAPE = st.sampled_from(["ndjson", "array", "truncated"])


def body_of(lines: list[bytes], shape: str) -> bytes:
    if shape == "array":
        return b"[" + b",".join(lines) + b"]"
    body = b"\n".join(lines)
    return body[: len(body) * 2 // 3] if shape == "truncated" else body


def counts(state) -> tuple[int, int, int]:
    usage = state.usage
    return (
        usage.events.get("http", 0),
        sum(usage.rejected.values()),
        sum(usage.ingest_requests_rejected.values()),
    )


def run(coroutine) -> Any:
    return asyncio.run(coroutine)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(lines=LINES, shape=SHAPE, fmt=st.sampled_from(["native", "litellm", "openai"]))
def test_post_v1_usage_never_fails_and_counts_every_event_once(lines, shape, fmt):
    async def scenario() -> None:
        config = Config()
        state = signals_state(config)
        client = TestClient(TestServer(create_app(config, state, initial_refresh=False)))
        await client.start_server()
        try:
            before = counts(state)
            response = await client.post(f"/v1/usage?format={fmt}", data=body_of(lines, shape))
            reply = await response.json()
            after = counts(client.app[STATE_KEY])
        finally:
            await client.close()
        assert response.status in (200, 400, 422), (response.status, reply)
        accepted, rejected, refused = (b - a for a, b in zip(before, after, strict=True))
        if response.status == 400:
            assert (accepted, rejected, refused) == (0, 0, 1)
            return
        # Copies of an event (its id repeated) count as rejected "duplicate", not in the
        # reply's rejections (they are answered as success).
        assert (reply["accepted"], reply["rejected"] + reply.get("duplicates", 0)) == (
            accepted,
            rejected,
        )
        assert refused == 0

    run(scenario())


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(lines=LINES)
def test_the_file_follower_reads_every_complete_line_once(lines, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "usage.jsonl"
    path.write_bytes(b"")
    events: list[Any] = []
    rejected: list[str] = []
    follower = FileFollower([str(path)], validate, events.extend, rejected.append)
    follower.poll()
    with path.open("ab") as handle:
        for line in lines:
            handle.write(line.replace(b"\n", b" ") + b"\n")
    while follower.poll():
        pass
    follower.close()
    written = [line for line in lines if line.replace(b"\xef\xbb\xbf", b"").strip()]
    assert len(events) + len(rejected) == len(written)


# --- retried events and batches (issue 29) ----------------------------------------------------

TURNS = st.lists(
    st.fixed_dictionaries(
        {
            "caller": st.sampled_from(["a", "b"]),
            "model": st.just("m"),
            "prompt_tokens": st.integers(1, 50_000),
            "cached_tokens": st.sampled_from([0, 1024, None]),
            "session": st.sampled_from(["s1", "s2", None]),
            "id": st.one_of(st.none(), st.sampled_from(["1", "2", "3", "4"])),
        }
    ),
    min_size=1,
    max_size=6,
).map(
    lambda turns: [
        {**turn, "cached_tokens": min(turn["cached_tokens"], turn["prompt_tokens"])}
        if turn["cached_tokens"] is not None
        else turn
        for turn in turns
    ]
)
# Posts: (a batch, its Idempotency-Key or None); a retry sends an earlier post again.
POSTS = st.lists(
    st.tuples(TURNS, st.sampled_from([None, "k1", "k2", "k3"]), st.integers(-1, 5)),
    min_size=1,
    max_size=6,
)


def deduplicated(posts: list[tuple[list[dict[str, Any]], str | None]]) -> list[list[Any]]:
    """What counts of ``posts`` once each retried copy is left out: a post whose key was
    answered before is not read again, and an event whose (caller, id) was counted before
    is not counted again (events without an id always are)."""
    keys: set[str] = set()
    ids: set[tuple[str, str]] = set()
    out = []
    for turns, key in posts:
        if key is not None:
            if key in keys:
                continue
            keys.add(key)
        kept = []
        for turn in turns:
            if turn["id"] is not None:
                if (turn["caller"], turn["id"]) in ids:
                    continue
                ids.add((turn["caller"], turn["id"]))
            kept.append({name: item for name, item in turn.items() if name != "id"})
        out.append(kept)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(posts=POSTS)
def test_retried_events_and_batches_total_what_their_deduplicated_input_does(posts):
    """Batches posted, some of them again (the same events with their ids, or the same body
    with the same Idempotency-Key, as a sender retrying after a lost reply): every total
    and every state is that of the deduplicated input posted once, in order."""
    sent: list[tuple[list[dict[str, Any]], str | None]] = []
    for turns, key, again in posts:
        sent.append((turns, key))
        if 0 <= again < len(sent):  # a retry of an earlier post, as it was sent
            sent.append(sent[again])

    async def totals(batches: list[tuple[list[dict[str, Any]], str | None]]) -> Any:
        config = Config(signals_granularity=32)
        state = signals_state(config)
        client = TestClient(TestServer(create_app(config, state, initial_refresh=False)))
        await client.start_server()
        try:
            for turns, key in batches:
                if not turns:
                    continue
                response = await client.post(
                    "/v1/usage",
                    data=b"\n".join(encode(turn) for turn in turns),
                    headers={"Idempotency-Key": key} if key else {},
                )
                assert response.status == 200, await response.text()
        finally:
            await client.close()
        usage = state.usage
        return (
            usage.caller_totals(),
            usage.events.get("http", 0),
            {key: series.requests for key, series in usage.series.items()},
        )

    retried = run(totals(sent))
    once = run(totals([(turns, None) for turns in deduplicated(sent)]))
    assert retried == once


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    request=st.one_of(LINES.map(lambda lines: lines[0]), OPENAI.map(encode)),
    answer=st.one_of(
        LINES.map(lambda lines: lines[0]), OPENAI.map(lambda record: encode(record.get("response")))
    ),
    streamed=st.booleans(),
    status=st.sampled_from([200, 400, 500]),
)
def test_the_tap_relays_whatever_comes_and_records_each_call_once(
    request, answer, streamed, status
):
    async def upstream_handler(_request: web.Request) -> web.Response:
        await _request.read()
        if streamed:
            return web.Response(
                status=status,
                body=b"data: " + answer + b"\n\ndata: [DONE]\n\n",
                content_type="text/event-stream",
            )
        return web.Response(status=status, body=answer, content_type="application/json")

    async def scenario() -> None:
        upstream_app = web.Application()
        upstream_app.router.add_route("*", "/{tail:.*}", upstream_handler)
        upstream = TestServer(upstream_app)
        await upstream.start_server()
        config = Config(
            tap_listen_address="127.0.0.1:0", tap_upstream=str(upstream.make_url("")).rstrip("/")
        )
        state = signals_state(config)
        tap = TestClient(TestServer(tap_app(config, state.usage)))
        await tap.start_server()
        try:
            response = await tap.post(
                "/v1/chat/completions", data=request, headers={"X-Caller": "alice"}
            )
            relayed = await response.read()
            await asyncio.sleep(0)  # the record is written as the handler ends
            assert response.status == status  # upstream's, never one of the tap's own
            if not streamed:
                assert relayed == answer
            usage = state.usage
            recorded = usage.events.get("tap", 0)
            assert recorded <= 1
            assert recorded == 1 or sum(usage.rejected.values()) >= 1
        finally:
            await tap.close()
            await upstream.close()

    run(scenario())


# --- chunked, slow and encoded bodies; HEAD (issue 29) -------------------------------------

CODINGS = st.sampled_from(
    ["", "identity", "gzip", "deflate", "gzip-but-plain", "br", "gzip, deflate"]
)


def encoded(body: bytes, coding: str) -> tuple[bytes, str]:
    """(the bytes sent, the Content-Encoding header) for a generated coding."""
    if coding == "gzip":
        return gzip.compress(body), "gzip"
    if coding == "deflate":
        return zlib.compress(body), "deflate"
    if coding == "gzip-but-plain":  # the case: a plain body labelled gzip
        return body, "gzip"
    return body, coding


def chunked(data: bytes, cuts: list[int], pause: float):
    """``data`` as a chunked body cut at ``cuts``, ``pause`` seconds between chunks (the
    sender is slow: the pause is the input)."""
    points = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})

    async def chunks():
        for start, end in zip(points, points[1:], strict=False):
            yield data[start:end]
            if pause:
                await asyncio.sleep(pause)

    return chunks()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(
    lines=LINES,
    shape=SHAPE,
    coding=CODINGS,
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
    pause=st.sampled_from([0.0, 0.0, 0.01, 0.06]),
)
def test_chunked_slow_and_encoded_bodies_never_fail_and_count_once(
    lines, shape, coding, cuts, pause, monkeypatch
):
    """Bodies in any chunking, at any pace (the deadline shortened to 0.1 s, so the slowest
    are cut off), in any content coding: never a 5xx; a body refused as a whole is counted
    once as a refusal; one read is counted event by event, as its reply says."""
    monkeypatch.setattr(request_body, "BODY_SECONDS", 0.1)
    data, header = encoded(body_of(lines, shape), coding)

    async def scenario() -> None:
        config = Config()
        state = signals_state(config)
        client = TestClient(TestServer(create_app(config, state, initial_refresh=False)))
        await client.start_server()
        try:
            before = counts(state)
            headers = {"Content-Encoding": header} if header else {}
            response = await client.post(
                "/v1/usage", data=chunked(data, cuts, pause), headers=headers
            )
            reply = await response.json()
            after = counts(state)
        finally:
            await client.close()
        assert response.status in (200, 400, 408, 415, 422), (response.status, reply)
        accepted, rejected, refused = (b - a for a, b in zip(before, after, strict=True))
        if response.status in (400, 408, 415):
            assert (accepted, rejected, refused) == (0, 0, 1)
            expected = {408: "body_too_slow", 415: "unsupported_content_encoding"}
            if response.status in expected:
                assert reply["error"] == expected[response.status]
            return
        assert coding not in ("gzip-but-plain", "br", "gzip, deflate") or not data
        assert (reply["accepted"], reply["rejected"] + reply.get("duplicates", 0)) == (
            accepted,
            rejected,
        )
        assert refused == 0

    run(scenario())


def split_first_answer(wire: bytes) -> tuple[bytes, bytes]:
    head, _, rest = wire.partition(b"\r\n\r\n")
    return head, rest


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.one_of(
        st.sampled_from(
            ["/", "/metrics", "/-/healthy", "/-/ready", "/v1/usage", "/metrics?format=x"]
        ),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/-_.?=&%", max_size=30).map(
            lambda tail: "/" + tail
        ),
    ),
    accept=st.sampled_from(["", "application/openmetrics-text", "*/*", "text/html"]),
    gzip_ok=st.booleans(),
)
def test_head_never_sends_a_body_on_any_path(path, accept, gzip_ok):
    """HEAD on any path, with a GET pipelined behind it: the GET's answer begins right
    after the HEAD's headers, whatever the HEAD's status."""

    async def scenario() -> None:
        app = create_app(Config(), initial_refresh=False)
        server = TestServer(app)
        await server.start_server()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            extra = (f"Accept: {accept}\r\n" if accept else "") + (
                "Accept-Encoding: gzip\r\n" if gzip_ok else ""
            )
            writer.write(
                f"HEAD {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n"
                "GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
            )
            wire = await asyncio.wait_for(reader.read(), 30)
            writer.close()
        finally:
            await server.close()
        head, rest = split_first_answer(wire)
        status = int(head.split(b" ", 2)[1])
        assert status < 500, head
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), (head, rest[:80])
        assert rest.endswith(b"vllm-cache-exporter is healthy.\n")

    run(scenario())


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    request=OPENAI.map(encode),
    coding=CODINGS,
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=5),
)
def test_the_tap_takes_chunked_and_encoded_requests_and_forwards_them_decoded(
    request, coding, cuts
):
    """A request body in any chunking and coding: the tap forwards gzip and deflate decoded,
    other codings as they came, and answers a body that does not decode 400 itself (counted):
    never a 5xx of its own."""
    forwarded: list[tuple[bytes, str | None]] = []

    async def upstream_handler(incoming: web.Request) -> web.Response:
        forwarded.append((await incoming.read(), incoming.headers.get("Content-Encoding")))
        return web.Response(status=400, body=b'{"error": "no"}', content_type="application/json")

    async def scenario() -> None:
        upstream_app = web.Application(handler_args={"auto_decompress": False})
        upstream_app.router.add_route("*", "/{tail:.*}", upstream_handler)
        upstream = TestServer(upstream_app)
        await upstream.start_server()
        config = Config(
            tap_listen_address="127.0.0.1:0", tap_upstream=str(upstream.make_url("")).rstrip("/")
        )
        state = signals_state(config)
        tap = TestClient(TestServer(tap_app(config, state.usage)))
        await tap.start_server()
        data, header = encoded(request, coding)
        try:
            response = await tap.post(
                "/v1/chat/completions",
                data=chunked(data, cuts, 0.0),
                headers={"Content-Encoding": header} if header else {},
            )
            await response.read()
            await asyncio.sleep(0)  # the record is written as the handler ends
        finally:
            await tap.close()
            await upstream.close()
        rejected = state.usage.rejected
        if coding == "gzip-but-plain" and data:
            assert response.status == 400 and forwarded == []
            assert rejected.get(("tap", "bad_content_encoding")) == 1
            return
        assert response.status == 400  # upstream's
        ((body, forwarded_coding),) = forwarded
        if coding in ("gzip", "deflate"):
            assert (body, forwarded_coding) == (request, None)
        else:
            assert body == data and forwarded_coding == (header or None)
        assert ("tap", "bad_content_encoding") not in rejected

    run(scenario())


# --- a lying vLLM, read after read -----------------------------------------------------------

ENGINE_READS = st.lists(
    st.tuples(
        st.sampled_from(["grow", "grow", "restart", "fall", "huge", "duplicate", "older"]),
        st.integers(min_value=0, max_value=1_000_000),
        st.floats(min_value=0.0, max_value=100.0),
    ),
    min_size=1,
    max_size=25,
)
HUGE_VALUES = (1e308, 1.7e308, float(2**60), 2.0**53 + 2.0**40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads=ENGINE_READS, huge=st.sampled_from(HUGE_VALUES))
def test_carried_engine_totals_stay_finite_and_honest_whatever_vllm_says(reads, huge):
    """Real vLLM 0.32 text, its hits counter growing and restarting (new _created times)
    between lies: huge finite values, falls under the same _created, the hits series sent
    twice, an older vLLM answering in its place. Nothing raises; the exported hits are
    finite, never fall, never exceed the first reading plus the plausible increases, and
    after every honest read equal every hit vLLM counted since the first."""
    from exporter.engine.parse import LabelCaps, ParseError, read
    from exporter.signals.engine import EngineState, plausible_increase
    from exporter.values import PREFIX_CACHE_HITS
    from tests.engine.test_failures import _with_counters, restarted
    from tests.helpers import fixture_text

    base = fixture_text("vllm-0.32.0-cpu/metrics_after.prom")
    target = "http://vllm:8000/metrics"
    hits_line = 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} '
    engine, caps = EngineState((target,)), LabelCaps()
    boots, hits, now = 0, 6784.0, 1_000.0
    true_total: float | None = None
    bound = 0.0
    shown: list[float] = []
    boot_bodies: dict[float, str] = {}

    def boot(shift: float) -> str:
        if shift not in boot_bodies:
            boot_bodies[shift] = restarted(base, shift)
        return boot_bodies[shift]

    # The first read is vLLM as it is: no exporter can tell a lie it has nothing to hold
    # against.
    for kind, amount, elapsed in [("grow", 0, 0.0), *reads]:
        now += elapsed
        honest = kind in ("grow", "restart")
        if kind == "grow":
            hits += amount
        elif kind == "restart":
            boots, hits = boots + 1, float(amount)
        body_of_boot = boot(3600.0 * boots)
        if kind == "fall":
            body = _with_counters(body_of_boot, 2 * hits, max(hits - amount - 1, 0))
        elif kind == "huge":
            body = _with_counters(body_of_boot, huge, huge)
        elif kind == "older":
            body = _with_counters(boot(3600.0 * boots - 1800.0), 2 * hits + 1, hits + 1)
        else:
            body = _with_counters(body_of_boot, 2 * hits, hits)
        if kind == "duplicate":
            line = next(line for line in body.splitlines() if line.startswith(hits_line))
            body = body.replace(line, f"{line}\n{line}")
        if honest and true_total is not None:
            true_total += amount
        bound += plausible_increase(elapsed)
        try:
            parsed = read(body, caps)
        except ParseError:
            engine.record_failure(target, "parse", "duplicate", 0.01)
            continue
        engine.record_success(
            target, parsed.snapshot, 0.01, now, invalid=parsed.invalid, folded=parsed.folded
        )
        rows = engine.targets[target].rows
        total = rows[0].counters.get(PREFIX_CACHE_HITS) if rows else None
        if total is None:
            continue
        if true_total is None:
            true_total = first = total
        assert math.isfinite(total) and total <= first + bound
        if honest:
            assert total == true_total
        shown.append(total)
    assert shown == sorted(shown)
