"""The server load benchmark: ShareGPT parsing, percentiles, and one small run against a server
over the fake engine (the real-model numbers come from `python -m radix_backend.bench.server_bench`)."""

from __future__ import annotations

import io
import json

import pytest

from radix_backend.bench import server_bench as sb
from radix_backend.bench import workloads
from radix_backend.server import ServerThread, create_app

from fakes import CharEngine


def test_iter_json_array_reads_incrementally() -> None:
    records = [{"id": i, "conversations": [{"from": "human", "value": "x" * 50 + "é"}]} for i in range(20)]
    fh = io.BytesIO(json.dumps(records, ensure_ascii=False).encode())
    got = list(workloads._iter_json_array(fh, limit=5, chunk_size=7))  # chunks split objects and UTF-8 sequences
    assert got == records[:5]
    assert list(workloads._iter_json_array(io.BytesIO(b"[]"), limit=3)) == []


def test_to_messages_alternates_and_ends_on_user() -> None:
    turns = [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
             {"from": "gpt", "value": "a2"}, {"from": "human", "value": "q3"}]
    assert [m["content"] for m in workloads._to_messages(turns, max_turns=2, max_chars=10)] == ["q1", "a1", "q2"]
    assert workloads._to_messages([{"from": "gpt", "value": "hi"}], 3, 10) == []
    assert workloads._to_messages(turns[:2], 3, 10) == [{"role": "user", "content": "q1"}]


def test_sharegpt_loader() -> None:
    convs = workloads.load_sharegpt_conversations(4, max_turns=2, max_message_chars=100)
    assert len(convs) == 4
    for conv in convs:
        assert conv[0]["role"] == "user" and conv[-1]["role"] == "user"
        assert all(len(m["content"]) <= 100 for m in conv)


def test_percentiles() -> None:
    p = sb.percentiles([float(i) for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)


def test_run_against_a_server() -> None:
    convs = [[{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "hi"},
              {"role": "user", "content": "more"}] for i in range(6)]
    with ServerThread(create_app(CharEngine(), served_model_name="fake")) as srv:
        out = sb.run(base_url=srv.url, conversations=convs, num_clients=3, max_new_tokens=5)
    assert out["requests"] == 12 and out["errors"] == 0
    assert out["completion_tokens"] == 12 * 5
    assert out["cache_hit_rate"] > 0.3  # second turns resend the first turn's history
    assert 0 < out["latency_s"]["p50"] <= out["latency_s"]["p99"]
    assert "| run |" in sb.format_table({"fake": out})
