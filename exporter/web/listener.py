"""One listener's web config in force: TLS context, basic auth, response headers, reloads.

exporter-toolkit re-reads the web config file on every request and the certificates on
every handshake. Here the files are ``stat``-ed instead (the web config and every
certificate, key and CA file it names) at each new TLS connection and each request, and
re-read only when one of them changed; ``reload()`` (wired to SIGHUP) re-reads them
unconditionally. Established connections keep going through a reload: they keep the TLS
context they were made with, while basic auth and headers follow the new file from the
next request on.

Unlike the toolkit, a reload that fails keeps the last good configuration: it is logged
once (the files are not tried again until they change or SIGHUP comes) and counted. A
reload may not turn TLS on or off: that changes what the listening socket is, and needs a
restart.

The certificate's expiry (the earliest notAfter of the chain served) is kept with the
context and exported; a warning is logged when the certificate loaded is expired or expires
within ``EXPIRY_WARNING_SECONDS``, and again when a running listener's certificate crosses
into either (checked at each new TLS connection, against the injected wall clock). An
expired certificate is still served, as the toolkit serves it: clients decide.

Not like the toolkit either, by choice: ``open_paths`` (the health probes) answer without
basic auth, since an orchestrator's probe cannot hold a password, and ``bearer_paths``
(routes that check their own bearer token) are left to that token, since a request has one
``Authorization`` header and cannot carry both.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exporter.web.auth import PasswordVerifier, Verdict
from exporter.web.config import WebConfig, WebConfigError, read_web_config
from exporter.web.tls import FollowingContext, ServerTLS, build_server_tls

log = logging.getLogger(__name__)

# A certificate this close to its notAfter is logged as expiring soon.
EXPIRY_WARNING_SECONDS = 14 * 24 * 3600.0

# os.stat fields that change when a file is replaced or rewritten (None: missing).
Fingerprint = tuple[tuple[str, tuple[int, ...] | None], ...]


@dataclass(frozen=True)
class ReloadStatus:
    """What a metrics collector shows about one listener's reloads."""

    listener: str
    successes: int
    failures: int
    last_success_unix: float
    tls: bool
    # Unix time the served certificate chain expires (its earliest notAfter); None without
    # TLS or when it could not be read.
    certificate_not_after: float | None = None


@dataclass(frozen=True)
class _Active:
    config: WebConfig
    ssl_context: ssl.SSLContext | None
    not_after: float | None = None

    @classmethod
    def of(cls, config: WebConfig, tls: ServerTLS | None) -> _Active:
        if tls is None:
            return cls(config, None)
        return cls(config, tls.context, tls.not_after)


def load(path: str, *, allow_basic_auth: bool = True) -> tuple[WebConfig, ssl.SSLContext | None]:
    """Read the file and build its TLS context: all that ``promtool check web-config``
    checks, and what ``--check-config`` runs. Raises WebConfigError."""
    config = read_web_config(path)
    tls = _materialize(config, allow_basic_auth)
    return config, tls.context if tls is not None else None


def _materialize(config: WebConfig, allow_basic_auth: bool) -> ServerTLS | None:
    if config.users and not allow_basic_auth:
        raise WebConfigError(
            config.path,
            "basic_auth_users",
            "not supported on this listener: its clients' Authorization "
            "header is their API key, forwarded to vLLM",
        )
    return build_server_tls(config.tls, config.path) if config.tls.enabled else None


