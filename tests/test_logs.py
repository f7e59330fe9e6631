"""Log lines with key=value fields (--log.format logfmt, the default) or one JSON object a
line (json): time, level, source, msg, extra fields, err; redacted before they are written."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys

import pytest

from exporter import logs
from exporter.redaction import RedactingLogs


@pytest.fixture
def captured() -> io.StringIO:
    stream = io.StringIO()
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    logs.setup("info", "logfmt", (RedactingLogs(),))
    root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
    yield stream
    root.handlers[:] = saved
    root.setLevel(level)


def record(
    message: str, *args: object, exc: BaseException | None = None, **extra: object
) -> logging.LogRecord:
    made = logging.LogRecord(
        "exporter.tap",
        logging.WARNING,
        __file__,
        1,
        message,
        args,
        (type(exc), exc, exc.__traceback__) if exc else None,
    )
    made.created, made.msecs = 1_796_155_301.25, 250.0
    for key, value in extra.items():
        setattr(made, key, value)
    return made


def parse_logfmt(line: str) -> dict[str, str]:
    """A reference logfmt reader: bare values, or JSON strings in double quotes."""
    fields = {}
    for match in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|[^ ]*)', line):
        value = match.group(2)
        fields[match.group(1)] = json.loads(value) if value.startswith('"') else value
    return fields


def test_logfmt_has_the_fields_and_quotes_what_needs_it():
    line = logs.LogfmtFormatter().format(
        record('upstream %s said "no" = 502', "vllm", target="http://v:8000", calls=3)
    )
    assert line.startswith("time=2026-12-01T20:01:41.250Z level=warning source=exporter.tap ")
    assert parse_logfmt(line) == {
        "time": "2026-12-01T20:01:41.250Z",
        "level": "warning",
        "source": "exporter.tap",
        "msg": 'upstream vllm said "no" = 502',
        "target": "http://v:8000",
        "calls": "3",
    }
    assert "\n" not in logs.LogfmtFormatter().format(record("two\nlines"))


def test_json_is_one_object_a_line_with_the_traceback_as_err():
    try:
        raise ValueError("boom")
    except ValueError as err:
        line = logs.JsonFormatter().format(record("failed", exc=err, listener="tap"))
    assert "\n" not in line
    obj = json.loads(line)
    assert (obj["level"], obj["source"], obj["msg"], obj["listener"]) == (
        "warning",
        "exporter.tap",
        "failed",
        "tap",
    )
    assert obj["err"].startswith("Traceback") and "ValueError: boom" in obj["err"]


def test_what_is_written_is_redacted(captured):
    logging.getLogger("exporter.engine").warning("cannot read %s", "http://u:secret@h:1/m")
    line = captured.getvalue()
    assert "secret" not in line and "level=warning" in line and "source=exporter.engine" in line


@pytest.mark.parametrize("log_format", ["logfmt", "json"])
def test_the_exporter_logs_in_the_format_asked_for(log_format):
    """The running exporter's first line (the event loop it runs on), as it writes it."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter",
            "--log.format",
            log_format,
            "--web.listen-address",
            "127.0.0.1:0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline().strip()  # a blocking read: the line is the event
    finally:
        process.terminate()
        process.wait(timeout=30)
    fields = json.loads(line) if log_format == "json" else parse_logfmt(line)
    assert (fields["level"], fields["source"]) == ("info", "exporter.runtime"), line
    assert fields["msg"].startswith("event loop:")
    assert line.startswith("{" if log_format == "json" else "time=")
