"""The compose stack's alert receiver: Alertmanager's webhooks, written to the log.

deploy/alertmanager.yml sends pages and tickets to http://alert-webhook:8080/{page,ticket}.
In the demo there is no pager to reach, so this tiny server takes those webhooks and prints
one line per alert (`docker compose logs -f alert-webhook`), which is the "default receiver
that logs alerts". It needs no image of its own: compose runs it with the exporter's image,
whose Python has everything used here (standard library only).

A body that is not an Alertmanager notification is answered 400 and logged as such; it
cannot stop the server.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 4 * 1024 * 1024


def alert_lines(receiver: str, notification: Any) -> list[str]:
    """One log line per alert of an Alertmanager webhook notification (version 4)."""
    if not isinstance(notification, dict) or not isinstance(notification.get("alerts"), list):
        raise ValueError("not an Alertmanager notification (no alerts list)")
    lines = []
    for alert in notification["alerts"]:
        if not isinstance(alert, dict):
            raise ValueError("an alert is not an object")
        labels = alert.get("labels", {})
        annotations = alert.get("annotations", {})
        if not isinstance(labels, dict) or not isinstance(annotations, dict):
            raise ValueError("an alert's labels or annotations are not objects")
        name = labels.get("alertname", "?")
        others = ",".join(f"{key}={value}" for key, value in sorted(labels.items())
                          if key != "alertname")
        text = annotations.get("description") or annotations.get("summary") or ""
        line = f"{receiver} {str(alert.get('status', '?')).upper()} {name} {{{others}}} {text}"
        # One alert, one line: a newline in a label or a description cannot forge another.
        lines.append(" ".join(line.split()))
    return lines


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        receiver = self.path.strip("/") or "webhook"
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_BODY_BYTES:
                raise ValueError(f"body of {length} bytes")
            lines = alert_lines(receiver, json.loads(self.rfile.read(length)))
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            print(f"{receiver} rejected: {err}", file=sys.stderr, flush=True)
            self.send_error(400, str(err))
            return
        for line in lines:
            print(line, flush=True)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Alerts are logged above; access lines would only bury them."""


def main() -> None:
    host = os.environ.get("ALERT_LOGGER_HOST", "0.0.0.0")
    port = int(os.environ.get("ALERT_LOGGER_PORT", "8080"))
    server = ThreadingHTTPServer((host, port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `docker compose stop`
    print(f"alert-logger: listening on {host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
