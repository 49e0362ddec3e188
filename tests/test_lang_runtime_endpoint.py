"""RuntimeEndpoint against the real server (`radix_backend.server`) over a tiny random-weight
engine: the same programs give the same results over HTTP as in process."""

from __future__ import annotations

import pytest

import radix_backend.lang as sgl
from radix_backend import ConstraintError, Engine

pytest.importorskip("httpx")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as eng:
        yield eng


@pytest.fixture(scope="module")
def endpoint(engine, tiny_llama_dir):
    from radix_backend.server import ServerThread, create_app

    with ServerThread(create_app(engine, model_path=str(tiny_llama_dir))) as srv:
        ep = sgl.RuntimeEndpoint(srv.url)
        yield ep
        ep.shutdown()


@pytest.fixture(scope="module")
def local(engine):
    return sgl.RadixEngineBackend(engine)


@sgl.function
def program(s, topic):
    s += sgl.system("You write short notes.")
    s += sgl.user("Write about " + topic)
    s += sgl.assistant(sgl.gen("note", max_tokens=8))
    s += "Rating:" + sgl.select("rating", [" good", " bad", " fine"])
    forks = s.fork(2)
    forks += lambda i: f"\nAlt {i}:" + sgl.gen("alt", max_tokens=5)
    forks.join()


def test_same_results_over_http_as_in_process(endpoint, local):
    a = program.run(topic="rivers", temperature=0, backend=local)
    b = program.run(topic="rivers", temperature=0, backend=endpoint)
    assert b.text() == a.text()
    assert b["note"] == a["note"] and b["alt"] == a["alt"] and b["rating"] == a["rating"]
    assert b.get_meta_info("rating")["normalized_prompt_logprobs"] == pytest.approx(
        a.get_meta_info("rating")["normalized_prompt_logprobs"], abs=1e-4)
    assert b.get_meta_info("note")["prompt_tokens"] == a.get_meta_info("note")["prompt_tokens"]
    assert endpoint.get_chat_template().role_prefix_and_suffix == local.get_chat_template().role_prefix_and_suffix


def test_unconditional_select_over_http(endpoint, local):
    @sgl.function
    def pick(s):
        s += "Colour:" + sgl.select("c", [" red", " green blue"], choices_method=sgl.unconditional_likelihood_normalized)

    a, b = pick.run(backend=local), pick.run(backend=endpoint)
    assert b["c"] == a["c"]
    for got, want in zip(b.get_meta_info("c")["unconditional_token_logprobs"],
                         a.get_meta_info("c")["unconditional_token_logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_streaming_over_http(endpoint, local):
    @sgl.function
    def chat(s):
        s += sgl.user("hello") + sgl.assistant(sgl.gen("a", max_tokens=10, ignore_eos=True))

    ref = chat.run(temperature=0, backend=local)
    state = chat.run(temperature=0, backend=endpoint, stream=True)
    chunks = list(state.text_iter("a"))
    assert len(chunks) > 1 and "".join(chunks) == ref["a"]


def test_errors_over_http(endpoint):
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("y", regex="(unclosed", max_tokens=3)

    with pytest.raises(ConstraintError):
        bad.run(backend=endpoint)
    assert endpoint.flush_cache() in (True, False)
    assert "cache_stats" in endpoint.get_server_info()


def test_unreachable_server_is_a_clear_error():
    from radix_backend.lang.backends.runtime_endpoint import RuntimeEndpointError

    with pytest.raises(RuntimeEndpointError, match="cannot reach"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9", timeout=2)
