"""The disk KV tier: KV survives an engine restart, written through or back on eviction, and is
never trusted when damaged or written by another model. Fast tests on the tiny Llama; the
restart test on SmolLM2 runs two real processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from radix_backend import Engine, SamplingParams
from radix_backend.mem_cache.kv_store import SUFFIX

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
WORDS = "apple river stone cloud maple tiger violet ember harbor quartz".split()


def prompt_ids(engine: Engine, n_words: int, salt: int = 0) -> list[int]:
    text = " ".join(WORDS[(i * 7 + salt) % len(WORDS)] + str(i % 13) for i in range(n_words))
    return engine.encode(text)


def tiny(path: Path, disk: Path | None, **kw) -> Engine:
    opts = {"kv_cache_tokens": 4096, "device": "cpu", "dtype": "float32", **kw}
    if disk is not None:
        opts["disk_cache_dir"] = str(disk)
    return Engine(str(path), **opts)


def block_files(disk: Path) -> list[Path]:
    return sorted(disk.glob(f"*/*{SUFFIX}"))


def cold_run(model_dir: Path, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    with tiny(model_dir, None) as eng:
        return eng.generate(input_ids=ids, params=GREEDY).token_ids, eng.next_token_logits(ids)


def test_restart_loads_written_through_kv(tiny_llama_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    with tiny(tiny_llama_dir, disk) as first:
        ids = prompt_ids(first, 160)
        assert len(ids) > 300  # above the write-through threshold
        first.generate(input_ids=ids, params=GREEDY)
    assert block_files(disk)
    cold_tokens, cold_logits = cold_run(tiny_llama_dir, ids)
    with tiny(tiny_llama_dir, disk) as second:
        out = second.generate(input_ids=ids, params=GREEDY)
        stats = second.cache_stats()
        # everything up to the last whole 64-token block before the final token came from disk
        assert out.meta.cached_tokens == (len(ids) - 1) // 64 * 64
        assert stats.disk_hit_tokens == out.meta.cached_tokens and stats.disk_bytes_read > 0
        assert out.token_ids == cold_tokens
        second.flush_cache()
        logits = second.next_token_logits(ids)  # again from disk: the memory tree was emptied
        torch.testing.assert_close(logits, cold_logits, rtol=1e-4, atol=1e-4)


def test_short_prefixes_are_written_back_on_eviction(tiny_llama_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    with tiny(tiny_llama_dir, disk, kv_cache_tokens=400, disk_cache_write_through_tokens=10_000) as eng:
        ids = prompt_ids(eng, 70, salt=1)
        assert 128 < len(ids) < 300
        expected = eng.generate(input_ids=ids, params=GREEDY).token_ids
        assert not block_files(disk)  # below the threshold: kept in memory only
        for salt in range(2, 6):  # other prompts push it out of the 400-slot pool
            eng.generate(input_ids=prompt_ids(eng, 70, salt=salt), params=GREEDY)
        assert eng.cache_stats().evictions > 0
        eng.scheduler.kv.disk.store.flush()
        assert block_files(disk)
        again = eng.generate(input_ids=ids, params=GREEDY)
        assert again.token_ids == expected
        assert again.meta.cached_tokens >= 128 and eng.cache_stats().disk_hit_tokens >= 128


def test_corrupted_or_truncated_entries_are_misses(tiny_llama_dir: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    disk = tmp_path / "kv"
    with tiny(tiny_llama_dir, disk) as first:
        ids = prompt_ids(first, 160, salt=3)
        first.generate(input_ids=ids, params=GREEDY)
    cold_tokens, _ = cold_run(tiny_llama_dir, ids)
    files = {f.stat().st_mtime_ns: f for f in block_files(disk)}
    assert len(files) >= 4
    victims = block_files(disk)
    flipped = bytearray(victims[0].read_bytes())
    for i in range(200, 260):
        flipped[-i] ^= 0xFF
    victims[0].write_bytes(bytes(flipped))
    victims[1].write_bytes(victims[1].read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.WARNING, logger="radix_backend.mem_cache.kv_store"), tiny(tiny_llama_dir, disk) as second:
        out = second.generate(input_ids=ids, params=GREEDY)
        second.flush_cache()
        out2 = second.generate(input_ids=ids, params=GREEDY)  # now with the bad blocks rewritten
        corrupt = second.scheduler.kv.disk.store.stats.corrupt_entries
    assert out.token_ids == cold_tokens and out2.token_ids == cold_tokens
    assert corrupt >= 1 and "ignoring" in caplog.text
    assert out.meta.cached_tokens < len(ids) - 64  # the chain stopped at the first bad block


def test_another_model_never_loads_the_kv(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Same architecture, other weights: a separate store; a file planted under its name is refused."""
    from transformers import LlamaForCausalLM

    other_dir = tmp_path / "other"
    torch.manual_seed(1)
    src = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir))
    for p in src.parameters():
        p.data.normal_(0, 0.1)
    src.save_pretrained(str(other_dir))
    for f in tiny_llama_dir.glob("*token*"):
        (other_dir / f.name).write_bytes(f.read_bytes())

    disk = tmp_path / "kv"
    with tiny(tiny_llama_dir, disk) as first:
        ids = prompt_ids(first, 160, salt=4)
        first.generate(input_ids=ids, params=GREEDY)
        ours = first.scheduler.kv.disk.store
        ours.flush()
    cold_tokens, _ = cold_run(other_dir, ids)
    with tiny(other_dir, disk) as second:
        theirs = second.scheduler.kv.disk.store
        assert theirs.dir != ours.dir and theirs.fingerprint != ours.fingerprint
        # plant the first model's blocks under the names the second model would look up
        from radix_backend.mem_cache.kv_store import block_hashes

        planted = []
        for mine, name in zip(block_hashes(ids, 64, ours.fingerprint), block_hashes(ids, 64, theirs.fingerprint)):
            if ours.path(mine).exists():
                theirs.path(name).write_bytes(ours.path(mine).read_bytes())
                planted.append(name)
        assert len(planted) >= 4
        out = second.generate(input_ids=ids, params=GREEDY)
        assert second.cache_stats().disk_hit_tokens == 0 and out.meta.cached_tokens == 0
        assert theirs.stats.corrupt_entries >= 1  # refused (and removed), then recomputed
        theirs.flush()  # the refused file was removed, then rewritten with this model's own KV
        assert theirs.read(planted[0], ids[:64]) is not None
        assert out.token_ids == cold_tokens


