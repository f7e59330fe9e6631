"""LiteLLM ``custom_auth`` hook standing in for its key database in the end-to-end test.

Virtual keys, and so key and team aliases, need LiteLLM's database (Postgres plus Prisma
engines fetched at run time, neither available here). This hook returns the same
``UserAPIKeyAuth`` record a database lookup returns, so LiteLLM fills the payload's
``metadata.user_api_key_alias`` and ``metadata.user_api_key_team_alias`` as it would with
real virtual keys. LiteLLM loads it from the directory of its config file; it runs inside
the LiteLLM venv, never in the test's interpreter.
"""

from __future__ import annotations

import json
import os
from typing import Any

# {"<api key>": {"key_alias": ..., "team_id": ..., "team_alias": ...}}, set by the test.
KEYS_ENV = "VLLM_CACHE_EXPORTER_TEST_LITELLM_KEYS"


async def user_api_key_auth(request: Any, api_key: str) -> Any:
    """LiteLLM's custom_auth signature: the request, the bearer key -> its key record."""
    # Imported here: this module's constant is also read by the test, which has no LiteLLM.
    from fastapi import HTTPException
    from litellm.proxy._types import UserAPIKeyAuth

    keys = json.loads(os.environ.get(KEYS_ENV, "{}"))
    if api_key == os.environ.get("LITELLM_MASTER_KEY"):
        return UserAPIKeyAuth(api_key=api_key)
    record = keys.get(api_key)
    if record is None:
        raise HTTPException(status_code=401, detail="unknown key")
    return UserAPIKeyAuth(api_key=api_key, **record)
