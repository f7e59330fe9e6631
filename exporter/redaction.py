"""How a secret is shown, wherever it would be: never, only as a short hash.

A leaf module (it imports nothing of ours) so that readers, signals and the top all hide
secrets the same way: an API key that names a caller becomes ``key-`` and 12 hex digits of
its SHA-256, the same whichever reader saw it, so an operator can tell keys apart and alias
the hash to a name, and nobody can recover the key from a label.
"""

from __future__ import annotations

import hashlib

KEY_LABEL_PREFIX = "key-"
KEY_HASH_DIGITS = 12  # 48 bits: distinct per key in practice, useless for recovering it


def key_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def key_label(secret: str) -> str:
    """The only form in which an API key may ever appear: ``key-`` + 12 hex of its SHA-256."""
    return KEY_LABEL_PREFIX + key_digest(secret)[:KEY_HASH_DIGITS]
