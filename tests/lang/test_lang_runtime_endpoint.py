"""RuntimeEndpoint against the real server (`radix_backend.server`) over a tiny random-weight
engine: the same programs give the same results over HTTP as in process."""

from __future__ import annotations

import pytest

import radix_backend.lang as sgl
from radix_backend import ConstraintError, SamplingParams

pytest.importorskip("httpx")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


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
        assert [e[1] for e in got] == [e[1] for e in want]
        assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-4)


def test_streaming_over_http(endpoint, local, engine):
    @sgl.function
    def chat(s):
        s += sgl.user("hello") + sgl.assistant(sgl.gen("a", max_tokens=10, ignore_eos=True))

    state = chat.run(temperature=0, backend=endpoint, stream=True)
    chunks = list(state.text_iter("a"))
    ref = chat.run(temperature=0, backend=local)
    # text_iter hands over what has come since the reader last looked (as SGLang's does): a fast
    # generation may arrive as one piece, so the increments are counted where the server sends them
    assert chunks and "".join(chunks) == ref["a"]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    events = list(endpoint.generate_stream("The sky is", params))
    assert len([e for e in events if e.token_ids]) > 1  # the prefill's token, then each decode step's
    assert "".join(e.text for e in events) == engine.generate("The sky is", params).text
    assert events[-1].finish_reason == "length"


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


def test_logprob_extras_the_same_in_process_and_over_http(endpoint, local):
    """gen(return_logprob, logprob_start_len, return_text_in_logprobs) as SGLang reports them:
    input_token_logprobs from the start position, (logprob, id, text) entries."""
    @sgl.function
    def prog(s):
        s += "The quick brown fox" + sgl.gen("a", max_tokens=4, ignore_eos=True, return_logprob=True,
                                             logprob_start_len=2, return_text_in_logprobs=True)

    metas = [prog.run(temperature=0, backend=b).get_meta_info("a") for b in (local, endpoint)]
    for meta in metas:
        assert len(meta["output_token_logprobs"]) == 4 and all(len(e) == 3 for e in meta["output_token_logprobs"])
        assert all(isinstance(e[2], str) for e in meta["input_token_logprobs"])
    a, b = metas
    assert [e[1:] for e in a["input_token_logprobs"]] == [e[1:] for e in b["input_token_logprobs"]]
    assert [e[0] for e in a["input_token_logprobs"]] == pytest.approx([e[0] for e in b["input_token_logprobs"]],
                                                                      abs=1e-4)
    assert [e[1:] for e in a["output_token_logprobs"]] == [e[1:] for e in b["output_token_logprobs"]]


def test_streamed_meta_data_over_http(endpoint):
    @sgl.function
    def prog(s):
        s += "Once" + sgl.gen("a", max_tokens=6, ignore_eos=True, return_logprob=True)

    state = prog.run(temperature=0, backend=endpoint, stream=True)
    pieces = list(state.text_iter("a", return_meta_data=True))
    assert pieces[-1][1]["completion_tokens"] == 6
    assert len(pieces[-1][1]["output_token_logprobs"]) == pieces[-1][1]["output_token_logprobs_length"] == 6


def test_programs_reach_the_backend_as_its_endpoint_on_both_backends(endpoint, local):
    """SGLang programs call `runtime.endpoint.get_model_name()` (and the like): in process and over
    HTTP the backend is its own endpoint and names the model as the server does."""
    assert endpoint.endpoint is endpoint and local.endpoint is local
    assert local.endpoint.get_model_name() == endpoint.endpoint.get_model_name()
    assert "/" not in local.get_model_name()  # a local checkpoint by its own name, never a host path
    for backend in (local, endpoint):  # the rest of SGLang's backend surface: refused, with the reason
        with pytest.raises(sgl.UnsupportedFeatureError, match="join"):
            backend.endpoint.concatenate_and_append(["a"], "b")
        with pytest.raises(sgl.UnsupportedFeatureError, match="flush_cache"):
            backend.endpoint.uncache_prefix("a")
        with pytest.raises(sgl.UnsupportedFeatureError, match="torch.profiler"):
            backend.endpoint.stop_profile()

    @sgl.function
    def named(s):
        s += "Model: " + sgl.global_config.default_backend.endpoint.get_model_name()

    previous = sgl.global_config.default_backend
    try:
        for backend in (local, endpoint):
            sgl.set_default_backend(backend)
            assert named.run().text() == "Model: " + endpoint.get_model_name()
    finally:
        sgl.global_config.default_backend = previous
