"""read_bounded: a request or answer body read whole, within its limit, byte for byte,
however aiohttp's buffer hands it over."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp.streams import StreamReader

from exporter.usage.tap.proxy import BodyTooLarge, read_bounded


async def fed(chunks: list[bytes]) -> StreamReader:
    """A reader holding ``chunks`` as aiohttp's buffer would, then the body's end; each one
    arrives on its own loop turn, so readany hands them over one by one."""
    reader = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())

    async def feed() -> None:
        for chunk in chunks:
            reader.feed_data(chunk)
            await asyncio.sleep(0)
        reader.feed_eof()

    asyncio.get_running_loop().create_task(feed())
    return reader


async def test_one_chunk_is_returned_as_it_is():
    chunk = b'{"model": "m"}' * 10
    assert await read_bounded(await fed([chunk]), None, 1000) is chunk


@pytest.mark.parametrize("parts", [[b""], [b"a", b"b"], [b"x" * 70_000] * 6, [b"{", b"", b"}"]])
async def test_many_chunks_are_joined_in_order(parts):
    body = await read_bounded(await fed([p for p in parts if p]), None, 10**6)
    assert body == b"".join(parts) and type(body) is bytes


@pytest.mark.parametrize("parts", [[b"x" * 101], [b"x" * 60, b"x" * 41], [b"x" * 50] * 3])
async def test_past_the_limit_is_refused_whether_declared_or_not(parts):
    with pytest.raises(BodyTooLarge):
        await read_bounded(await fed(parts), None, 100)
    with pytest.raises(BodyTooLarge):
        await read_bounded(await fed([]), 101, 100)
    assert await read_bounded(await fed([b"x" * 50, b"x" * 50]), None, 100) == b"x" * 100
