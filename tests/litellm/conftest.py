"""Session fixture for the LiteLLM end-to-end test: the LiteLLM venv, installed once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.litellm.bootstrap import BootstrapError, ensure_litellm


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def litellm_venv(pytestconfig: pytest.Config) -> Path:
    """The venv of a ready LiteLLM proxy. An install that fails fails the test in CI and
    skips it elsewhere (a laptop without the registry), saying why either way."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def announce(message: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"\n{message}", flush=True)

    try:
        return ensure_litellm(announce=announce)
    except BootstrapError as err:
        message = f"cannot prepare LiteLLM for the end-to-end test: {err}"
        if _in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
