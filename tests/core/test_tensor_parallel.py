"""Tensor parallelism on CPU with gloo: 2 (and 3) ranks give the single-process engine's greedy tokens.

Every engine here is shut down by its test or fixture, and `_no_leaked_workers` kills (by pid) any
worker process of ours that survived a failing test, so a failure never leaves processes behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from radix_backend import Engine, SamplingParams
from radix_backend.model_executor.distributed import TensorParallelError

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
PROMPTS = ["The capital of France is", "The capital of France is a city where",
           "Once upon a time, in a small village,", "1, 2, 3, 4,"]
KV = 1024


def _worker_pids() -> list[int]:
    """Live processes running our worker module (children of this test process or orphans)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), -1)
        zombie = "State:\tZ" in status
        if b"radix_backend.model_executor.tp_worker" in cmd and ppid == os.getpid() and not zombie:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_workers():  # module scope: set up first, so torn down after the module's engines
    yield
    leaked = _worker_pids()
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    assert not leaked, f"tensor-parallel worker processes outlived their engine: {leaked}"


@pytest.fixture(scope="module")
def single_reference(tiny_llama_dir):
    """Greedy tokens (two rounds: cold, then served partly from the radix cache) and next-token logits
    of the ordinary single-process engine."""
    with Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV) as engine:
        assert engine.runner.tp is None
        rounds = [[o.token_ids for o in engine.generate(PROMPTS, GREEDY)] for _ in range(2)]
        logits = engine.next_token_logits(engine.encode("Hello, my name is"))
    return rounds, logits


_module_engines: list[Engine] = []


def _free_the_process_group() -> None:
    """Shut the shared module engine down: a process holds one tensor-parallel engine at a time."""
    for engine in _module_engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def tp2_engine(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV, tp_size=2)
    _module_engines.append(engine)
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.mark.timeout(60)
def test_tp_size_1_makes_no_distributed_calls(tiny_llama_dir, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("tp_size=1 must not touch torch.distributed")

    for name in ("init_process_group", "new_group", "all_reduce", "broadcast_object_list", "TCPStore"):
        monkeypatch.setattr(dist, name, forbidden)
    with Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV) as engine:
        assert engine.runner.tp is None and engine.runner.model.layers[0].mlp.all_reduce is None
        assert engine.generate("Hi", GREEDY).token_ids


@pytest.mark.timeout(180)
def test_tp2_greedy_tokens_equal_single_process(single_reference, tp2_engine):
    rounds, ref_logits = single_reference
    first = [o for o in tp2_engine.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in first] == rounds[0]
    second = tp2_engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in second] == rounds[1]
    assert sum(o.meta.cached_tokens for o in second) > 0  # the radix cache on rank 0 served the second round
    logits = tp2_engine.next_token_logits(tp2_engine.encode("Hello, my name is"))
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(60)
def test_tp2_shards_heads_and_kv(tp2_engine):
    runner = tp2_engine.runner
    attn = runner.model.layers[0].self_attn
    assert (runner.tp.rank, runner.tp.size) == (0, 2)
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # of 4 and 2
    assert runner.kv_pool.cfg.num_kv_heads == 1  # rank 0's pool holds only its KV head
    assert runner.model.layers[0].mlp.down_proj.weight.shape == (64, 64)  # intermediate 128 / 2
    assert runner.model.embed_tokens.weight.shape[0] == runner.vocab_size  # replicated
    assert len(runner.tp.workers) == 1 and runner.tp.workers[0].poll() is None


@pytest.mark.timeout(60)
def test_second_tp_engine_in_one_process_is_refused(tp2_engine, tiny_llama_dir):
    with pytest.raises(TensorParallelError, match="one tensor-parallel engine per process"):
        Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV, tp_size=2)


@pytest.mark.timeout(60)
def test_tp_size_that_does_not_divide_heads_is_a_clear_error(tiny_llama_dir):
    before = set(_worker_pids())
    with pytest.raises(ValueError, match=r"tp_size=3 must divide num_attention_heads \(4\).*num_key_value_heads \(2\)"):
        Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV, tp_size=3)
    with pytest.raises(ValueError, match="positive int"):
        Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV, tp_size=0)
    assert set(_worker_pids()) <= before  # refused before any process started


@pytest.mark.timeout(60)
def test_worker_failing_to_start_is_an_error_not_a_hang(tiny_llama_dir, monkeypatch):
    _free_the_process_group()
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the worker process exits at once with code 1
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited with code 1 while starting"):
        Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV, tp_size=2)
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_worker_crash_is_an_error_on_rank0_not_a_hang(tiny_llama_dir):
    _free_the_process_group()
    engine = Engine(str(tiny_llama_dir), device="cpu", kv_cache_tokens=KV, tp_size=2)
    try:
        assert engine.generate("Hi", GREEDY).token_ids
        worker = engine.runner.tp.workers[0]
        worker.kill()
        worker.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            engine.generate("Hello again", GREEDY)
        with pytest.raises(TensorParallelError):  # and stays an error, without touching the dead group
            engine.generate("once more", GREEDY)
        assert time.monotonic() - start < 20
    finally:
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < 15
    assert engine.runner.tp.workers[0].poll() is not None


@pytest.mark.timeout(60)
def test_shutdown_stops_workers_cleanly(tiny_llama_dir, tp2_engine):
    tp2_engine.shutdown()
    assert all(w.poll() == 0 for w in tp2_engine.runner.tp.workers)  # stopped by message, not killed
    assert not dist.is_initialized()
    tp2_engine.shutdown()  # idempotent


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from radix_backend import Engine, SamplingParams
    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    engine = Engine(model, device="cpu", kv_cache_tokens=1024, tp_size=2)  # ranks > 0 serve inside, then exit
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    print("TOKENS=" + json.dumps([o.token_ids for o in outs]), flush=True)
    engine.shutdown()
""")


@pytest.mark.timeout(180)
def test_torchrun_launch_gives_the_same_tokens(single_reference, tiny_llama_dir, tmp_path):
    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(tiny_llama_dir), json.dumps(PROMPTS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("TOKENS=")]
    assert len(lines) == 1, out[-3000:]  # only rank 0 returns from Engine(...)
    assert json.loads(lines[0].removeprefix("TOKENS=")) == single_reference[0][0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_tp2_refused_tp3_matches_single(smollm2_checkpoint):
    """SmolLM2-135M has 9 heads and 3 KV heads: tp 2 cannot shard it, tp 3 can (3 ranks on a 2-core box)."""
    model = str(smollm2_checkpoint.path)
    _free_the_process_group()
    before = set(_worker_pids())
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\).*num_key_value_heads \(3\).*\[1, 3\]"):
        Engine(model, device="cpu", kv_cache_tokens=KV, tp_size=2)
    assert set(_worker_pids()) <= before
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    with Engine(model, device="cpu", kv_cache_tokens=KV) as engine:
        expected = [o.token_ids for o in engine.generate(prompts, params)]
    with Engine(model, device="cpu", kv_cache_tokens=KV, tp_size=3) as engine:
        assert engine.runner.kv_pool.cfg.num_kv_heads == 1
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_tp2_greedy_tokens_equal_single_gpu(tiny_llama_dir):
    _free_the_process_group()
    prompts = PROMPTS[:2]
    with Engine(str(tiny_llama_dir), device="cuda", dtype="float32", kv_cache_tokens=KV) as engine:
        expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    with Engine(str(tiny_llama_dir), device="cuda", dtype="float32", kv_cache_tokens=KV, tp_size=2) as engine:
        assert dist.get_backend(engine.runner.tp.group) == "nccl"
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
