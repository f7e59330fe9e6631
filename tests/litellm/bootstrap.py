"""A venv with the LiteLLM proxy for the end-to-end test, created once and reused.

Where: ``VLLM_CACHE_EXPORTER_LITELLM_VENV``, else ``<repo>/.venv-litellm`` (git-ignored); the
install log is ``<venv>-install.log`` beside it (git-ignored too). What, as measured on the
CI machine class: ``pip install 'litellm[proxy]==1.108.7'``, about 150 s and 760 MB. The proxy
is a program the test starts, never imported by the test's own interpreter: its dependency
pins would fight the exporter's. A venv that already has exactly that version is reused.

Run ``python -m tests.litellm.bootstrap`` to prepare it ahead of a test run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tests.pinned_venv import BootstrapError, PinnedVenv

LITELLM_VERSION = "1.108.7"
LITELLM_REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"

# Checks without importing litellm (its proxy takes 20-60 s to import on two busy cores):
# the distribution and its version, the proxy's server stack, the console script.
LITELLM = PinnedVenv(
    requirements=(LITELLM_REQUIREMENT,),
    env_var="VLLM_CACHE_EXPORTER_LITELLM_VENV",
    default_name=".venv-litellm",
    check=f"""
import importlib.metadata as metadata, importlib.util as util, pathlib, sys
assert metadata.version("litellm") == {LITELLM_VERSION!r}, metadata.version("litellm")
for name in ("litellm", "fastapi", "uvicorn", "httpx", "yaml"):
    assert util.find_spec(name) is not None, name + " missing"
assert (pathlib.Path(sys.executable).parent / "litellm").exists(), "no litellm script"
""",
    size="760 MB",
    seconds=150,
)

__all__ = ["LITELLM", "BootstrapError", "ensure_litellm"]


def ensure_litellm(venv: Path | None = None, announce: Callable[[str], None] = print) -> Path:
    """The venv of a ready LiteLLM proxy, installing it first (and saying so) if needed."""
    return LITELLM.ensure(venv, announce)


if __name__ == "__main__":
    sys.exit(LITELLM.main())
