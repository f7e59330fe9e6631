"""docs/usage.md's LiteLLM setup, checked without LiteLLM (this runs under ``-m "not litellm"``
too): the end-to-end test starts LiteLLM from exactly this text, so these are the settings
that test proved, kept from being edited away unnoticed."""

from __future__ import annotations

import pytest

from tests.litellm.bootstrap import LITELLM_REQUIREMENT, LITELLM_VERSION
from tests.litellm.proxy import (
    EXPORTER_PLACEHOLDER,
    README,
    proxy_config,
    readme_environment,
)


def test_readme_litellm_config_has_what_the_proxy_needs():
    config = proxy_config("http://127.0.0.1:1", "http://127.0.0.1:2")
    settings = config["litellm_settings"]
    assert settings["request_correlation_in_logs"] is True  # session_id in the payload
    assert settings["turn_off_message_logging"] is True
    (name,) = settings["callbacks"]
    callback = config["callback_settings"][name]
    assert callback["callback_type"] == "generic_api"
    # LiteLLM 1.108.7 refuses to start when a generic_api callback has no headers key.
    assert callback["headers"] == {}
    assert callback["endpoint"] == "http://127.0.0.1:2/v1/usage?format=litellm"
    assert set(callback["event_types"]) == {"llm_api_success", "llm_api_failure"}
    (model,) = config["model_list"]
    assert model["litellm_params"]["model"].startswith("hosted_vllm/")
    assert model["litellm_params"]["api_base"] == "http://127.0.0.1:1/v1"


def test_readme_litellm_environment_carries_the_token_and_a_master_key():
    environment = readme_environment(
        {"LITELLM_MASTER_KEY": "abc", "GENERIC_LOGGER_HEADERS": "the-token"}
    )
    assert environment == {
        "LITELLM_MASTER_KEY": "sk-abc",
        "GENERIC_LOGGER_HEADERS": "Authorization=Bearer the-token",
    }


def test_readme_names_the_tested_litellm_version():
    text = README.read_text(encoding="utf-8")
    assert f"Known to work: LiteLLM {LITELLM_VERSION} " in text
    assert f"`pip install '{LITELLM_REQUIREMENT}'`" in text


def test_a_readme_config_without_the_placeholder_is_refused():
    """Else the test would point LiteLLM at a host that only exists in docs/usage.md."""
    section = README.read_text(encoding="utf-8").split("<!-- litellm:begin -->", 1)[1]
    edited = "<!-- litellm:begin -->" + section.replace(
        EXPORTER_PLACEHOLDER, "http://exporter:10123"
    )
    with pytest.raises(ValueError, match="vllm-cache-exporter:10123"):
        proxy_config("http://127.0.0.1:1", "http://127.0.0.1:2", readme=edited)
