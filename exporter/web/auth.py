"""HTTP basic auth against ``basic_auth_users`` (bcrypt hashes), as exporter-toolkit does it.

bcrypt is slow on purpose (about 0.1 s at cost 10 here), so, like the toolkit:

- a verified (user, password, stored hash) is remembered, keyed by a SHA-256 of the three,
  so a scraper that sends the same credentials every 15 s costs one bcrypt per hash change;
  only successes are kept (a flood of wrong guesses cannot push out the good entries), at
  most ``cache_size`` of them, least recently used dropped first;
- one bcrypt runs at a time, in a worker thread so the event loop keeps serving; at most
  ``max_waiting`` requests wait for their turn, later ones get 429 at once;
- an unknown user is checked against a fixed hash of the same cost as the toolkit's, so
  the answer takes as long as for a known user with a wrong password, and the user name is
  compared in constant time against every configured name.

bcrypt reads at most 72 bytes of a password; Go's bcrypt ignores the rest, and so does this
(pyca/bcrypt 5 would refuse such a password instead).
"""

from __future__ import annotations

import asyncio
import binascii
import enum
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Callable, Sequence

import bcrypt

# bcrypt of "fakepassword" at cost 10: exporter-toolkit's stand-in for unknown users.
UNKNOWN_USER_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
BCRYPT_MAX_PASSWORD_BYTES = 72
CACHE_SIZE = 100
MAX_WAITING = 32


class Verdict(enum.Enum):
    ALLOWED = "allowed"
    DENIED = "denied"  # no, malformed or wrong credentials: 401
    BUSY = "busy"  # too many requests already waiting for a bcrypt check: 429


def parse_basic(header: str | None) -> tuple[bytes, bytes] | None:
    """``Authorization: Basic base64(user:password)`` -> (user, password) bytes, or None."""
    if not header:
        return None
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = binascii.a2b_base64(encoded.strip().encode("ascii"))
    except (binascii.Error, UnicodeEncodeError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    return user, password


class PasswordVerifier:
    """Checks Basic credentials against a user table; one per listener, shared by reloads."""

    def __init__(
        self,
        check: Callable[[bytes, bytes], bool] = bcrypt.checkpw,
        cache_size: int = CACHE_SIZE,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self._check = check
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._cache_size = cache_size
        self._max_waiting = max_waiting
        self._waiting = 0
        self._lock = asyncio.Lock()
        self.bcrypt_checks = 0  # how many bcrypt comparisons ran (the cache's proof)

    async def verify(self, header: str | None, users: Sequence[tuple[str, bytes]]) -> Verdict:
        credentials = parse_basic(header)
        if credentials is None:
            return Verdict.DENIED
        user, password = credentials
        stored = _lookup(users, user)
        hashed = stored if stored is not None else UNKNOWN_USER_HASH
        password = password[:BCRYPT_MAX_PASSWORD_BYTES]
        key = _cache_key(user, password, hashed)
        if stored is not None and key in self._cache:
            self._cache.move_to_end(key)
            return Verdict.ALLOWED
        if self._waiting >= self._max_waiting:
            return Verdict.BUSY
        self._waiting += 1
        try:
            async with self._lock:
                matches = await asyncio.get_running_loop().run_in_executor(
                    None, self._compare, password, hashed
                )
        finally:
            self._waiting -= 1
        if not (matches and stored is not None):
            return Verdict.DENIED
        self._cache[key] = None
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return Verdict.ALLOWED

    def _compare(self, password: bytes, hashed: bytes) -> bool:
        self.bcrypt_checks += 1
        try:
            return self._check(password, hashed)
        except ValueError:  # a hash bcrypt cannot read: never a match
            return False


def _lookup(users: Sequence[tuple[str, bytes]], user: bytes) -> bytes | None:
    """The stored hash for ``user``, comparing against every name in constant time."""
    wanted = hashlib.sha256(user).digest()
    found = None
    for name, hashed in users:
        if hmac.compare_digest(hashlib.sha256(name.encode("utf-8")).digest(), wanted):
            found = hashed
    return found


def _cache_key(user: bytes, password: bytes, hashed: bytes) -> bytes:
    digest = hashlib.sha256()
    for part in (user, password, hashed):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return digest.digest()