def test_full_disk_degrades_to_memory_only(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    import errno

    from radix_backend.mem_cache import kv_store

    def no_space(self, job):  # noqa: ANN001
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_store.DiskKVStore, "_write", no_space)
    with caplog.at_level(logging.WARNING, logger="radix_backend.mem_cache.kv_store"), \
            tiny(tiny_llama_dir, tmp_path / "kv") as eng:
        ids = prompt_ids(eng, 160, salt=5)
        first = eng.generate(input_ids=ids, params=GREEDY)
        eng.scheduler.kv.disk.store.flush()
        second = eng.generate(input_ids=ids, params=GREEDY)
        store = eng.scheduler.kv.disk.store
        assert store.writes_disabled and "No space left" in store.writes_disabled
        assert store.stats.write_errors == 1  # one failure turns writing off; no retry storm
    assert first.token_ids == second.token_ids and second.meta.cached_tokens > 0  # memory tier still serves
    assert "in-memory cache only" in caplog.text


def test_size_cap_evicts_least_recently_used_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    with tiny(tiny_llama_dir, disk) as probe:
        block_bytes = None
        ids = prompt_ids(probe, 160, salt=6)
        probe.generate(input_ids=ids, params=GREEDY)
        probe.scheduler.kv.disk.store.flush()
        block_bytes = block_files(disk)[0].stat().st_size
    cap = 3 * block_bytes + block_bytes // 2
    disk2 = tmp_path / "kv2"
    with tiny(tiny_llama_dir, disk2, disk_cache_bytes=cap) as eng:
        eng.generate(input_ids=ids, params=GREEDY)
        store = eng.scheduler.kv.disk.store
        store.flush()
        assert sum(f.stat().st_size for f in block_files(disk2)) <= cap
        assert store.stats.evicted_files > 0


