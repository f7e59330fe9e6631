"""A venv with the real client libraries agents use, exactly pinned, created once and reused.

Where: ``VLLM_CACHE_EXPORTER_CLIENTS_VENV``, else ``<repo>/.venv-clients`` (git-ignored); the
install log is ``<venv>-install.log`` beside it. What: the ``openai`` and ``anthropic``
Python SDKs at the versions below (about 110 MB with httpx and pydantic; 10-20 s). The
clients run in their own interpreter, as an agent does (``tests/clients/agent.py``): their
dependency pins never meet the exporter's, and the test's process only serves the exporter
and the tap.

Run ``python -m tests.clients.bootstrap`` to prepare it ahead of a test run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tests.pinned_venv import BootstrapError, PinnedVenv

OPENAI_VERSION = "3.57.0"
ANTHROPIC_VERSION = "2.15.0"
CLIENTS = PinnedVenv(
    requirements=(f"openai=={OPENAI_VERSION}", f"anthropic=={ANTHROPIC_VERSION}"),
    env_var="VLLM_CACHE_EXPORTER_CLIENTS_VENV",
    default_name=".venv-clients",
    check=f"""
import importlib.metadata as metadata
assert metadata.version("openai") == {OPENAI_VERSION!r}, metadata.version("openai")
assert metadata.version("anthropic") == {ANTHROPIC_VERSION!r}, metadata.version("anthropic")
""",
    size="110 MB",
    seconds=20,
)

__all__ = ["CLIENTS", "BootstrapError", "ensure_clients"]


def ensure_clients(venv: Path | None = None, announce: Callable[[str], None] = print) -> Path:
    """The python of a ready clients venv, installing it first (and saying so) if needed."""
    return CLIENTS.python(CLIENTS.ensure(venv, announce))


if __name__ == "__main__":
    sys.exit(CLIENTS.main())
