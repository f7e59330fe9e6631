"""``POST /v1/usage`` bodies that arrive too slowly or in a content coding: each is sent, and
the test checks the status, that it is counted with its reason, that good bodies sent
beside it are counted exactly, and that the bytes it held are given back."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import tracemalloc
import zlib

import pytest

from exporter.usage import body as request_body
from exporter.usage import ingest
from exporter.usage.body import BadEncoding, BodyTooLarge, decoder_for
from tests.usage.conftest import refused

GOOD = {"caller": "alice", "model": "m", "prompt_tokens": 4096, "cached_tokens": 2048}
LINE = json.dumps(GOOD).encode() + b"\n"


def accepted(state) -> int:
    return state.usage.events.get("http", 0)


def budget_of(client) -> ingest.BodyBytes:
    handler = next(route.handler for route in client.app.router.routes() if route.method == "POST")
    return handler.__self__.body_bytes


# --- slow bodies ---------------------------------------------------------------------------


async def test_a_trickled_body_is_cut_off_and_never_locks_the_others_out(
    usage_client, monkeypatch, caplog
):
    """Four senders trickling bodies (the issue's case) hold only the bytes they sent: with
    max-concurrent-bodies 4, real senders are served all along; each trickler gets 408 once
    its body has taken longer than the deadline, counted, and its bytes are given back."""
    monkeypatch.setattr(request_body, "BODY_SECONDS", 0.5)
    client, state = await usage_client(usage_ingest_max_concurrent_bodies=4)
    never = asyncio.Event()

    async def trickle():
        yield LINE[:1]
        await never.wait()
        yield LINE[1:]  # pragma: no cover - never reached

    tricklers = [asyncio.ensure_future(client.post("/v1/usage", data=trickle())) for _ in range(4)]
    budget = budget_of(client)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while budget.used < 4 and loop.time() < deadline:
        await asyncio.sleep(0.01)  # the trickled bytes reaching the handlers have no event
    assert budget.used == 4
    for _ in range(5):  # while they trickle, every real sender is served at once
        response = await client.post("/v1/usage", data=LINE * 3)
        assert response.status == 200 and (await response.json())["accepted"] == 3
    answers = await asyncio.wait_for(asyncio.gather(*tricklers), 10)
    assert [answer.status for answer in answers] == [408] * 4
    assert {(await answer.json())["error"] for answer in answers} == {"body_too_slow"}
    assert refused(state) == {"body_too_slow": 4}
    assert accepted(state) == 15
    assert budget.used == 0
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


async def test_a_body_received_whole_is_not_timed(usage_client, monkeypatch):
    """The deadline is for bodies still arriving: one already whole is read at once, however
    long its processing takes (here: no time at all for the body to arrive)."""
    monkeypatch.setattr(request_body, "BODY_SECONDS", 0.0)
    client, state = await usage_client()
    response = await client.post("/v1/usage", data=LINE * 3)
    assert response.status == 200
    assert accepted(state) == 3 and refused(state) == {}


# --- content codings -----------------------------------------------------------------------


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    "coding, encode",
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("GZIP", gzip.compress),
        ("deflate", zlib.compress),  # RFC 9110: zlib-wrapped
        ("deflate", raw_deflate),  # what many senders mean by it
        ("gzip", lambda data: gzip.compress(data[:40]) + gzip.compress(data[40:])),  # 2 members
        ("identity", lambda data: data),
    ],
)
async def test_a_body_in_a_content_coding_is_decoded(usage_client, coding, encode):
    client, state = await usage_client()
    response = await client.post(
        "/v1/usage", data=encode(LINE * 5), headers={"Content-Encoding": coding}
    )
    assert response.status == 200, await response.text()
    assert (await response.json())["accepted"] == 5
    assert accepted(state) == 5 and refused(state) == {}


@pytest.mark.parametrize(
    "coding, sent",
    [
        ("gzip", LINE * 3),  # the case: a plain body labelled gzip
        ("deflate", b"\xff" * 40),
        ("gzip", gzip.compress(LINE * 3)[:-12]),  # cut short
        ("gzip", gzip.compress(LINE * 3) + b"trailing junk"),
    ],
)
async def test_a_body_that_does_not_decode_is_a_counted_400(usage_client, coding, sent):
    client, state = await usage_client()
    response = await client.post("/v1/usage", data=sent, headers={"Content-Encoding": coding})
    assert response.status == 400
    assert (await response.json())["error"] == "bad_content_encoding"
    assert refused(state) == {"bad_content_encoding": 1}
    assert accepted(state) == 0
    good = await client.post(
        "/v1/usage", data=gzip.compress(LINE * 2), headers={"Content-Encoding": "gzip"}
    )
    assert good.status == 200 and accepted(state) == 2


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, gzip", "gzip, br"])
async def test_a_content_coding_not_supported_is_a_counted_415(usage_client, coding):
    client, state = await usage_client()
    response = await client.post("/v1/usage", data=LINE, headers={"Content-Encoding": coding})
    assert response.status == 415
    assert response.headers["Accept-Encoding"] == "gzip, deflate"
    assert (await response.json())["error"] == "unsupported_content_encoding"
    assert refused(state) == {"unsupported_content_encoding": 1}
    assert accepted(state) == 0


async def test_a_decompression_bomb_stops_at_the_body_limit(usage_client):
    """256 MiB of zeros in 256 KiB of gzip: refused once decoding passes the body limit,
    having decoded little more than the limit (aiohttp 3.11 inflated a whole network read at
    once: tens of MB from one read of this body)."""
    limit = 1024 * 1024
    client, state = await usage_client(usage_ingest_max_body_bytes=limit)
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\0" * (1024 * 1024)
    bomb = b"".join(compressor.compress(block) for _ in range(256)) + compressor.flush()
    assert len(bomb) < limit / 2
    tracemalloc.start()
    try:
        response = await client.post("/v1/usage", data=bomb, headers={"Content-Encoding": "gzip"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert response.status == 413
    assert (await response.json())["error"] == "body_too_large"
    assert refused(state) == {"body_too_large": 1}
    assert peak < 4 * limit, f"{peak / limit:.1f} MiB held while decoding"
    assert budget_of(client).used == 0


def test_the_decoder_never_yields_more_than_the_room_it_is_given():
    decoder = decoder_for("gzip")
    assert decoder is not None
    data = gzip.compress(b"x" * 100_000)
    with pytest.raises(BodyTooLarge):
        decoder.feed(data, 99_999)
    whole = decoder_for("gzip")
    assert whole is not None
    assert b"".join(whole.feed(data, 100_000) + whole.finish(0)) == b"x" * 100_000
    empty = decoder_for("deflate")
    assert empty is not None and empty.finish(10) == []  # an empty body is no error
    cut = decoder_for("gzip")
    assert cut is not None
    cut.feed(data[:20], 100_000)
    with pytest.raises(BadEncoding):
        cut.finish(100_000)


# --- the body budget -----------------------------------------------------------------------


async def test_room_is_handed_out_first_come_first_served():
    budget = ingest.BodyBytes(10)
    assert await budget.take(8, 1)
    first = asyncio.ensure_future(budget.take(5, 10))
    second = asyncio.ensure_future(budget.take(2, 10))  # would fit now, but waits its turn
    await asyncio.sleep(0)
    assert not first.done() and not second.done() and budget.full
    budget.give_back(8)
    assert await first and await second and budget.used == 7


async def test_a_request_that_gives_up_waiting_lets_the_next_one_in():
    budget = ingest.BodyBytes(10)
    assert await budget.take(6, 1)
    assert not await budget.take(6, 0.01)  # timed out
    assert await budget.take(4, 0.01)  # fits beside the first: nobody is waiting any more
    cancelled = asyncio.ensure_future(budget.take(5, 10))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    budget.give_back(10)
    assert budget.used == 0 and not budget.full
    assert not await budget.take(11, 0.01)  # more than the whole budget: never