def test_concurrent_writers_share_a_directory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two engines (as two processes would) write the same blocks into one directory at once;
    the files are whole and a third engine loads them."""
    disk = tmp_path / "kv"
    a, b = tiny(tiny_llama_dir, disk), tiny(tiny_llama_dir, disk)
    try:
        ids = prompt_ids(a, 160, salt=7)
        ha = a.submit(input_ids=ids, params=GREEDY)
        hb = b.submit(input_ids=ids, params=GREEDY)
        ha.wait(60), hb.wait(60)
    finally:
        a.shutdown(), b.shutdown()
    assert not list(disk.glob("*/.tmp-*"))
    cold_tokens, _ = cold_run(tiny_llama_dir, ids)
    with tiny(tiny_llama_dir, disk) as c:
        out = c.generate(input_ids=ids, params=GREEDY)
        assert out.token_ids == cold_tokens and c.cache_stats().disk_hit_tokens > 0
        assert c.scheduler.kv.disk.store.stats.corrupt_entries == 0


def test_config_rejects_disk_tier_without_radix_cache(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_cache_dir"):
        tiny(tiny_llama_dir, tmp_path, disable_radix_cache=True)


RESTART_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from radix_backend import Engine, SamplingParams
    disk, ids_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    ids = json.load(open(ids_path))
    eng = Engine(None, quantization="none", disk_cache_dir=disk or None)
    out = eng.generate(input_ids=ids, params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    logits = eng.next_token_logits(ids)
    stats = eng.cache_stats()
    torch.save(logits, out_path + ".pt")
    json.dump({"tokens": out.token_ids, "cached": out.meta.cached_tokens, "disk_hit": stats.disk_hit_tokens}, open(out_path, "w"))
""")


@pytest.mark.slow
def test_restart_on_smollm2_serves_the_document_from_disk(tmp_path: Path, smollm2_tokenizer) -> None:
    """Process 1 reads a 2,000-token document and exits; process 2 with the same directory gets
    >= 95 % of it from disk, the same greedy tokens as a cold run and logits within fp32 tolerance."""
    doc = " ".join(f"Record {i}: the {WORDS[i % 10]} ledger lists {i * 37 % 101} crates." for i in range(160))
    ids = smollm2_tokenizer.encode(doc + "\nHow many crates does record 7 list?")[:2000]
    assert len(ids) == 2000
    ids_path = tmp_path / "ids.json"
    ids_path.write_text(json.dumps(ids))
    script = tmp_path / "run.py"
    script.write_text(RESTART_SCRIPT)
    env = {**os.environ, "RADIX_BACKEND_QUANTIZATION": "none"}

    def run(disk: str, name: str) -> dict:
        out = tmp_path / name
        subprocess.run([sys.executable, str(script), disk, str(ids_path), str(out)], check=True, env=env, timeout=600)
        return json.loads(out.read_text()) | {"logits": torch.load(str(out) + ".pt")}

    disk = str(tmp_path / "kv")
    first = run(disk, "first.json")
    second = run(disk, "second.json")
    cold = run("", "cold.json")
    assert first["disk_hit"] == 0 and second["disk_hit"] >= 0.95 * len(ids)
    assert second["cached"] >= 0.95 * len(ids)
    assert second["tokens"] == cold["tokens"] == first["tokens"]
    torch.testing.assert_close(second["logits"], cold["logits"], rtol=1e-4, atol=1e-4)


