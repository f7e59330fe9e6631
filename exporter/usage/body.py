"""A request body read whole, bounded in bytes, in time and in what its content coding
expands to: the one reading of ``POST /v1/usage`` bodies and of the tap's requests.

- **Time.** The body must arrive whole within ``BODY_SECONDS`` of the handler starting to
  read it (30 s, the bound every other part of a request has: the idle and header timers).
  A sender trickling it (a byte every few seconds keeps no idle timer away) gets
  ``BodyTooSlow``: its handler answers 408 and closes the connection. A whole 16 MiB body in
  30 s is 4.5 Mbit/s, far below what a proxy next to the exporter sends. One timer per body,
  and none for a body already received whole when the handler starts (most of them).
- **Bytes.** At most ``limit`` bytes after decoding (``BodyTooLarge``), and the declared
  ``Content-Length`` checked before anything is read.
- **Content coding.** The apps turn aiohttp's own request decoding off (``HANDLER_ARGS``):
  it raised from inside the parser (500 and a traceback for a plain body labelled gzip, 400
  with no count for br or zstd without their modules), and older aiohttp inflated a whole
  network read at once. Here ``gzip``/``x-gzip`` (members concatenated too) and ``deflate``
  (zlib-wrapped or raw, as senders do both) are decoded in steps that never produce more
  than the bytes left under ``limit``, so a decompression bomb costs at most ``limit`` plus
  one step. ``identity`` or no header: the bytes as they are. Anything else (``br``,
  ``zstd``, a list of codings) is ``UnsupportedEncoding`` (415); a body that does not decode
  is ``BadEncoding`` (400).

``reserve`` (the ingest's share of body memory) is awaited with the size of each decoded
piece before it is kept; it may wait, or raise to refuse the body.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable

import aiohttp

BODY_SECONDS = 30.0
# Output of one decoding step at most (and one read's worth of compressed input).
DECODE_STEP_BYTES = 256 * 1024
# Passed as web.Application(handler_args=...): bodies reach the handler as sent.
HANDLER_ARGS = {"auto_decompress": False}
SUPPORTED_ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")


class BodyRefused(Exception):
    """A body the handler refuses as a whole: ``reason`` is counted, ``status`` answered."""

    status = 400
    reason = ""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BodyTooLarge(BodyRefused):
    status = 413
    reason = "body_too_large"


class BodyTooSlow(BodyRefused, asyncio.TimeoutError):
    """Set on the request's stream at the deadline. A timeout too: once the handler has
    answered, aiohttp reads what is left of an unfinished body for a while (its lingering
    close) and stops at a timeout, closing the connection; any other error there is
    logged as unhandled."""

    status = 408
    reason = "body_too_slow"


class BadEncoding(BodyRefused):
    status = 400
    reason = "bad_content_encoding"


class UnsupportedEncoding(BodyRefused):
    status = 415
    reason = "unsupported_content_encoding"


def decodable(content_encoding: str) -> bool:
    """Whether ``read_body`` decodes this coding (gzip or deflate), rather than reading the
    bytes as they are (none, identity) or refusing them (any other)."""
    return content_encoding.strip().lower() in ("gzip", "x-gzip", "deflate")


def decoder_for(content_encoding: str) -> _Decoder | None:
    """The decoder of a ``Content-Encoding`` header's value (None: the bytes as they are).
    Raises UnsupportedEncoding."""
    coding = content_encoding.strip().lower()
    if coding in ("", "identity"):
        return None
    if coding in ("gzip", "x-gzip"):
        return _Decoder(gzip=True)
    if coding == "deflate":
        return _Decoder(gzip=False)
    raise UnsupportedEncoding(
        f"Content-Encoding {content_encoding.strip()[:40]!r} is not supported; send the body "
        "as is, or with one of gzip, deflate"
    )


class _Decoder:
    """gzip or deflate, one compressed piece at a time, never more than ``room`` out."""

    def __init__(self, gzip: bool) -> None:
        self.gzip = gzip
        self._inflate: zlib._Decompress | None = None
        self._seen_input = False

    def _start(self, first_byte: int) -> zlib._Decompress:
        if self.gzip:
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # RFC 9110 deflate is zlib-wrapped (CM = 8 in the low bits); many send it raw.
        wrapped = first_byte & 0x0F == 8
        return zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)

    def feed(self, data: bytes, room: int) -> list[bytes]:
        """The decoded pieces of ``data``; BodyTooLarge past ``room`` bytes in all."""
        out: list[bytes] = []
        while data:
            if self._inflate is None:
                self._inflate = self._start(data[0])
            elif self._inflate.eof:
                # Bytes after the end: another gzip member, or garbage.
                if not self.gzip:
                    raise BadEncoding("bytes follow the end of the deflate stream")
                self._inflate = self._start(data[0])
            self._seen_input = True
            try:
                piece = self._inflate.decompress(data, min(room, DECODE_STEP_BYTES) + 1)
            except zlib.error:
                raise BadEncoding("the body does not decode as its Content-Encoding says") from None
            if len(piece) > room:
                raise BodyTooLarge("decoded, the body is larger than the limit")
            if piece:
                out.append(piece)
                room -= len(piece)
            data = self._inflate.unconsumed_tail or self._inflate.unused_data
            if not data and not self._inflate.eof and not piece:
                break
        return out

    def finish(self, room: int) -> list[bytes]:
        """What is left once the body ended; BadEncoding when it was cut short."""
        if self._inflate is None:
            if self._seen_input:
                raise BadEncoding("the body ended inside its encoding")
            return []  # an empty body: nothing to decode
        out: list[bytes] = []
        while not self._inflate.eof:
            piece = self._inflate.decompress(b"", min(room, DECODE_STEP_BYTES) + 1)
            if len(piece) > room:
                raise BodyTooLarge("decoded, the body is larger than the limit")
            if not piece:
                raise BadEncoding("the body ended inside its encoding")
            out.append(piece)
            room -= len(piece)
        return out


async def read_body(
    stream: aiohttp.StreamReader,
    declared: int | None,
    limit: int,
    content_encoding: str = "",
    *,
    seconds: float | None = None,
    reserve: Callable[[int], Awaitable[None]] | None = None,
) -> bytes:
    """The whole body, decoded: at most ``limit`` bytes, arrived within ``seconds``
    (``BODY_SECONDS``). Raises BodyRefused (one of its kinds), ConnectionError when the
    client went away, or whatever ``reserve`` raises."""
    if declared is not None and declared > limit:
        raise BodyTooLarge("the declared Content-Length is larger than the limit")
    decoder = decoder_for(content_encoding) if content_encoding else None
    if stream.is_eof():  # received whole already: nothing to wait for
        return await _read(stream, limit, decoder, reserve)
    seconds = BODY_SECONDS if seconds is None else seconds
    timer = asyncio.get_running_loop().call_later(seconds, _too_slow, stream, seconds)
    try:
        return await _read(stream, limit, decoder, reserve)
    finally:
        timer.cancel()


def _too_slow(stream: aiohttp.StreamReader, seconds: float) -> None:
    if not stream.is_eof():
        stream.set_exception(BodyTooSlow(f"the body did not arrive whole within {seconds:g} s"))


async def _read(
    stream: aiohttp.StreamReader,
    limit: int,
    decoder: _Decoder | None,
    reserve: Callable[[int], Awaitable[None]] | None,
) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await stream.readany()
        if not chunk:
            break
        if decoder is None:
            pieces = [chunk]
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge("the body is larger than the limit")
        else:
            pieces = decoder.feed(chunk, limit - size)
            size += sum(len(piece) for piece in pieces)
        for piece in pieces:
            if reserve is not None:
                await reserve(len(piece))
            chunks.append(piece)
    if decoder is not None:
        for piece in decoder.finish(limit - size):
            if reserve is not None:
                await reserve(len(piece))
            chunks.append(piece)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
