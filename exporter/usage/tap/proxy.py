"""The tap: a transparent reverse proxy in front of vLLM that records one UsageEvent per call.

For deployments without a proxy that logs ``cached_tokens`` per caller. The tap forwards
every request to ``--tap.upstream`` unchanged except for what it must do to read usage:

- chat, completions and responses calls (POST) are recorded: caller, model, prompt, cached
  and completion tokens, TTFT (first event that carries content) and the HTTP status the
  client saw (499 when the client went away before the usage arrived: one that closes once
  it has read the usage, as the openai SDK's sync stream does at ``[DONE]``, succeeded; 504
  on upstream timeout, 502 when upstream was
  unreachable or broke mid-answer or answered above ``--tap.max-response-bytes``); and, from
  vLLM started with ``--enable-per-request-metrics``, vLLM's own TTFT and queue wait, read
  from the body or the usage chunk the tap decodes anyway (so no extra work per call);
- a streaming chat/completion call that did not ask for usage gets
  ``stream_options.include_usage`` upstream, and the usage-only chunk this adds is removed
  from what the client receives; every other byte reaches the client as upstream sent it,
  chunk by chunk as it arrives;
- every other path is proxied untouched and not recorded;
- a request body must arrive whole within 30 s (408 beyond, counted as
  ``request_too_slow``); one in gzip or deflate is decoded (bounded by
  ``--tap.max-request-bytes``) and forwarded decoded; one that does not decode is answered
  400 (``bad_content_encoding``); an absolute-form target (``GET http://host/...``) is
  answered 400 (``bad_target``).

Nothing is ever retried: a request that failed upstream may have run there. The API key is
forwarded and otherwise only hashed (see ``identity``); it never reaches a log line, an
event or a label. Usage is read by ``exporter.usage.openai``, the same reader the ``openai``
format uses.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from exporter.redaction import redact_url
from exporter.usage.body import HANDLER_ARGS, BodyRefused, decodable, read_body
from exporter.usage.event import MAX_TOKENS, InvalidEvent, checked, loads
from exporter.usage.openai import (
    ENDPOINTS,
    USAGE_OPT_IN,
    Endpoint,
    EngineTimings,
    StreamReader,
    engine_timings_of,
    usage_of,
)
from exporter.usage.tap.fingerprint import fingerprint, new_key
from exporter.usage.tap.identity import KeyAliases, resolve_caller_of
from exporter.usage.tap.request import (
    NOT_AN_OBJECT,
    NeedsDecoder,
    RequestFacts,
    Undecidable,
    facts_of,
    parse,
    prompt_bytes,
    read,
    scan,
    with_include_usage,
)
from exporter.values import MAX_BACKEND_CHARS, PromptPrint, UsageEvent

log = logging.getLogger(__name__)

READER = "tap"
STATUS_CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection first"

# RFC 9110 7.6.1 connection-specific fields, never forwarded by a proxy.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by the HTTP client / already handled by the tap (the body was read in full).
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
# Client headers aiohttp would otherwise add on its own: the tap forwards the client's or none.
SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding")
# Bodies above this are decoded in a worker thread (requests only when the scan needs the
# C decoder).
PARSE_INLINE_MAX_BYTES = 256 * 1024
# Requests up to this that the scan's walk cannot read are read by msgspec on the event loop
# (about 1 ms a megabyte of dense JSON); larger ones in a worker thread.
READ_INLINE_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True)
class TapSettings:
    """The tap.* flags."""

    upstream: str
    listen_address: str = ""
    caller_header: str = "X-Caller"
    session_header: str = "X-Session-Id"
    key_alias: tuple[tuple[str, str], ...] = ()
    timeout: float = 600.0
    max_request_bytes: int = 64 * 1024 * 1024
    max_response_bytes: int = 256 * 1024 * 1024
    # Prompt bytes fingerprinted per request for the prompt-order diagnosis (0: none), and
    # the digests' key (None: a random one per process; tests inject theirs).
    prompt_order_bytes: int = 32 * 1024
    fingerprint_key: bytes | None = None


@dataclass
class Exchange:
    """What one recorded call taught the tap; turned into a UsageEvent at the end."""

    endpoint: Endpoint
    caller: str
    model: str | None
    # The caller is the tap's own name for the request's key (its hash, or the key's alias),
    # not one the client gave: it may have the form reserved to the exporter (key-...).
    own_caller: bool = False
    status: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_seconds: float | None = None
    session: str | None = None
    engine: EngineTimings | None = None  # vLLM's per-request metrics, when it sent them
    recorded: bool = False
    request: RequestFacts = NOT_AN_OBJECT  # what the request body said
    # The request as the client sent it (for the prompt's fingerprint); never in a repr.
    body: bytes = dataclasses.field(default=b"", repr=False)


def declared_budget(limit: int | None) -> int | None:
    """The request's output limit as the event's ``max_tokens``; a limit no usage record
    could carry (negative, absurd) is left out rather than costing the call its record:
    upstream answers such a request with its own error, which is still counted."""
    if limit is None or not 0 <= limit <= MAX_TOKENS:
        return None
    return limit


def json_error(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-shaped error body, so clients show the tap's reason as they show vLLM's."""
    body = {"error": {"message": message, "type": kind, "code": status}, "object": "error"}
    return web.json_response(body, status=status)


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    tokens: set[str] = set()
    for value in headers.getall("Connection", ()):
        tokens.update(token.strip().lower() for token in value.split(",") if token.strip())
    return tokens


