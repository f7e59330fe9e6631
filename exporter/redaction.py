"""How a secret is shown, wherever it would be: never, at most as a short hash.

A leaf module (it imports nothing of ours) so that readers, signals and the top all hide
secrets the same way:

- an API key that names a caller becomes ``key-`` and 12 hex digits of its SHA-256, the same
  whichever reader saw it, so an operator can tell keys apart and alias the hash to a name,
  and nobody can recover the key from a label;
- a URL keeps its scheme, host, port and path, but its user info and credential-like query
  parameters read ``redacted``: one rule for every place a URL is shown.
"""

from __future__ import annotations

import hashlib
import logging
import re

KEY_LABEL_PREFIX = "key-"
KEY_HASH_DIGITS = 12  # 48 bits: distinct per key in practice, useless for recovering it


def key_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def key_label(secret: str) -> str:
    """The only form in which an API key may ever appear: ``key-`` + 12 hex of its SHA-256."""
    return KEY_LABEL_PREFIX + key_digest(secret)[:KEY_HASH_DIGITS]


# Query parameters whose value is a credential, by name (compared in lower case).
SECRET_PARAMETERS = frozenset(
    {
        "api_key",
        "apikey",
        "api-key",
        "key",
        "token",
        "access_token",
        "auth",
        "authorization",
        "password",
        "passwd",
        "pwd",
        "secret",
        "client_secret",
        "signature",
        "sig",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "session_token",
    }
)
REDACTED = "redacted"
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@\s]+)@")
_QUERY_PARAM = re.compile(r"(?P<lead>[?&])(?P<name>[^=&#\s]+)=(?P<value>[^&#\s]*)")


def _redact_parameter(match: re.Match[str]) -> str:
    if match.group("name").lower() in SECRET_PARAMETERS:
        return f"{match.group('lead')}{match.group('name')}={REDACTED}"
    return match.group(0)


def redact_url(url: str) -> str:
    """A URL as it may be shown (labels, the status page, logs, --check-config): user info
    and credential-like query parameters replaced, everything else kept, so targets stay
    distinguishable. ``http://admin:pw@vllm:8000/metrics?api_key=k`` becomes
    ``http://redacted@vllm:8000/metrics?api_key=redacted``."""
    return redact_text(url)


def redact_text(text: str) -> str:
    """Every URL in a free text (a log line, an error message) as ``redact_url`` shows it."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda match: f"{match.group('scheme')}{REDACTED}@", text)
    return _QUERY_PARAM.sub(_redact_parameter, text)


class RedactingLogs(logging.Filter):
    """Rewrites every log record with its URLs redacted, whoever logged it (aiohttp and
    asyncio name URLs in their errors too). Put on the handlers that write records."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            formatter = logging.Formatter()
            record.exc_text = redact_text(formatter.formatException(record.exc_info))
        return True
