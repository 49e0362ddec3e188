"""A served port is safe to expose: API key, POST-only state routes, size limits, strict validation
(every field type-checked, finite and bounded), no host paths; bad input is a 4xx and the server
keeps serving. Runs on the tiny model (real engine, real validation)."""

from __future__ import annotations

import argparse
import json

import httpx
import openai
import pytest

from radix_backend import SamplingParams
from radix_backend.errors import InvalidRequestError, PromptTooLongError
from radix_backend.server import ServerLimits, ServerThread, create_app
from radix_backend.server import app as app_module
from radix_backend.server.guard import API_KEY_ENV

KEY = "sk-test-123"
PROTECTED = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/flush_cache"), ("GET", "/get_server_info"),
             ("GET", "/server_info"), ("GET", "/get_model_info"), ("POST", "/generate"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("GET", "/health_generate")]


@pytest.fixture(scope="module")
def open_url(tiny_engine):
    limits = ServerLimits(max_body_bytes=64 * 1024, max_n=4, max_n_tokens=200)
    with ServerThread(create_app(tiny_engine, limits=limits)) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def keyed_url(tiny_engine):
    with ServerThread(create_app(tiny_engine, api_key=KEY)) as srv:
        yield srv.url


def _model(url: str, **headers) -> str:
    return httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]


