"""Log lines a machine can query: logfmt (the default, as Prometheus' own promslog writes them)
or JSON, one record a line, with key=value fields.

Every line has ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``source`` (the logger)
and ``msg``; a record's ``extra`` fields follow as fields of their own, and an exception's
traceback as ``err``. Redaction (``exporter.redaction.RedactingLogs``) runs before the
formatting, so what is written is the redacted text.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

FORMATS = ("logfmt", "json")
# What every LogRecord has; any other attribute came from ``extra=`` and is a field.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}
# A logfmt value that needs no quotes: no space, quote, equals sign or control character.
_BARE = re.compile(r"[^\s\"=\\\x00-\x1f\x7f]+")


def _time(record: logging.LogRecord) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


def fields(record: logging.LogRecord, formatter: logging.Formatter) -> list[tuple[str, Any]]:
    """A record's fields, in the order they are written."""
    out: list[tuple[str, Any]] = [
        ("time", _time(record)),
        ("level", record.levelname.lower()),
        ("source", record.name),
        ("msg", record.getMessage()),
    ]
    out.extend((key, value) for key, value in vars(record).items() if key not in _STANDARD)
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    if record.exc_text:
        out.append(("err", record.exc_text))
    return out


def logfmt_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text and _BARE.fullmatch(text):
        return text
    return json.dumps(text, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in fields(record, self))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(dict(fields(record, self)), ensure_ascii=False, default=str)


def formatter(name: str) -> logging.Formatter:
    """The formatter of ``--log.format``."""
    return JsonFormatter() if name == "json" else LogfmtFormatter()


def setup(level: str, log_format: str = "logfmt", filters: tuple[logging.Filter, ...] = ()) -> None:
    """Log to standard error at ``level`` in ``log_format``, through ``filters`` (the
    exporter's redaction). aiohttp's access log stays quiet: the exporter counts requests
    itself, and an access line would name every scraper and sender."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format))
    for log_filter in filters:
        handler.addFilter(log_filter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