def forward_headers(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    listed = _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in drop or lower in listed:
            continue
        out.add(name, value)
    return out


class BodyTooLarge(Exception):
    pass


async def read_bounded(stream: aiohttp.StreamReader, declared: int | None, limit: int) -> bytes:
    """A whole answer from vLLM, at most ``limit`` bytes (its time is bounded by
    ``--tap.timeout``; a client's request is read by ``exporter.usage.body``, bounded in time
    and decoded). Chunks are taken as aiohttp buffered them
    (``readany`` hands them over without a copy) and joined once; a body that came in one
    chunk is that chunk."""
    if declared is not None and declared > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await stream.readany()
        if not chunk:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)


async def read_request(body: bytes, endpoint: Endpoint) -> RequestFacts:
    """The request's facts (``request``): read on the loop, or decoded in a worker thread
    when the body is large and neither the scan's walk nor, up to READ_INLINE_MAX_BYTES,
    msgspec can read it."""
    if len(body) <= PARSE_INLINE_MAX_BYTES:
        return facts_of(body, endpoint)
    try:
        return scan(body, endpoint, decoder=False)  # facts_of's order: the walk first,
    except NeedsDecoder:
        if len(body) <= READ_INLINE_MAX_BYTES:
            try:
                return read(body, endpoint)  # then msgspec
            except Undecidable:
                pass
        work = facts_of
    except Undecidable:
        work = parse
    return await asyncio.get_running_loop().run_in_executor(None, work, body, endpoint)


async def ask_for_usage(body: bytes, facts: RequestFacts) -> bytes:
    """``with_include_usage``, in a worker thread when it has to find ``stream_options`` in
    a large body with the C scanner (facts read by msgspec have no positions)."""
    if facts.object_start < 0 and facts.has_stream_options and len(body) > PARSE_INLINE_MAX_BYTES:
        return await asyncio.get_running_loop().run_in_executor(
            None, with_include_usage, body, facts
        )
    return with_include_usage(body, facts)


