"""Who sent a request through the tap, without ever keeping the API key.

Order: the configured caller header, else the end user the body names (OpenAI's ``user``
field, Anthropic's ``metadata.user_id``), else a configured alias of the API key, else
``key-`` + a short SHA-256 of the key, else ``anonymous``. The key is the one of
``Authorization: Bearer``, else of ``x-api-key`` (how the ``anthropic`` client sends it).
The end user comes before the key as the more specific name: one key often serves a whole
application. Keys are matched by a prefix of their SHA-256 hex digest, so the operator's
configuration holds no secret either; the raw key only lives in the forwarded header.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from exporter.redaction import key_digest, key_label

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
# A shorter alias prefix would match too many keys to name anyone.
MIN_ALIAS_PREFIX_DIGITS = 8
_HEX = frozenset("0123456789abcdef")


class KeyAliases:
    """``(sha256-hex-prefix, alias)`` pairs; the longest matching prefix wins."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        usable: list[tuple[str, str]] = []
        for prefix, alias in pairs:
            normalized = prefix.strip().lower()
            if len(normalized) < MIN_ALIAS_PREFIX_DIGITS or not set(normalized) <= _HEX:
                # The prefix is a hash, not a secret, so naming it in the log is safe.
                log.warning(
                    "tap: ignoring key alias %r for %r: expected at least %d hex digits "
                    "of the key's SHA-256",
                    prefix,
                    alias,
                    MIN_ALIAS_PREFIX_DIGITS,
                )
                continue
            usable.append((normalized, alias))
        self._pairs = sorted(usable, key=lambda pair: len(pair[0]), reverse=True)

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def lookup(self, digest: str) -> str | None:
        for prefix, alias in self._pairs:
            if digest.startswith(prefix):
                return alias
        return None


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header (a bare key is accepted too)."""
    if not authorization:
        return None
    scheme, _, rest = authorization.strip().partition(" ")
    key = rest.strip() if scheme.lower() == "bearer" else authorization.strip()
    return key or None


def resolve_caller(
    headers: Mapping[str, str], user: Any, caller_header: str, aliases: KeyAliases
) -> str:
    """The caller name for one request (never the key itself); ``user`` is the value of the
    body's top-level ``user`` field (None when it has none)."""
    return resolve_caller_of(headers, user, caller_header, aliases)[0]


def resolve_caller_of(
    headers: Mapping[str, str], user: Any, caller_header: str, aliases: KeyAliases
) -> tuple[str, bool]:
    """``resolve_caller``, and whether the name is the tap's own for the request's key (its
    ``key-`` hash or the key's alias) rather than one the client gave (the caller header,
    the body's user): only the tap's own may have the form reserved to the exporter
    (``exporter.usage.event.is_reserved_caller``), since an alias of that form
    (--callers.alias) must rename only a key the exporter hashed."""
    named = headers.get(caller_header, "").strip() if caller_header else ""
    if named:
        return named, False
    if isinstance(user, str) and user.strip():
        return user.strip(), False
    key = bearer_key(headers.get("Authorization")) or headers.get("x-api-key", "").strip()
    if not key:
        return ANONYMOUS, False
    digest = key_digest(key)
    return aliases.lookup(digest) or key_label(key), True