def _complete(url: str, **fields) -> httpx.Response:
    body = {"model": _model(url), "prompt": "Hello", "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


# ---------------------------------------------------------------------------- access control


@pytest.mark.parametrize("method, path", PROTECTED)
def test_every_route_but_health_needs_the_key(keyed_url: str, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, keyed_url + path, headers=headers, json={})
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"]
    ok = httpx.request(method, keyed_url + path, headers={"Authorization": f"Bearer {KEY}"}, json={}, timeout=60)
    assert ok.status_code != 401


def test_health_is_open_and_the_openai_client_authenticates(keyed_url: str) -> None:
    assert httpx.get(keyed_url + "/health").status_code == 200
    client = openai.OpenAI(base_url=keyed_url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=_model(keyed_url, Authorization=f"Bearer {KEY}"), prompt="Hi",
                                    max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_key_from_the_environment(tiny_engine, monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    with ServerThread(create_app(tiny_engine)) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_serving_beyond_loopback_without_a_key_warns(monkeypatch, capsys) -> None:
    class Stub:
        def shutdown(self) -> None:
            pass
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setattr(app_module, "build_engine", lambda *a, **k: Stub())
    monkeypatch.setattr(app_module, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(app_module.uvicorn, "run", lambda *a, **k: None)
    app_module.serve(host="0.0.0.0")
    assert "without an API key" in capsys.readouterr().err
    app_module.serve(host="127.0.0.1")
    app_module.serve(host="0.0.0.0", api_key="k")
    assert "without an API key" not in capsys.readouterr().err
    from radix_backend.server import launcher

    monkeypatch.setattr(launcher, "local_fleet", lambda *a, **k: None)
    monkeypatch.setattr(launcher, "run_fleet", lambda fleet: 0)
    for host, key, warned in (("0.0.0.0", None, True), ("127.0.0.1", None, False), ("0.0.0.0", "k", False)):
        args = app_module.add_serve_args(argparse.ArgumentParser()).parse_args(
            ["--dp-size", "2", "--host", host, *(["--api-key", key] if key else [])])
        with pytest.raises(SystemExit):
            app_module.run_serve(args)  # the gateway fleet, as `serve --dp-size 2` starts it
        assert ("without an API key" in capsys.readouterr().err) == warned, host


# ---------------------------------------------------------------------------- exposure


def test_state_changing_routes_are_post_only(open_url: str) -> None:
    assert httpx.get(open_url + "/flush_cache").status_code == 405
    assert httpx.post(open_url + "/flush_cache").status_code == 200


def test_body_size_limit_is_a_413_declared_or_streamed(open_url: str) -> None:
    big = json.dumps({"model": "x", "prompt": "a" * 70_000}).encode()
    r = httpx.post(open_url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while received
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    r = httpx.post(open_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert _complete(open_url).status_code == 200


@pytest.mark.parametrize("fields, needle", [
    ({"n": 5}, "--max-n"),
    ({"n": 10**9}, "--max-n"),
    ({"n": 4, "max_tokens": 60}, "--max-n-tokens"),
])
def test_n_and_total_token_caps(open_url: str, fields: dict, needle: str) -> None:
    r = _complete(open_url, **fields)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_sglang_generate_shares_the_caps(open_url: str) -> None:
    r = httpx.post(open_url + "/generate", json={"text": "Hi", "sampling_params": {"n": 50, "max_new_tokens": 2}})
    assert r.status_code == 400 and "--max-n" in r.json()["error"]["message"]
    r = httpx.post(open_url + "/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 100}})
    assert r.status_code == 400 and "--max-n-tokens" in r.json()["error"]["message"]


def test_no_host_path_in_any_response(open_url: str, tiny_engine) -> None:
    host_dir = str(tiny_engine.model_id).rsplit("/", 1)[0]
    for path in ("/v1/models", "/get_server_info", "/get_model_info", "/server_info", "/model_info"):
        assert host_dir not in httpx.get(open_url + path).text, path
    # a client may still name the model by the path the server was started with
    r = httpx.post(open_url + "/v1/completions", json={"model": str(tiny_engine.model_id), "prompt": "Hi",
                                                        "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- validation


BAD_FIELDS = [
    {"temperature": "hot"}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")},
    {"top_p": 0}, {"min_p": float("-inf")}, {"presence_penalty": float("nan")}, {"frequency_penalty": 3},
    {"repetition_penalty": 1e-39}, {"repetition_penalty": float("inf")}, {"seed": 2 ** 64}, {"seed": "7"},
    {"top_k": 0}, {"max_tokens": -1}, {"max_tokens": 10 ** 12}, {"logit_bias": {"5": float("nan")}},
    {"logit_bias": {"x": 1}}, {"stop": [1, 2]}, {"prompt": "\ud800 lone surrogate"}, {"stop": "\udfff"},
    {"ignore_eos": "yes"}, {"min_tokens": -3},
]


@pytest.mark.parametrize("fields", BAD_FIELDS, ids=[json.dumps(f, default=str)[:40] for f in BAD_FIELDS])
def test_bad_fields_are_400_and_the_server_keeps_serving(open_url: str, fields: dict) -> None:
    body = {"model": _model(open_url), "prompt": "Hello", "max_tokens": 4, "temperature": 0, **fields}
    raw = json.dumps(body, allow_nan=True)  # NaN / Infinity literals, as a careless client sends them
    r = httpx.post(open_url + "/v1/completions", content=raw.encode("utf-8", "surrogatepass"),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, (fields, r.status_code, r.text)
    assert r.json()["error"]["message"]
    assert _complete(open_url).status_code == 200


def test_max_tokens_past_the_context_window_is_a_400_naming_the_limit(open_url: str, tiny_engine) -> None:
    r = _complete(open_url, max_tokens=tiny_engine.context_length)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert str(tiny_engine.context_length) in r.json()["error"]["message"]
    with pytest.raises(PromptTooLongError, match="max_new_tokens"):
        tiny_engine.generate("Hello", SamplingParams(max_new_tokens=tiny_engine.context_length))


def test_sglang_generate_validates_alike(open_url: str) -> None:
    for sp in ({"temperature": float("nan")}, {"repetition_penalty": 1e-39}, {"sampling_seed": 2 ** 70}):
        raw = json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 2, **sp}}, allow_nan=True)
        r = httpx.post(open_url + "/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (sp, r.text)


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("top_p", float("inf")), ("repetition_penalty", 1e-39), ("seed", 2 ** 64),
    ("temperature", "1"), ("max_new_tokens", 2.5), ("logprobs", 1), ("top_logprobs", True),
])
def test_python_api_shares_the_validation(tiny_engine, field: str, value) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        tiny_engine.generate("Hello", SamplingParams(**{"max_new_tokens": 2, field: value}))
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        tiny_engine.generate("bad \ud800", SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------------------- chat roles


def test_unknown_roles_are_400_and_tool_turns_reach_the_template(open_url: str, tiny_engine) -> None:
    model = _model(open_url)
    r = httpx.post(open_url + "/v1/chat/completions", json={"model": model, "messages": [
        {"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "wizard" in r.json()["error"]["message"]
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
    ]
    r = httpx.post(open_url + "/v1/chat/completions",
                   json={"model": model, "messages": messages, "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    from radix_backend.server.state import ServerState
    from radix_backend.server.protocol import ChatCompletionRequest

    rendered = ServerState.chat_messages(ChatCompletionRequest(model=model, messages=messages))
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert json.loads(rendered[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    prompt = tiny_engine.apply_chat_template(rendered)
    assert "get_weather" in prompt and "sunny, 21C" in prompt


# ---------------------------------------------------------------------------- lifecycle


def _gauges(url: str) -> dict[str, float]:
    info = httpx.get(url + "/get_server_info").json()
    return {k: info[k] for k in ("num_requests_waiting", "num_requests_running")}


def test_rejected_requests_leave_no_gauge_raised(open_url: str) -> None:
    model = _model(open_url)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    for stream in (False, True):
        r = httpx.post(open_url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "x"}], "stream": stream,
            "response_format": bad_schema})
        assert r.status_code == 400
        r = httpx.post(open_url + "/generate", json={"text": "x", "stream": stream,
                                                     "sampling_params": {"regex": "(unclosed", "max_new_tokens": 2}})
        assert r.status_code == 400
    assert _gauges(open_url) == {"num_requests_waiting": 0.0, "num_requests_running": 0.0}


def test_a_client_that_drops_a_plain_request_is_an_abort(tiny_engine, caplog) -> None:
    with ServerThread(create_app(tiny_engine)) as srv:
        _drop_a_request(srv.url, tiny_engine, caplog)


def _drop_a_request(open_url: str, tiny_engine, caplog) -> None:
    body = {"model": _model(open_url), "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True}
    with caplog.at_level("ERROR"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(open_url + "/v1/completions", json=body, timeout=0.5)
        for _ in range(200):  # the abort lands within a few scheduler steps
            if tiny_engine.cache_stats().running_requests == 0 and _gauges(open_url)["num_requests_running"] == 0:
                break
            import time
            time.sleep(0.05)
    stats = tiny_engine.cache_stats()
    assert stats.running_requests == 0 and stats.slots_used == stats.cached_slots  # the rest is in the tree
    assert _gauges(open_url) == {"num_requests_waiting": 0.0, "num_requests_running": 0.0}
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "no traceback for a client that left"
    metrics = httpx.get(open_url + "/metrics").text
    assert 'endpoint="/v1/completions",status="499"' in metrics


def test_an_internal_error_names_an_id_not_its_exception_text(open_url: str, tiny_engine, monkeypatch, caplog) -> None:
    """A 500 must not echo exception text (it can hold host paths or other requests' data): the
    client gets an id, the log gets the details under it."""
    def broken(*args, **kwargs):
        raise RuntimeError("secret /home/someone/model.gguf")

    monkeypatch.setattr(tiny_engine, "submit", broken)
    monkeypatch.setattr(tiny_engine, "agenerate", broken, raising=False)
    with caplog.at_level("ERROR"):
        r = _complete(open_url)
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    message = r.json()["error"]["message"]
    assert "secret" not in message and "/home" not in message and "RuntimeError" not in message
    error_id = message.split("id ")[1].split(";")[0]
    assert any(error_id in record.getMessage() and record.exc_info for record in caplog.records)


def test_without_a_key_a_loopback_server_answers_loopback_hosts_only(open_url: str) -> None:
    """DNS rebinding: a page on evil.example resolves its name to 127.0.0.1 and drives the server;
    its requests carry Host: evil.example (and a browser's cross-site POST an Origin)."""
    port = open_url.rsplit(":", 1)[1]
    for headers in ({"Host": f"evil.example:{port}"}, {"Origin": "https://evil.example"},
                    {"Host": f"localhost:{port}", "Origin": "http://evil.example:80"}):
        r = httpx.post(open_url + "/flush_cache", headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", headers
    for headers in ({"Host": f"localhost:{port}"}, {"Host": f"127.0.0.1:{port}", "Origin": f"http://localhost:{port}"},
                    {"Host": f"[::1]:{port}"}):
        assert httpx.post(open_url + "/flush_cache", headers=headers).status_code == 200, headers


def test_a_post_body_must_be_json(open_url: str) -> None:
    """A cross-site form post sends text/plain or form encoding without a preflight: refused."""
    body = json.dumps({"model": _model(open_url), "prompt": "Hi", "max_tokens": 2})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(open_url + "/v1/completions", content=body, headers={"Content-Type": content_type})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", content_type
    ok = httpx.post(open_url + "/v1/completions", content=body,
                    headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200
    assert httpx.post(open_url + "/flush_cache").status_code == 200  # bodiless POSTs (SGLang's client) still work


def test_a_keyed_or_deliberately_exposed_server_answers_any_host(keyed_url: str, tiny_engine) -> None:
    assert httpx.get(keyed_url + "/metrics", headers={"Host": "api.example.com", "Authorization": f"Bearer {KEY}"}
                     ).status_code == 200
    with ServerThread(create_app(tiny_engine, any_host=True)) as srv:  # `serve --host 0.0.0.0` without a key
        assert httpx.get(srv.url + "/metrics", headers={"Host": "box.lan:8000"}).status_code == 200


def test_a_body_trickled_slower_than_the_deadline_is_a_408_and_others_are_served(tiny_engine) -> None:
    """Slowloris: a client sends its headers and then its body a byte at a time."""
    import socket
    import time as _time

    with ServerThread(create_app(tiny_engine, limits=ServerLimits(body_timeout_s=1.0))) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 1000\r\n\r\n{".encode())
            start = _time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200  # others are served meanwhile
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408") and _time.monotonic() - start < 5
    with pytest.raises(ValueError, match="body_timeout_s"):
        ServerLimits(body_timeout_s=0)


def test_a_prompt_is_tokenized_once_per_request(open_url: str, tiny_engine, monkeypatch) -> None:
    """A 4 MB prompt costs seconds to tokenize: the length check and the engine share one encoding."""
    calls = []
    real = tiny_engine.encode
    monkeypatch.setattr(tiny_engine, "encode", lambda text, *a, **k: (calls.append(len(text)), real(text, *a, **k))[1])
    assert _complete(open_url, prompt="Hello there", max_tokens=2).status_code == 200
    assert calls == [len("Hello there")]
    calls.clear()
    body = {"model": _model(open_url), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(open_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert len(calls) == 1
