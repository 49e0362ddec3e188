"""conftest.py for guidance's own model-integration tests, run against `RadixGuidance`.

tests/adapters/test_guidance_upstream.py copies guidance's `tests/` tree (tag 0.3.1) into a temporary
directory, replaces guidance's conftest.py with this file and runs pytest there. Guidance's
tests ask for a `selected_model` fixture ("a live model supported by guidance"); here it is
`RadixGuidance` on the embedded SmolLM2, so every test drives our adapter and engine.
Known failures that are the 135M model's content, not the adapter, are xfailed below with reasons.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

SELECTED_MODEL_NAME = "radix_smollm2_135m_cpu"

# test id (relative to guidance's tests/) -> why it does not run here at all
DESELECTED: dict[str, str] = {
    "model_integration/test_tokenizers.py": (
        "downloads gpt2 / phi tokenizers from the Hugging Face Hub (offline here); it tests those "
        "HF tokenizers, not a model backend"),
}

# test id prefix -> why the 135M model's answer (not our adapter) can fail it
CONTENT_XFAILS: dict[str, str] = {
    "model_integration/library/test_subgrammar.py::test_greedy_json_object": (
        "SmolLM2-135M, greedy, repeats '2018-01-01' inside the object's first key until the "
        "subgrammar's 1000-token cap, so the JSON never closes; every byte it wrote is what the "
        "JSON subgrammar allows (the constraint held, the model's answer is what fails)"),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "resource_intensive: guidance's marker for long-prompt tests")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--selected_model", action="store", default=SELECTED_MODEL_NAME,
                     help="kept for guidance's tests; only the radix backend is offered here")


def pytest_ignore_collect(collection_path, config):  # noqa: ANN001
    rel = collection_path.as_posix().split("/tests/", 1)[-1]
    return True if rel in DESELECTED else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        test_id = item.nodeid.split("tests/", 1)[-1]
        for prefix, reason in CONTENT_XFAILS.items():
            if test_id.startswith(prefix):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))


@pytest.fixture(scope="session")
def selected_model_name() -> str:
    return SELECTED_MODEL_NAME


@pytest.fixture(scope="session")
def selected_model():  # noqa: ANN201
    """Guidance's "any live model" fixture: our adapter on the embedded SmolLM2 (shared engine)."""
    from radix_backend.adapters.guidance import RadixGuidance

    return RadixGuidance()