class Tap:
    """The proxy handler and the recording of its calls. One per tap listener."""

    def __init__(
        self,
        settings: TapSettings,
        record: Callable[[UsageEvent], object],
        reject: Callable[[str], None],
        session: aiohttp.ClientSession | None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        record_prompt: Callable[[UsageEvent, PromptPrint], object] | None = None,
    ) -> None:
        self.settings = settings
        self._record = record
        self._record_prompt = record_prompt
        self._reject = reject
        self.session = session
        if session is not None:
            no_retries(session)
        upstream = URL(settings.upstream.rstrip("/"))
        # Credentials in the upstream URL are the upstream's own: sent as its Basic auth when
        # the client sends no Authorization, never combined with the client's, never shown.
        self.upstream_auth = None
        if upstream.user is not None or upstream.password is not None:
            pair = f"{upstream.user or ''}:{upstream.password or ''}".encode()
            self.upstream_auth = "Basic " + base64.b64encode(pair).decode("ascii")
        self.upstream = upstream.with_user(None)
        self._upstream_text = str(self.upstream)  # each call's URL starts with it
        # The replica every call is recorded as served by: the upstream without credentials
        # (its origin alone if it is too long to be a backend).
        self.backend = (
            self._upstream_text
            if len(self._upstream_text) <= MAX_BACKEND_CHARS and self._upstream_text.isprintable()
            else str(self.upstream.origin())
        )
        self.upstream_shown = redact_url(settings.upstream)
        self.aliases = KeyAliases(settings.key_alias)
        self.timeout = aiohttp.ClientTimeout(total=settings.timeout)
        self.clock = clock
        self.monotonic = monotonic
        self.said_no_engine_timings = False
        self.fingerprint_key = settings.fingerprint_key or new_key()

    # -- recording ---------------------------------------------------------------------

    def reject(self, reason: str) -> None:
        self._reject(reason)
        log.debug("tap: %s", reason)

    def record(self, exchange: Exchange) -> None:
        """Hand the call to the usage signals through the same validation as every reader.

        Once per call. A call is recorded in the same turn of the event loop that hands its
        answer's last byte to the socket (right after), before the process does anything
        else, so a client that has read the whole answer can count on its event being
        counted.
        """
        if exchange.recorded:
            return
        exchange.recorded = True
        failed = exchange.status >= 400 or exchange.status == 0
        if exchange.prompt_tokens is None and not failed:
            return  # already counted as a rejection (missing_usage, malformed_response, ...)
        engine = exchange.engine
        try:
            event = checked(
                UsageEvent(
                    caller=exchange.caller,
                    model=exchange.model or "",
                    prompt_tokens=exchange.prompt_tokens,  # type: ignore[arg-type]  # None: checked
                    cached_tokens=exchange.cached_tokens,
                    completion_tokens=exchange.completion_tokens,
                    ttft_seconds=exchange.ttft_seconds,
                    session=exchange.session,
                    time=self.clock(),
                    status=exchange.status or 502,
                    engine_ttft_seconds=engine.ttft_seconds if engine else None,
                    engine_queue_seconds=engine.queue_seconds if engine else None,
                    max_tokens=declared_budget(exchange.request.output_limit),
                    sequences=exchange.request.sequences,
                    backend=self.backend,
                ),
                own_caller=exchange.own_caller,
            )
        except InvalidEvent as err:
            # The call itself went through; only its record is refused, and counted.
            self._reject(err.reason)
            log.debug("tap: event refused (%s): %s", err.reason, err)
            return
        if (
            engine is None
            and not failed
            and exchange.endpoint is not Endpoint.MESSAGES
            and exchange.request.sequences == 1
        ):
            # (vLLM's Messages API never sends them, nor any answer for n > 1)
            self.say_no_engine_timings()
        if not failed and self._record_prompt is not None and self.settings.prompt_order_bytes > 0:
            # The answer is out (its last bytes handed over in this turn of the loop): its
            # prompt order first, so that the event's miss is counted knowing it (a
            # variable-top request's avoidable miss is ``order``).
            self.record_prompt(exchange, event)
        self._record(event)

    def record_prompt(self, exchange: Exchange, event: UsageEvent) -> None:
        """The call's prompt order: its fingerprint (at most ``prompt_order_bytes`` of the
        prompt), handed to the signals with the call's event, just before the event itself.
        Never on the request's way to vLLM nor before its answer."""
        try:
            prompt = self.prompt_print(exchange)
            if prompt is not None and self._record_prompt is not None:
                self._record_prompt(event, prompt)
        except Exception as err:  # noqa: BLE001 - a diagnosis never takes the tap down
            # The type only: a message could quote the prompt.
            log.warning("tap: prompt order not recorded: %s", type(err).__name__)

    def prompt_print(self, exchange: Exchange) -> PromptPrint | None:
        prompt = prompt_bytes(exchange.body, exchange.endpoint, exchange.request)
        if prompt is None:
            return None
        return fingerprint(prompt, self.fingerprint_key, self.settings.prompt_order_bytes)

    def say_no_engine_timings(self) -> None:
        """Once per tap: vLLM answered without its per-request metrics, so the TTFT recorded
        is the tap's own (proxy-measured) and there is no queue wait. /metrics cannot tell
        whether vLLM runs with the flag; the first answer without them can."""
        if self.said_no_engine_timings:
            return
        self.said_no_engine_timings = True
        log.warning(
            "tap: vLLM answered without its per-request metrics: TTFT is measured "
            'at the tap (source="proxy") and vLLM\'s queue wait is unknown. Start '
            "vLLM with --enable-per-request-metrics (beside "
            "--enable-prompt-tokens-details) for the engine's own TTFT and queue "
            "wait. (vLLM also omits them for n > 1.)"
        )

    # -- proxying ----------------------------------------------------------------------

    def upstream_url(self, request: web.Request) -> URL:
        return URL(self._upstream_text + request.raw_path, encoded=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = self.monotonic()
        if not request.raw_path.startswith("/"):
            # The absolute form (GET http://host/path) is for forward proxies: the tap is a
            # reverse one, and a host in the target names no path of vLLM's. (The asterisk
            # form, OPTIONS *, matches no route: aiohttp answers 404.)
            self.reject("bad_target")
            return json_error(
                400,
                "the request target must be a path (/v1/...); the tap is "
                "a reverse proxy, not a forward one",
                "bad_target",
            )
        endpoint = ENDPOINTS.get(request.path.rstrip("/")) if request.method == "POST" else None
        coding = request.headers.get("Content-Encoding", "")
        decoded = bool(coding) and decodable(coding)
        try:
            # gzip and deflate are decoded (to read the request; vLLM gets it decoded), any
            # other coding is forwarded as it came, for vLLM to answer.
            body = await read_body(
                request.content,
                request.content_length,
                self.settings.max_request_bytes,
                coding if decoded else "",
            )
        except BodyRefused as refused:
            return self.refuse_body(refused)
        except ConnectionError:
            return _dropped()
        headers = forward_headers(request.headers, REQUEST_DROP)
        if decoded:
            headers.popall("Content-Encoding", None)
        if self.upstream_auth is not None and "Authorization" not in headers:
            headers["Authorization"] = self.upstream_auth
        if endpoint is None:
            return await self.forward(request, body, headers, None, started)

        # A body that is not a JSON object is forwarded as it is: vLLM answers it (400) and
        # the tap records that answer.
        facts = await read_request(body, endpoint)
        caller, own_caller = resolve_caller_of(
            request.headers, facts.user, self.settings.caller_header, self.aliases
        )
        exchange = Exchange(
            endpoint=endpoint,
            caller=caller,
            own_caller=own_caller,
            model=facts.model,
            session=(
                request.headers.get(self.settings.session_header, "").strip() or None
                if self.settings.session_header
                else None
            ),
            request=facts,
            body=body,
        )
        strip = False
        if endpoint in USAGE_OPT_IN and facts.stream and not facts.wants_usage:
            body = await ask_for_usage(body, facts)
            strip = True
        # Usage is read from the bytes: ask for them uncompressed.
        headers.popall("Accept-Encoding", None)
        try:
            return await self.forward(request, body, headers, exchange, started, strip)
        finally:
            self.record(exchange)

    def refuse_body(self, refused: BodyRefused) -> web.Response:
        """A request body the tap does not forward: answered, counted, the connection closed
        (the rest of the body is not worth reading)."""
        if refused.status == 413:
            self.reject("request_too_large")
            response = json_error(
                413,
                "request body exceeds --tap.max-request-bytes "
                f"({self.settings.max_request_bytes} bytes)",
                "request_too_large",
            )
        elif refused.status == 408:
            self.reject("request_too_slow")
            response = json_error(408, refused.message, "request_too_slow")
        else:
            self.reject("bad_content_encoding")
            response = json_error(400, refused.message, "bad_content_encoding")
        response.force_close()
        return response

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        headers: CIMultiDict[str],
        exchange: Exchange | None,
        started: float,
        strip: bool = False,
    ) -> web.StreamResponse:
        assert self.session is not None, "the tap's client session is not started"
        try:
            async with self.session.request(
                request.method,
                self.upstream_url(request),
                data=body or None,
                headers=headers,
                skip_auto_headers=SKIP_AUTO_HEADERS,
                allow_redirects=False,
                timeout=self.timeout,
                auto_decompress=False,
            ) as upstream:
                try:
                    return await self.answer(request, upstream, exchange, started, strip)
                except BaseException:
                    upstream.close()  # never leave vLLM generating for nobody
                    raise
        except asyncio.CancelledError:
            if exchange is not None and not exchange.recorded:
                exchange.status = STATUS_CLIENT_CLOSED
            raise
        except _ClientGone:
            if exchange is not None and not exchange.recorded:
                exchange.status = STATUS_CLIENT_CLOSED
            return _dropped()
        except _StreamBroken as broken:
            if exchange is not None:
                exchange.status = broken.status
            log.warning("tap: %s %s: %s", request.method, request.path, broken.message)
            broken.cut_client_off()
            return broken.response
        except asyncio.TimeoutError:
            if exchange is not None:
                exchange.status = 504
            log.warning(
                "tap: %s %s: no answer from upstream within %gs",
                request.method,
                request.path,
                self.settings.timeout,
            )
            return json_error(
                504,
                f"upstream {self.upstream_shown} did not answer within {self.settings.timeout:g}s",
                "upstream_timeout",
            )
        except aiohttp.ClientError as err:
            if exchange is not None:
                exchange.status = 502
            reason = type(err).__name__
            if isinstance(err, aiohttp.ClientConnectorError):
                reason = f"cannot connect ({err.os_error or err})"
            log.warning("tap: %s %s: upstream failed: %s", request.method, request.path, reason)
            return json_error(
                502, f"upstream {self.upstream_shown} failed: {reason}", "upstream_error"
            )

    async def answer(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        exchange: Exchange | None,
        started: float,
        strip: bool,
    ) -> web.StreamResponse:
        headers = forward_headers(upstream.headers, RESPONSE_DROP)
        if exchange is not None:
            exchange.status = upstream.status
            if upstream.content_type == "text/event-stream":
                return await self.relay_events(request, upstream, headers, exchange, started, strip)
            return await self.relay_body(request, upstream, headers, exchange)
        return await self.relay_raw(request, upstream, headers)

    async def relay_raw(
        self, request: web.Request, upstream: aiohttp.ClientResponse, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        """Any other path: bytes through as they come, nothing read."""
        response = web.StreamResponse(
            status=upstream.status, reason=upstream.reason, headers=headers
        )
        if upstream.content_length is not None and not _has_body_encoding(upstream):
            response.content_length = upstream.content_length
        await _prepare(response, request)
        try:
            async for chunk in upstream.content.iter_any():
                await _write(response, chunk)
        except (asyncio.TimeoutError, aiohttp.ClientError) as err:
            raise _StreamBroken(
                request,
                response,
                504 if isinstance(err, asyncio.TimeoutError) else 502,
                f"upstream broke mid-answer: {err!r}",
            ) from None
        await _write_eof(response)
        return response

    async def relay_body(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: CIMultiDict[str],
        exchange: Exchange,
    ) -> web.Response:
        """A whole (non-streamed) answer: read it within the limit, pass it byte for byte."""
        limit = self.settings.max_response_bytes
        try:
            body = await read_bounded(upstream.content, upstream.content_length, limit)
        except BodyTooLarge:
            exchange.status = 502
            self.reject("response_too_large")
            return json_error(
                502,
                f"upstream answer exceeds --tap.max-response-bytes ({limit} bytes)",
                "response_too_large",
            )
        response = web.Response(
            status=upstream.status, reason=upstream.reason, body=body, headers=headers
        )
        if len(body) > PARSE_INLINE_MAX_BYTES:
            # Decoded in a worker thread, before the answer goes: an await after it would be
            # a point where the client's hang-up could cancel the call's record.
            await self.read_body_usage(body, upstream, exchange)
            return response
        # The answer goes out first; its usage is read and counted right after, in the same
        # turn of the event loop (nothing awaited in between), so nothing the process does
        # next, such as answering a scrape, sees the call uncounted, and the client does not
        # wait for the tap's own bookkeeping. A client gone by then changes nothing: the
        # call is counted as vLLM answered it, as when aiohttp sent the answer itself.
        try:
            await _prepare(response, request)
            await _write_eof(response)
        finally:
            if self.body_readable(upstream):
                try:
                    answer = loads(body)
                except ValueError:
                    self.reject("malformed_response")
                else:
                    self.take_answer(answer, exchange)
            self.record(exchange)
        return response

    async def read_body_usage(
        self, body: bytes, upstream: aiohttp.ClientResponse, exchange: Exchange
    ) -> None:
        """A large answer's usage, its JSON decoded in a worker thread."""
        if not self.body_readable(upstream):
            return
        try:
            answer = await asyncio.get_running_loop().run_in_executor(None, loads, body)
        except ValueError:
            self.reject("malformed_response")
            return
        self.take_answer(answer, exchange)

    def body_readable(self, upstream: aiohttp.ClientResponse) -> bool:
        """An answer that should carry usage (a success, JSON); one that should and is not
        JSON is counted as ``malformed_response``."""
        if upstream.status >= 400:
            return False
        if upstream.content_type != "application/json":
            self.reject("malformed_response")
            return False
        return True

    def take_answer(self, answer: object, exchange: Exchange) -> None:
        """The usage, model and vLLM's timings of a whole answer's decoded JSON."""
        try:
            usage, model = usage_of(answer)
            engine = engine_timings_of(answer)
        except InvalidEvent as err:
            self.reject(err.reason)
            return
        if model:
            exchange.model = model
        if usage is None:
            self.reject("missing_usage")
            return
        exchange.prompt_tokens = usage.prompt_tokens
        exchange.cached_tokens = usage.cached_tokens
        exchange.completion_tokens = usage.completion_tokens
        exchange.engine = engine

    async def relay_events(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: CIMultiDict[str],
        exchange: Exchange,
        started: float,
        strip: bool,
    ) -> web.StreamResponse:
        """A stream: each chunk to the client as it arrives, usage read on the way."""
        response = web.StreamResponse(
            status=upstream.status, reason=upstream.reason, headers=headers
        )
        await _prepare(response, request)
        reader = StreamReader(
            strip, started, max_event_bytes=min(self.settings.max_response_bytes, 8 * 1024 * 1024)
        )
        broken: _StreamBroken | None = None
        try:
            async for chunk in upstream.content.iter_any():
                out = reader.feed(chunk, self.monotonic())
                if out:
                    await _write(response, out)
        except (asyncio.CancelledError, _ClientGone):
            # The client hung up. One that has read the usage has had every event it needs
            # (the usage comes after the last content): the openai SDK's sync stream stops
            # at [DONE] and closes before the chunked terminator. That call succeeded, and
            # is counted as vLLM answered it; one that left before the usage is a 499.
            if reader.usage is not None:
                self.take_stream(reader, exchange)
                self.record(exchange)
            raise
        except (asyncio.TimeoutError, aiohttp.ClientError) as err:
            timed_out = isinstance(err, asyncio.TimeoutError)
            broken = _StreamBroken(
                request,
                response,
                504 if timed_out else 502,
                "upstream stream " + ("timed out" if timed_out else f"broke: {err!r}"),
            )
        if broken is not None:
            # Counted once, as the error the client saw; its usage never came.
            exchange.status = broken.status
        self.take_stream(reader, exchange)
        tail = reader.finish()
        if tail:
            await _write(response, tail)
        if broken is not None:
            self.record(exchange)
            raise broken
        # Counted right after the last byte is handed over, in the same turn of the loop
        # (see relay_body); a client gone at the very end still leaves the call counted as
        # vLLM answered it.
        try:
            await _write_eof(response)
        finally:
            self.record(exchange)
        return response

    def take_stream(self, reader: StreamReader, exchange: Exchange) -> None:
        for problem in reader.problems:
            self.reject(problem)
        exchange.ttft_seconds = reader.ttft_seconds
        if reader.model:
            exchange.model = reader.model
        if reader.error_status is not None:
            exchange.status = reader.error_status
        if reader.usage is None:
            if exchange.status < 400:
                self.reject("missing_usage")
            return
        exchange.prompt_tokens = reader.usage.prompt_tokens
        exchange.cached_tokens = reader.usage.cached_tokens
        exchange.completion_tokens = reader.usage.completion_tokens
        exchange.engine = reader.engine


class _ClientGone(Exception):
    """The client closed its connection while the tap was answering."""


class _StreamBroken(Exception):
    """Upstream failed after the client already got the status line: cut the client off."""

    def __init__(
        self, request: web.Request, response: web.StreamResponse, status: int, message: str
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.response = response
        self.request = request

    def cut_client_off(self) -> None:
        # Closing without the final chunk tells the client the answer is incomplete, as a
        # direct connection to the failed upstream would have.
        if self.request.transport is not None:
            self.request.transport.close()


def _has_body_encoding(upstream: aiohttp.ClientResponse) -> bool:
    return "Transfer-Encoding" in upstream.headers


async def _prepare(response: web.StreamResponse, request: web.Request) -> None:
    try:
        await response.prepare(request)
    except ConnectionError:
        raise _ClientGone from None


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionError:
        raise _ClientGone from None


async def _write_eof(response: web.StreamResponse) -> None:
    try:
        await response.write_eof()
    except ConnectionError:
        raise _ClientGone from None


def _dropped() -> web.Response:
    """Returned to aiohttp when nobody is listening any more; never seen by a client."""
    return web.Response(status=STATUS_CLIENT_CLOSED)


def no_retries(session: aiohttp.ClientSession) -> None:
    """aiohttp re-sends a GET/PUT/DELETE once when a kept-alive connection turns out closed
    (RFC 9112 9.3.1 allows it). The tap never re-sends anything: the first attempt may have
    reached vLLM. There is no public switch; aiohttp's own test client sets the same flag."""
    session._retry_connection = False


def new_session(connections: int = 0) -> aiohttp.ClientSession:
    """At most ``connections`` sockets to vLLM (0: no cap; ``run`` gives the tap's share of
    the process's descriptors, as many as the tap serves client connections, so a call never
    waits for one), no decompression.

    Idle connections are dropped after 4 s, before vLLM's uvicorn drops them (5 s,
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a call sent on a connection the server is closing fails,
    and the tap does not re-send it.
    """
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=4),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    no_retries(session)
    return session


def create_tap_app(
    settings: TapSettings,
    record: Callable[[UsageEvent], object],
    reject: Callable[[str], None],
    session: aiohttp.ClientSession | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    record_prompt: Callable[[UsageEvent, PromptPrint], object] | None = None,
    upstream_connections: int = 0,
) -> web.Application:
    """The tap as an aiohttp app (tests and benchmarks mount it themselves).

    ``record`` takes each call's UsageEvent, ``reject`` the reason of each call whose usage
    could not be read, ``record_prompt`` (when given) each successful call's event with its
    prompt's fingerprint, once the answer is out and just before ``record`` takes the event.
    Without a session the app opens
    its own on startup (at most ``upstream_connections`` sockets to vLLM, 0: no cap) and
    closes it on cleanup. Request bodies reach the handler as sent (``HANDLER_ARGS``): the
    tap decodes them itself, bounded (``exporter.usage.body``).
    """
    tap = Tap(
        settings,
        record,
        reject,
        session,
        clock=clock,
        monotonic=monotonic,
        record_prompt=record_prompt,
    )
    app = web.Application(client_max_size=settings.max_request_bytes, handler_args=HANDLER_ARGS)
    app.router.add_route("*", "/{tail:.*}", tap.handle)
    if session is None:

        async def open_session(_app: web.Application) -> None:
            tap.session = new_session(upstream_connections)

        async def close_session(_app: web.Application) -> None:
            if tap.session is not None:
                await tap.session.close()

        app.on_startup.append(open_session)
        app.on_cleanup.append(close_session)
    return app


async def run_tap(
    settings: TapSettings,
    record: Callable[[UsageEvent], object],
    reject: Callable[[str], None],
    secure: Callable[[web.Application], None] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    runner: Callable[..., web.AppRunner] = web.AppRunner,
    record_prompt: Callable[[UsageEvent, PromptPrint], object] | None = None,
    upstream_connections: int = 0,
) -> None:
    """Serve the tap on ``settings.listen_address`` until cancelled.

    ``secure`` (the --tap.web-config.file listener's) adds its client-certificate checks
    and headers to the app; ``ssl_context`` serves it over TLS; ``runner`` makes the
    aiohttp runner (the process's own caps connections and idle time);
    ``upstream_connections`` caps the sockets to vLLM (0: no cap).
    """
    app = create_tap_app(
        settings,
        record,
        reject,
        record_prompt=record_prompt,
        upstream_connections=upstream_connections,
    )
    if secure is not None:
        secure(app)
    # handler_cancellation: a client that hangs up cancels its upstream call at once.
    app_runner = runner(
        app, access_log=None, handle_signals=False, handler_cancellation=True, shutdown_timeout=2.0
    )
    await app_runner.setup()
    host, _, port = settings.listen_address.rpartition(":")
    try:
        site = web.TCPSite(
            app_runner,
            host.strip("[]") or "0.0.0.0",
            int(port),
            reuse_address=True,
            ssl_context=ssl_context,
        )
        try:
            await site.start()
        except OSError as err:
            log.error("tap: cannot listen on %s: %s", settings.listen_address, err.strerror)
            raise
        log.info(
            "tap listening on %s://%s, forwarding to %s",
            "https" if ssl_context else "http",
            settings.listen_address,
            redact_url(settings.upstream),
        )
        await asyncio.Event().wait()
    finally:
        await app_runner.cleanup()
