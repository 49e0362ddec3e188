"""SGLang's runtime protocol on the real server over a tiny random-weight engine: the routes its
client and launcher call, every sampling_params key its client sends, streaming logprobs."""

from __future__ import annotations

import json
from pathlib import Path
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from radix_backend.server import ServerThread, create_app  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(create_app(engine)) as srv:
        yield srv.url


def _generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_info_routes_sglang_calls(url, engine):
    for path in ("/server_info", "/get_server_info"):
        assert httpx.get(url + path).json()["context_length"] == engine.context_length
    host_dir = str(Path(engine.model_id).parent)  # the tiny model lives in a host temp dir
    for path in ("/model_info", "/get_model_info", "/server_info", "/v1/models"):
        info = httpx.get(url + path).json()
        assert "/.cache/" not in json.dumps(info) and host_dir not in json.dumps(info)
        if "model_path" in info:  # the model by its own name, not where it lies on the host
            assert info["model_path"] == Path(engine.model_id).name
    assert httpx.get(url + "/health_generate", timeout=60).json() == {"status": "ok"}
    old = httpx.post(url + "/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"})
    assert old.status_code == 400 and "not supported" in old.json()["error"]["message"]


def test_model_path_is_the_name_the_model_was_given_not_a_cache_path(url):
    from radix_backend.server.state import ServerState

    from fakes import CharEngine

    embedded = CharEngine()
    embedded.model_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    state = ServerState(embedded, None, None)
    assert state.model_path == state.model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    embedded.model_id = "/home/someone/models/tiny-llama"  # a checkpoint dir: shown by its own name only
    state = ServerState(embedded, None, None)
    assert state.model_path == state.model_name == "tiny-llama"
    assert state.check_model("/home/someone/models/tiny-llama") == "tiny-llama"  # vLLM clients send the path


def test_every_key_sglangs_client_sends_is_accepted(url):
    # RuntimeEndpoint.generate's body for gen("x", max_tokens=4), SGLang 0.5.23 (SglSamplingParams.to_srt_kwargs)
    params = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 4,
              "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0,
              "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
              "ignore_eos": True, "regex": None, "json_schema": None}
    r = _generate(url, text="Hello", sampling_params=params)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("key, value, message", [
    ("beam_width", 4, "beam search"),
    ("structural_tag", "{}", "structural tags"),
    ("custom_params", {"a": 1}, "custom logit processors"),
    ("frobnicate", 1, "unknown sampling_params keys"),
])
def test_keys_we_do_not_support_are_a_400_that_names_them(url, key, value, message):
    r = _generate(url, text="Hi", sampling_params={"max_new_tokens": 2, key: value})
    assert r.status_code == 400 and message in r.json()["error"]["message"] and key in r.json()["error"]["message"]


def test_min_new_tokens_and_stop_regex_are_honoured(url):
    base = {"max_new_tokens": 24, "temperature": 0}
    free = _generate(url, text="The list:", sampling_params=base).json()
    text = free["text"]
    assert len(free["output_ids"]) == 24 and text  # reference run: no stops

    first_char = re.escape(text[0])
    stopped = _generate(url, text="The list:", sampling_params={**base, "stop_regex": first_char}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first_char}
    assert len(stopped["output_ids"]) < 24 and re.search(first_char, stopped["text"])

    held = _generate(url, text="The list:", sampling_params={**base, "stop_regex": first_char,
                                                             "min_new_tokens": 10}).json()
    assert len(held["output_ids"]) >= 10  # the early match does not count before 10 tokens


def test_min_new_tokens_keeps_stop_tokens_out(url):
    base = {"max_new_tokens": 6, "temperature": 0}
    first = _generate(url, text="abc", sampling_params=base).json()["output_ids"][0]
    stops = {**base, "stop_token_ids": [first]}
    assert len(_generate(url, text="abc", sampling_params=stops).json()["output_ids"]) == 1
    held = _generate(url, text="abc", sampling_params={**stops, "min_new_tokens": 6}).json()["output_ids"]
    assert len(held) == 6 and first not in held  # masked while below the minimum


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("incremental", [False, True])
def test_streamed_logprobs_cumulative_or_incremental(url, incremental):
    body = {"text": "Once upon", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "stream": True, "return_logprob": True, "incremental_streaming_output": incremental}
    events = _events(url, body)
    final = _generate(url, **{**body, "stream": False}).json()
    metas = [e["meta_info"] for e in events]
    assert [m["completion_tokens"] for m in metas] == sorted(m["completion_tokens"] for m in metas)
    assert metas[-1]["completion_tokens"] == 6 and metas[-1]["output_token_logprobs_length"] == 6
    if incremental:
        got = [entry for m in metas for entry in m["output_token_logprobs"]]
        assert "".join(e["text"] for e in events) == final["text"]
    else:
        got = metas[-1]["output_token_logprobs"]
        assert events[-1]["text"] == final["text"]
    assert [e[1] for e in got] == [e[1] for e in final["meta_info"]["output_token_logprobs"]]
    assert [e[0] for e in got] == pytest.approx([e[0] for e in final["meta_info"]["output_token_logprobs"]], abs=1e-4)


def test_the_sglang_wire_format_round_trips():
    """What the DSL's RuntimeEndpoint sends is what the server reads back, and what the server's
    /generate writes is what RuntimeEndpoint reads: one encoder beside each decoder."""
    from radix_backend.outputs import GenerateOutput, RequestMeta, TokenLogprob
    from radix_backend.sampling_params import SamplingParams, sglang_sampling_params, to_sglang_sampling_params
    from radix_backend.sglang_meta import LogprobOptions, finished_meta, output_from_sglang

    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5, stop=["\n"], stop_token_ids=[3],
                            min_new_tokens=1, ignore_eos=True, seed=11, json_schema={"type": "object"})
    decoded, n = sglang_sampling_params(to_sglang_sampling_params(params))
    assert n == 1 and decoded.json_schema == '{"type": "object"}'
    assert decoded.copy(json_schema=params.json_schema) == params
    out = GenerateOutput(text="hi", token_ids=[5, 6], finish_reason="stop",
                         meta=RequestMeta(prompt_tokens=4, cached_tokens=2, completion_tokens=2, matched_stop="\n"),
                         logprobs=[TokenLogprob(5, -0.5), TokenLogprob(6, -1.5)])
    wire = {"text": out.text, "output_ids": out.token_ids,
            "meta_info": finished_meta(out, "rid-1", LogprobOptions(return_logprob=True))}
    back = output_from_sglang(wire)
    assert (back.text, back.token_ids, back.finish_reason, back.request_id) == ("hi", [5, 6], "stop", "rid-1")
    assert (back.meta.prompt_tokens, back.meta.cached_tokens, back.meta.matched_stop) == (4, 2, "\n")
    assert [(lp.token_id, lp.logprob) for lp in back.logprobs] == [(5, -0.5), (6, -1.5)]
