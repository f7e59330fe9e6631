"""Read vLLM's /metrics: bounded in time and size, parsed off the event loop when large."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import aiohttp

from exporter.engine.parse import MAX_LABEL_VALUE_CHARS, EngineRead, LabelCaps, ParseError, read
from exporter.redaction import redact_text, redact_url
from exporter.values import EngineSnapshot

log = logging.getLogger(__name__)

# Bodies above this are parsed in a worker thread so one big scrape cannot stall ingest.
PARSE_INLINE_MAX_BYTES = 256 * 1024
ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"


class FetchError(Exception):
    """A target could not be read; ``reason`` is the bounded label value that counts it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def fetch_body(
    session: aiohttp.ClientSession, url: str, timeout: float, max_bytes: int
) -> bytes:
    try:
        async with session.get(
            url,
            timeout=aiohttp.ClientTimeout(total=timeout),
            headers={"Accept": ACCEPT},
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                raise FetchError("http_status", f"HTTP {response.status} from {url}")
            if response.content_length is not None and response.content_length > max_bytes:
                raise FetchError(
                    "body_too_large", f"body of {response.content_length} bytes exceeds {max_bytes}"
                )
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > max_bytes:
                    raise FetchError("body_too_large", f"body exceeds {max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except FetchError:
        raise
    except asyncio.TimeoutError:
        raise FetchError("timeout", f"no complete answer from {url} within {timeout:g}s") from None
    except aiohttp.ClientPayloadError as err:
        raise FetchError("truncated", f"body from {url} ended early: {err}") from None
    except aiohttp.ClientConnectorError as err:
        raise FetchError("connect", f"cannot connect to {url}: {err.os_error or err}") from None
    except aiohttp.ClientError as err:
        raise FetchError("http_error", f"{type(err).__name__} reading {url}: {err}") from None


async def decode_and_parse(body: bytes) -> EngineSnapshot:
    return (await decode_and_read(body)).snapshot


async def decode_and_read(body: bytes, caps: LabelCaps | None = None) -> EngineRead:
    def work() -> EngineRead:
        return read(body.decode("utf-8"), caps)

    try:
        if len(body) > PARSE_INLINE_MAX_BYTES:
            return await asyncio.get_running_loop().run_in_executor(None, work)
        return work()
    except UnicodeDecodeError:
        raise FetchError("parse", "body is not UTF-8 text") from None
    except ParseError as err:
        raise FetchError("parse", f"not a Prometheus text exposition: {err}") from None


class SuccessSink(Protocol):
    """record_success(target, snapshot, seconds the read took, unix time, invalid=samples
    dropped by reason, folded=samples folded by reason)."""

    def __call__(
        self,
        target: str,
        snapshot: EngineSnapshot,
        duration: float,
        now: float,
        *,
        invalid: Mapping[str, int] | None = ...,
        folded: Mapping[str, int] | None = ...,
    ) -> None: ...


# record_failure(target, reason, message, seconds the read took)
FailureSink = Callable[[str, str, str, float], None]


class EnginePoller:
    """Reads every target once per scrape, concurrently; concurrent scrapes share one read.

    What it reads goes to the two sinks it is handed; it keeps no signal state itself.
    """

    def __init__(
        self,
        targets: Sequence[str],
        record_success: SuccessSink,
        record_failure: FailureSink,
        session_factory: Callable[[], aiohttp.ClientSession],
        timeout: float,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = tuple(targets)
        self._record_success = record_success
        self._record_failure = record_failure
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._clock = clock
        self._monotonic = monotonic
        self._inflight: asyncio.Task[None] | None = None
        # Per target: the label values its reads may show, kept across reads.
        self._caps = {target: LabelCaps() for target in self.targets}
        self._fold_warned: set[tuple[str, str]] = set()

    async def close(self) -> None:
        if self._inflight is not None:
            await asyncio.gather(self._inflight, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def effective_timeout(self, scrape_timeout_header: str | None) -> float:
        """Our own timeout, shortened to fit inside Prometheus' scrape timeout."""
        timeout = self.timeout
        if scrape_timeout_header:
            try:
                budget = float(scrape_timeout_header)
            except ValueError:
                budget = 0.0
            if budget > 0:
                # Leave room to render and send our own answer.
                timeout = min(timeout, max(budget * 0.9 - 0.1, 0.05))
        return timeout

    async def refresh(self, timeout: float | None = None) -> None:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._refresh_all(timeout or self.timeout))
        await asyncio.shield(self._inflight)

    async def _refresh_all(self, timeout: float) -> None:
        if not self.targets:
            return
        if self._session is None:
            self._session = self._session_factory()
        await asyncio.gather(*(self._refresh_one(target, timeout) for target in self.targets))

    async def _refresh_one(self, target: str, timeout: float) -> None:
        assert self._session is not None
        started = self._monotonic()
        try:
            body = await fetch_body(self._session, target, timeout, self.max_bytes)
            parsed = await decode_and_read(body, self._caps[target])
        except FetchError as err:
            duration = self._monotonic() - started
            message = redact_text(str(err))
            log.warning(
                "vLLM target %s unreadable (%s): %s", redact_url(target), err.reason, message
            )
            self._record_failure(target, err.reason, message, duration)
            return
        except Exception as err:  # never let one target take the scrape down
            duration = self._monotonic() - started
            log.exception("unexpected error reading %s", redact_url(target))
            self._record_failure(target, "internal", redact_text(repr(err)), duration)
            return
        self._warn_folds(target, parsed.folded)
        self._record_success(
            target,
            parsed.snapshot,
            self._monotonic() - started,
            self._clock(),
            invalid=parsed.invalid,
            folded=parsed.folded,
        )

    def _warn_folds(self, target: str, folded: Mapping[str, int]) -> None:
        """Say once per target and reason that label values are being folded (the counter
        says how many, every read)."""
        caps = self._caps[target]
        limits = {
            "too_long": f"longer than {MAX_LABEL_VALUE_CHARS} characters",
            "model_name_cap": f"past {caps.max_model_names} model_name values",
            "engine_cap": f"past {caps.max_engines} engine values",
            "row_cap": f"past {caps.max_rows} (model_name, engine) rows",
        }
        for reason, samples in sorted(folded.items()):
            if (target, reason) in self._fold_warned:
                continue
            self._fold_warned.add((target, reason))
            log.warning(
                "vLLM target %s: %d sample(s) with label values %s are counted "
                "under __other__ (vllm_cache_engine_samples_folded_total{reason=%s})",
                redact_url(target),
                samples,
                limits.get(reason, reason),
                reason,
            )
