"""``--web.config.file``: TLS, basic auth and response headers in exporter-toolkit's format.

A leaf package: it imports nothing else from ``exporter``, so the exporter's listener and
the tap's use it alike. ``config`` reads and validates the file, ``tls`` builds SSL
contexts, ``auth`` checks Basic credentials, ``listener`` keeps one listener's settings
current across reloads and plugs them into aiohttp, ``metrics`` shows the reloads.
"""

from exporter.web.config import WebConfig, WebConfigError, read_web_config
from exporter.web.listener import ReloadStatus, WebListener, install_sighup, load

__all__ = [
    "ReloadStatus",
    "WebConfig",
    "WebConfigError",
    "WebListener",
    "install_sighup",
    "load",
    "read_web_config",
]