def test_adapters_count_disk_hits_as_cached(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """After a restart, LangChain's usage `cache_read` and LlamaIndex's `cached_tokens` include
    the prompt tokens loaded from disk."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage

    from radix_backend.adapters.langchain import RadixChatModel
    from radix_backend.adapters.llama_index import RadixLlamaIndexLLM

    disk = tmp_path / "kv"
    with tiny(tiny_llama_dir, disk) as first:
        text = first.decode(prompt_ids(first, 160, salt=8))
        RadixChatModel(engine=first, max_tokens=2, temperature=0).invoke(text)
    with tiny(tiny_llama_dir, disk) as second:
        msg = RadixChatModel(engine=second, max_tokens=2, temperature=0).invoke(text)
        from_disk = second.cache_stats().disk_hit_tokens
        assert from_disk >= 256
        assert msg.usage_metadata["input_token_details"]["cache_read"] == from_disk
    with tiny(tiny_llama_dir, disk) as third:
        reply = RadixLlamaIndexLLM(engine=third, max_new_tokens=2, temperature=0).chat([ChatMessage(role="user",
                                                                                               content=text)])
        assert reply.additional_kwargs["cached_tokens"] == third.cache_stats().disk_hit_tokens >= 256


def test_server_reports_disk_hits(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A restarted server answers from the disk tier: `/generate` counts the tokens as cached and
    /metrics exposes the disk gauges."""
    import httpx

    from radix_backend.server import ServerThread, create_app

    disk = tmp_path / "kv"
    with tiny(tiny_llama_dir, disk) as first:
        ids = prompt_ids(first, 160, salt=9)
        first.generate(input_ids=ids, params=GREEDY)
    with tiny(tiny_llama_dir, disk) as second, ServerThread(create_app(second)) as srv:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        meta = httpx.post(srv.url + "/generate", json=body, timeout=60).json()["meta_info"]
        assert meta["cached_tokens"] == (len(ids) - 1) // 64 * 64
        metrics = {ln.split()[0]: float(ln.split()[1]) for ln in httpx.get(srv.url + "/metrics").text.splitlines()
                   if ln.startswith("radix_backend_cache_disk")}
        assert metrics["radix_backend_cache_disk_hit_tokens"] == meta["cached_tokens"]
        assert metrics["radix_backend_cache_disk_bytes_read"] > 0


def test_many_waiting_requests_with_disk_prefixes_all_finish(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Twelve prompts whose KV is on disk, together bigger than the pool, submitted at once: the
    scheduler orders them by the tree alone and loads a request's disk blocks only when it admits
    it. (Ordering by matches that loaded every waiting request's blocks filled the pool with locked
    prefixes; nothing could be admitted, the step evicted everything and loaded it all again: a
    livelock.)"""
    with tiny(tiny_llama_dir, tmp_path / "kv", kv_cache_tokens=320, chunked_prefill_tokens=48,
              disk_cache_write_through_tokens=64) as eng:
        prompts = [prompt_ids(eng, 44, salt=s) + [100 + s] * 3 for s in range(12)]  # one 64-token block each
        alone = []
        for ids in prompts:
            assert eng.flush_cache()
            alone.append(eng.generate(input_ids=ids, params=GREEDY).token_ids)
        assert eng.flush_cache()
        handles = [eng.submit(input_ids=ids, params=GREEDY) for ids in prompts]
        together = [h.wait(30).token_ids for h in handles]
        stats = eng.cache_stats()
    assert together == alone
    assert 0 < stats.disk_hit_tokens <= sum(len(p) for p in prompts)  # each prefix loaded about once


def test_another_kernel_path_never_loads_the_kv(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """The same weights through other numerics (here fp32 vs bf16 attention products, which change
    every layer's K and V after the first) write a separate store: KV is only read back by the path
    that computed it, so a disk hit keeps a cold run's bits."""
    from radix_backend.kernels import native

    if not native.available():
        pytest.skip("bf16 products are the native kernels'")
    disk = tmp_path / "kv"
    stores = {}
    for attention in ("fp32", "bf16"):  # head size 32 takes bf16 pairs on every CPU with FMA
        with tiny(tiny_qwen3_dir, disk, attention_dtype=attention, kv_cache_dtype="fp32") as eng:  # one pool dtype
            stores[attention] = eng.scheduler.kv.disk.store
            assert eng.kernel_path.attention_bf16 is (attention == "bf16")
    assert stores["fp32"].fingerprint != stores["bf16"].fingerprint and stores["fp32"].dir != stores["bf16"].dir
