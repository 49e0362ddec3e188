"""What the server tests share: an OpenAI client on the module's `server` (a ServerThread)."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