class WebListener:
    """The web config of one listener, kept current. Build it with ``WebListener.open``."""

    def __init__(
        self,
        path: str,
        name: str,
        active: _Active,
        *,
        allow_basic_auth: bool,
        wall_clock: Callable[[], float],
        on_reload: Callable[[ReloadStatus], None] | None,
    ) -> None:
        self.path = path
        self.name = name
        self._active = active
        self._allow_basic_auth = allow_basic_auth
        self._wall_clock = wall_clock
        self._on_reload = on_reload
        self._watched_files = _unique((path, *active.config.files))
        self._fingerprint = _fingerprint(self._watched_files)
        self._successes = 0
        self._failures = 0
        self._last_success = wall_clock()
        self.verifier = PasswordVerifier()
        self._server_context = (
            FollowingContext(self.current_ssl_context) if active.ssl_context is not None else None
        )
        self._expiry_said: tuple[float | None, str] = (None, "valid")
        self._check_expiry()

    @classmethod
    def open(
        cls,
        path: str,
        name: str,
        *,
        allow_basic_auth: bool = True,
        wall_clock: Callable[[], float] = time.time,
        on_reload: Callable[[ReloadStatus], None] | None = None,
    ) -> WebListener:
        """Load ``path`` (raises WebConfigError: the process should not start)."""
        config = read_web_config(path)
        tls = _materialize(config, allow_basic_auth)
        log.info(
            "%s: TLS is %s, basic auth is %s (%s)",
            name,
            "on" if tls is not None else "off",
            "on" if config.users else "off",
            path,
        )
        return cls(
            path,
            name,
            _Active.of(config, tls),
            allow_basic_auth=allow_basic_auth,
            wall_clock=wall_clock,
            on_reload=on_reload,
        )

    # --- what the server uses -------------------------------------------------------------

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        """For the listening socket (``TCPSite(ssl_context=...)``): None means plain HTTP."""
        return self._server_context

    @property
    def config(self) -> WebConfig:
        return self._active.config

    def current_ssl_context(self) -> ssl.SSLContext:
        """The context for a new connection, after reloading changed files."""
        self.refresh()
        self._check_expiry()
        context = self._active.ssl_context
        assert context is not None, "TLS was on at start and a reload cannot turn it off"
        return context

    def status(self) -> ReloadStatus:
        return ReloadStatus(
            self.name,
            self._successes,
            self._failures,
            self._last_success,
            self._active.ssl_context is not None,
            self._active.not_after,
        )

    def _check_expiry(self) -> None:
        """Warn once per certificate and state when the one served is expired or expires
        within EXPIRY_WARNING_SECONDS."""
        not_after = self._active.not_after
        if not_after is None:
            return
        left = not_after - self._wall_clock()
        state = "expired" if left <= 0 else "expiring" if left < EXPIRY_WARNING_SECONDS else "valid"
        if (not_after, state) == self._expiry_said:
            return
        self._expiry_said = (not_after, state)
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(not_after))
        if state == "expired":
            log.warning(
                "%s: the TLS certificate served expired at %s (%.1f days ago); "
                "clients that verify it will refuse the connection: replace it (%s)",
                self.name,
                when,
                -left / 86400,
                self.path,
            )
        elif state == "expiring":
            log.warning(
                "%s: the TLS certificate served expires at %s, in %.1f days: renew it (%s)",
                self.name,
                when,
                left / 86400,
                self.path,
            )

    # --- reloading ------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Reload if any file changed since the last attempt; True if a reload succeeded."""
        if _fingerprint(self._watched_files) == self._fingerprint:
            return False
        return self.reload()

    def reload(self) -> bool:
        """Re-read everything now (SIGHUP). On failure keep the last good configuration."""
        named: tuple[str, ...] = ()
        try:
            config = read_web_config(self.path)
            named = config.files
            tls = _materialize(config, self._allow_basic_auth)
            if (tls is None) != (self._active.ssl_context is None):
                raise WebConfigError(
                    self.path, "tls_server_config", "turning TLS on or off needs a restart"
                )
        except WebConfigError as err:
            # Watch what the failed file names too, so that adding a missing file is seen.
            self._watch(self.path, *self._active.config.files, *named)
            self._failures += 1
            log.error("%s: web config reload failed, keeping the previous one: %s", self.name, err)
            self._notify()
            return False
        self._active = _Active.of(config, tls)
        self._watch(self.path, *config.files)
        self._successes += 1
        self._last_success = self._wall_clock()
        log.info("%s: web config reloaded from %s", self.name, self.path)
        self._check_expiry()
        self._notify()
        return True

    def _watch(self, *files: str) -> None:
        self._watched_files = _unique(files)
        self._fingerprint = _fingerprint(self._watched_files)

    def _notify(self) -> None:
        if self._on_reload is not None:
            self._on_reload(self.status())

    # --- aiohttp ----------------------------------------------------------------------------

    def install(
        self,
        app: web.Application,
        *,
        open_paths: Iterable[str] = (),
        bearer_paths: Iterable[str] = (),
    ) -> None:
        """Add basic auth, allowed-SAN checks and the configured headers to ``app``
        (before it starts). ``open_paths`` skip basic auth; so do ``bearer_paths``, which
        check their own bearer token."""
        skip_auth = frozenset(open_paths) | frozenset(bearer_paths)

        @web.middleware
        async def guard(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            self.refresh()
            config = self._active.config
            if config.tls.client_allowed_sans and not _client_san_allowed(
                request, config.tls.client_allowed_sans
            ):
                return web.Response(status=403, text="Forbidden\n", headers={"Connection": "close"})
            if config.users and request.path not in skip_auth:
                verdict = await self.verifier.verify(
                    request.headers.get("Authorization"), config.users
                )
                if verdict is Verdict.BUSY:
                    return web.Response(
                        status=429, text="Too Many Requests\n", headers={"Retry-After": "1"}
                    )
                if verdict is Verdict.DENIED:
                    return web.Response(
                        status=401, text="Unauthorized\n", headers={"WWW-Authenticate": "Basic"}
                    )
            return await handler(request)

        async def add_headers(_request: web.Request, response: web.StreamResponse) -> None:
            for header, value in self._active.config.headers:
                response.headers[header] = value

        app.middlewares.append(guard)
        app.on_response_prepare.append(add_headers)


def _client_san_allowed(request: web.Request, allowed: tuple[str, ...]) -> bool:
    """exporter-toolkit's client_allowed_sans: a DNS, email, IP or URI SAN of the verified
    client certificate equals one of ``allowed`` (IP addresses compared as addresses)."""
    transport = request.transport
    peer = transport.get_extra_info("peercert") if transport is not None else None
    if not peer:
        return False
    wanted = {_normal_san(value) for value in allowed}
    for kind, value in peer.get("subjectAltName", ()):
        if kind in ("DNS", "email", "URI", "IP Address") and _normal_san(value) in wanted:
            return True
    return False


def _normal_san(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        return value


def _unique(files: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(files))


def _fingerprint(files: Iterable[str]) -> Fingerprint:
    out: list[tuple[str, tuple[int, int, int, int, int] | None]] = []
    for path in files:
        try:
            info = os.stat(path)
        except OSError:
            out.append((path, None))
            continue
        out.append(
            (path, (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
        )
    return tuple(out)


def install_sighup(listeners: Iterable[WebListener], loop: Any = None) -> bool:
    """SIGHUP re-reads every listener's web config. False where signals cannot be caught
    (not the main thread, or no SIGHUP on this platform)."""
    chosen = list(listeners)
    if not chosen or not hasattr(signal, "SIGHUP"):
        return False
    loop = loop or asyncio.get_running_loop()

    def reload_all() -> None:
        for listener in chosen:
            listener.reload()

    try:
        loop.add_signal_handler(signal.SIGHUP, reload_all)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True
