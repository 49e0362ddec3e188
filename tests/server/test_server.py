"""Server protocol tests against `fakes.CharEngine`: fast, deterministic, no model.

The fake follows the engine seam and holds "KV slots" while a request runs, so disconnect-aborts
are observable. The same behaviours are checked on the real engine in test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from radix_backend.server import ServerThread, create_app

from fakes import CharEngine


@pytest.fixture(scope="module")
def fake() -> CharEngine:
    return CharEngine(delay=0.002)


@pytest.fixture(scope="module")
def server(fake: CharEngine):
    with ServerThread(create_app(fake, served_model_name="fake")) as srv:
        yield srv


def _wait_idle(fake: CharEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while fake.held and time.monotonic() < deadline:
        time.sleep(0.01)


# ---------------------------------------------------------------------------- OpenAI endpoints


def test_models_and_info(server: ServerThread, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["fake"]
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["model_path"] == "fake/model" and info["is_generation"] is True
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_text_usage_and_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r1 = client.completions.create(model="fake", prompt=prompt, max_tokens=10, temperature=0)
    assert r1.choices[0].text == CharEngine.answer_for(prompt)[:10]
    assert r1.choices[0].finish_reason == "length"
    assert r1.usage.prompt_tokens == len(prompt) and r1.usage.completion_tokens == 10
    r2 = client.completions.create(model="fake", prompt=prompt, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == len(prompt)


def test_completion_batch_n_stop_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt=["ab", "cd"], n=2, max_tokens=30, stop=["ipsum"], logprobs=2)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.finish_reason == "stop" and "ipsum" not in c.text and c.text.endswith("lorem ")
        assert c.logprobs.token_logprobs[0] == -0.25 and len(c.logprobs.top_logprobs[0]) == 2
        assert c.logprobs.text_offset[:2] == [0, 1]
    assert r.choices[0].text.startswith("[ab]") and r.choices[2].text.startswith("[cd]")
    assert r.usage.prompt_tokens == 4  # once per prompt, not once per sample


def test_completion_token_id_prompt_and_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model="fake", prompt=[ord("h"), ord("i")], max_tokens=3, echo=True)
    assert r.choices[0].text == "hi" + CharEngine.answer_for("hi")[:3]


def test_chat_completion_and_stream_match(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="fake", messages=msgs, max_tokens=12, temperature=0)
    expected = CharEngine.answer_for(CharEngine().apply_chat_template(msgs))[:12]
    assert full.choices[0].message.content == expected and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="fake", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_default_max_tokens_fills_context(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].finish_reason == "stop"  # the whole scripted answer fits the context window


def test_chat_logprobs_and_response_format(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}], max_tokens=5,
                                       logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and content[0].logprob == -0.25 and len(content[0].top_logprobs) == 1
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "json"}], max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(r.choices[0].message.content) == {"ok": True}


def test_completion_stream_n2(client: openai.OpenAI) -> None:
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model="fake", prompt="zz", max_tokens=6, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] == CharEngine.answer_for("zz")[:6]


def test_async_client_32_concurrent(server: ServerThread) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        async with aclient:
            rs = await asyncio.gather(*(aclient.completions.create(model="fake", prompt=f"q{i:02d}", max_tokens=8)
                                        for i in range(32)))
        return [r.choices[0].text for r in rs]

    texts = asyncio.run(main())
    assert texts == [CharEngine.answer_for(f"q{i:02d}")[:8] for i in range(32)]


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("payload, status, code", [
    ({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
    ({"model": "fake", "prompt": "x" * 390, "max_tokens": 50}, 400, "context_length_exceeded"),
    ({"model": "fake", "prompt": "x", "temperature": -1}, 400, 400),
    ({"model": "fake", "prompt": "x", "top_p": 0}, 400, 400),
    ({"model": "fake"}, 400, 400),
    ({"model": "fake", "prompt": []}, 400, 400),
])
def test_completion_errors(server: ServerThread, payload: dict, status: int, code: Any) -> None:
    r = httpx.post(server.url + "/v1/completions", json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]


def test_malformed_json_and_bad_schema_then_still_serving(server: ServerThread, client: openai.OpenAI) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "fake", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_constraint"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x" * 500}], max_tokens=5)
    assert client.completions.create(model="fake", prompt="ok", max_tokens=2).choices[0].text == "[o"
    assert httpx.get(server.url + "/nope").status_code == 404


# ---------------------------------------------------------------------------- disconnect


def test_disconnect_mid_stream_aborts(server: ServerThread, fake: CharEngine) -> None:
    _wait_idle(fake)
    aborted = fake.aborted
    slow = {"model": "fake", "prompt": "slow", "max_tokens": 100, "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", server.url + "/v1/completions", json=slow) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: ") for line in got)
            assert fake.held  # the request is running
    _wait_idle(fake)
    assert not fake.held and fake.cache_stats().slots_used == 0
    assert fake.aborted == aborted + 1


def test_disconnect_non_streaming_aborts(server: ServerThread, fake: CharEngine) -> None:
    _wait_idle(fake)
    aborted = fake.aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json={"text": "wait", "sampling_params": {"max_new_tokens": 100}},
                   timeout=0.08)
    _wait_idle(fake)
    assert not fake.held and fake.aborted == aborted + 1


# ---------------------------------------------------------------------------- SGLang native


def test_generate_single_batch_ids(server: ServerThread) -> None:
    r = httpx.post(server.url + "/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 5,
                                                                                       "temperature": 0}}).json()
    assert r["text"] == CharEngine.answer_for("abc")[:5]
    meta = r["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5 and "cached_tokens" in meta and meta["id"]
    batch = httpx.post(server.url + "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert [b["text"] for b in batch] == ["[a", "[b"]
    ids = httpx.post(server.url + "/generate", json={"input_ids": [104, 105], "rid": "my-id",
                                                     "sampling_params": {"max_new_tokens": 2}}).json()
    assert ids["text"] == "[h" and ids["output_ids"] == [ord("["), ord("h")] and ids["meta_info"]["id"] == "my-id"
    stop = httpx.post(server.url + "/generate", json={"text": "abc", "sampling_params": {"stop": "lorem"}}).json()
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": "lorem"}


def test_generate_logprobs_like_sglang_select(server: ServerThread) -> None:
    r = httpx.post(server.url + "/generate", json={
        "text": ["pick A", "pick B"], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 4}).json()
    assert len(r) == 2
    inp = r[0]["meta_info"]["input_token_logprobs"]
    assert inp == [[-0.5, ord(" "), " "], [-0.5, ord("A"), "A"]]
    assert r[0]["meta_info"]["output_token_logprobs"] == []
    r = httpx.post(server.url + "/generate", json={"input_ids": [1, 2, 3], "return_logprob": True,
                                                   "logprob_start_len": 0, "top_logprobs_num": 1,
                                                   "sampling_params": {"max_new_tokens": 1}}).json()
    assert [e[0] for e in r["meta_info"]["input_token_logprobs"]] == [None, -0.5, -0.5]
    assert r["meta_info"]["output_token_logprobs"][0][:2] == [-0.25, ord("[")]
    assert r["meta_info"]["output_top_logprobs"][0] == [[-0.25, ord("["), None]]


def test_generate_stream_cumulative(server: ServerThread) -> None:
    events = []
    with httpx.stream("POST", server.url + "/generate", json={"text": "xy", "stream": True,
                                                              "sampling_params": {"max_new_tokens": 4}}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    # SGLang's RuntimeEndpoint reads data["text"][pos:]: text is cumulative.
    assert data[-1]["text"] == CharEngine.answer_for("xy")[:4]
    assert all(data[i + 1]["text"].startswith(data[i]["text"]) for i in range(len(data) - 1))
    assert data[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_errors(server: ServerThread) -> None:
    bad = [{"sampling_params": {}}, {"text": "a", "input_ids": [1]}, {"text": "a", "sampling_params": {"bogus": 1}},
           {"text": "a", "sampling_params": {"temperature": -2}}, {"text": ["a", "b"], "rid": ["x"]}]
    for body in bad:
        r = httpx.post(server.url + "/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], body


# ---------------------------------------------------------------------------- metrics / cache


def test_metrics_and_flush(server: ServerThread, fake: CharEngine, client: openai.OpenAI) -> None:
    client.completions.create(model="fake", prompt="metrics", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("radix_backend_requests_total", "radix_backend_generation_tokens_total",
                 "radix_backend_num_requests_waiting", "radix_backend_generation_tokens_per_second",
                 "radix_backend_cache_hit_rate", "radix_backend_kv_usage", "radix_backend_request_latency_seconds"):
        assert name in text, name
    line = next(ln for ln in text.splitlines()
                if ln.startswith('radix_backend_requests_total{endpoint="/v1/completions",status="200"}'))
    assert float(line.split()[-1]) >= 1
    _wait_idle(fake)
    r = httpx.post(server.url + "/flush_cache")
    assert r.status_code == 200 and not fake.seen
