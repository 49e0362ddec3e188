"""`radix-backend bench peers`: the prompt file, the drivers' shared protocol, the report."""

from __future__ import annotations

import json
import os

import pytest

from radix_backend.bench import peers


def fake_result(system: str, few_shot_s: float, prefill: float, b1: float, b32: float | None) -> dict:
    workload = {"wall_s": few_shot_s, "calls": 2, "prompt_tokens": 10, "cached_tokens": None,
                "completion_tokens": 4, "texts": ["a", "b"]}
    return {"system": system, "cpu": "Test CPU", "workloads": {"few-shot": workload},
            "micro": {"prefill_tok_s": prefill, "decode_b1_tok_s": b1, "decode_b32_tok_s": b32}}


def test_ratios_compare_with_the_best_peer_in_the_right_direction():
    results = {"radix": fake_result("radix-backend", 2.0, 600, 40, 300),
               "vllm": fake_result("vLLM-cpu", 4.0, 700, 20, 100),
               "llamacpp": fake_result("llama.cpp", 8.0, 200, 80, None)}
    assert peers.ratio_vs_best_peer(results, "few-shot", False) == (2.0, "vllm")  # 4 s vs our 2 s
    assert peers.ratio_vs_best_peer(results, "prefill_tok_s", True) == (600 / 700, "vllm")
    assert peers.ratio_vs_best_peer(results, "decode_b1_tok_s", True) == (0.5, "llamacpp")
    assert peers.ratio_vs_best_peer(results, "decode_b32_tok_s", True) == (3.0, "vllm")  # llama.cpp: n/a
    table = peers.format_table(results)
    assert "CPU: Test CPU" in table and "2.00x faster (vs vLLM-cpu)" in table and "2.00x slower (vs llama.cpp)" in table
    results["vllm"]["workloads"]["few-shot"]["texts"] = ["a", "c"]
    assert peers.agreement(results, "vllm", "few-shot") == "1/2"


def test_each_interface_compares_with_its_own_peers_and_fp32_with_fp32():
    results = {"radix": fake_result("radix-backend", 2.0, 600, 40, 300),
               "vllm": fake_result("vLLM-cpu", 1.0, 900, 20, 100),  # in process
               "radix-server": fake_result("radix-backend serve", 3.0, 500, 30, 200),
               "vllm-server": fake_result("vLLM-cpu server", 6.0, 400, 10, 50),
               "radix-fp32": fake_result("radix-backend fp32", 4.0, 300, 20, 100),
               "vllm-fp32": fake_result("vLLM-cpu fp32", 2.0, 600, 10, 100)}
    assert peers.ratio_vs_best_peer(results, "few-shot", False) == (0.5, "vllm")  # the server row is not a rival
    assert peers.ratio_vs_best_peer(results, "few-shot", False, ours="radix-server") == (2.0, "vllm-server")
    table = peers.format_table(results)
    process, server = table.split("### through an HTTP server")
    assert "2.00x slower (vs vLLM-cpu)" in process and "vLLM-cpu server |" not in process
    assert "2.00x faster (vs vLLM-cpu server)" in server
    assert "- few-shot wall s: 2.00x slower" in server and "- prefill 1024 tok/s: 2.00x slower" in server
    del results["vllm-fp32"]
    assert peers.same_precision_reference(results) is None  # vLLM ran bf16: not the same precision
    results["vllm"]["vllm_dtype"] = "float32"
    assert peers.same_precision_reference(results) == "vllm"


def test_vllm_runs_bf16_only_where_the_cpu_has_native_bf16():
    assert peers.vllm_dtype_for_cpu("flags\t: fpu avx2 avx512f avx512_bf16 avx512_vnni") == "bfloat16"
    assert peers.vllm_dtype_for_cpu("flags\t: fpu avx2 amx_bf16 amx_tile") == "bfloat16"
    assert peers.vllm_dtype_for_cpu("flags\t: fpu avx2 fma avx512f") == "float32"


def test_vllm_peers_run_with_the_libraries_its_cpu_guide_preloads(tmp_path, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "libmine.so")
    monkeypatch.setattr(peers.ctypes.util, "find_library",
                        lambda name: "libtcmalloc_minimal.so.4" if name == "tcmalloc_minimal" else None)
    (tmp_path / "vllm" / "lib").mkdir(parents=True)
    (tmp_path / "vllm" / "lib" / "libiomp5.so").write_bytes(b"")
    env, preloaded = peers.peer_environment(peers.PEERS["vllm"], tmp_path)
    expected = ["libtcmalloc_minimal.so.4"] + ([str(tmp_path / "vllm" / "lib" / "libiomp5.so")]
                                              if os.uname().machine == "x86_64" else [])
    assert preloaded == expected
    assert env["LD_PRELOAD"] == ":".join(expected + ["libmine.so"])  # the user's own preloads kept
    assert peers.peer_environment(peers.PEERS["vllm-server"], tmp_path)[1] == expected
    for name in ("radix", "radix-server", "llamaserver"):  # nobody else's environment changes
        env, preloaded = peers.peer_environment(peers.PEERS[name], tmp_path)
        assert preloaded == [] and env["LD_PRELOAD"] == "libmine.so"


def test_a_missing_peer_is_skipped_with_its_install_command(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    assert peers.run_peer(peers.PEERS["llamacpp"], plan, tmp_path, tmp_path / "no-peers", 60) is None
    assert "bash scripts/setup_peer_llamacpp.sh" in capsys.readouterr().out
    assert peers.run_peer(peers.PEERS["llamaserver"], plan, tmp_path, tmp_path / "no-peers", 60) is None
    assert "--llama-server PATH" in capsys.readouterr().out  # llama.cpp's server needs its binary named


def test_plan_holds_the_same_token_ids_for_every_system(smollm2_checkpoint):
    from radix_backend.model_executor.loader import embedded_gguf_path

    plan = peers.build_plan(embedded_gguf_path(), quick=True, decode_tokens=16, hf_dir=False)
    assert [w["name"] for w in plan["workloads"]] == ["few-shot", "multi-turn", "branching"]
    for workload in plan["workloads"]:
        assert all(isinstance(t, int) for wave in workload["waves"] for ids in wave for t in ids)
    few_shot = plan["workloads"][0]["waves"][0]
    shared = min(len(a) for a in few_shot)
    assert few_shot[0][:100] == few_shot[1][:100] and shared > 100  # one system prompt, many questions
    assert len(plan["prefill"]["prompt"]) == peers.PREFILL_TOKENS
    assert len(plan["decode"]["prompts"]) == max(peers.DECODE_BATCHES)
    assert len({tuple(p) for p in plan["decode"]["prompts"]}) == len(plan["decode"]["prompts"])
    assert plan["model_gguf"] == str(smollm2_checkpoint.path) and plan["model_dir"] is None  # no vLLM: no HF copy


@pytest.mark.parametrize("peer", ["radix", "radix-server"])
def test_radix_drivers_run_a_plan_in_their_own_process(peer, tmp_path, tiny_llama_dir, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.encode(f"Question {i}: what is {i} plus {i}?") for i in range(4)]
    plan = {"model_gguf": str(tiny_llama_dir), "context_tokens": 512, "eos_token_ids": [0],
            "radix_engine_args": {"kv_cache_tokens": 2048},
            "workloads": [{"name": "few-shot", "max_new_tokens": 4, "waves": [prompts[:2], prompts[2:]]}],
            "prefill": {"prompt": prompts[0] * 4}, "decode": {"batch_sizes": [1, 2], "prompts": prompts,
                                                             "max_new_tokens": 5}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = peers.run_peer(peers.PEERS[peer], tmp_path / "plan.json", tmp_path, tmp_path, 300)
    assert result is not None, (tmp_path / f"server_{peer}.log").read_text()[-3000:] if peer != "radix" else ""
    workload = result["workloads"]["few-shot"]
    assert workload["calls"] == 4 and len(workload["texts"]) == 4 and workload["completion_tokens"] > 0
    assert workload["cached_tokens"] is not None
    assert result["micro"]["prefill_tok_s"] > 0
    decode = result["micro"]["decode_b2_tok_s"]  # through HTTP, 4 tiny-model tokens can drown in request noise
    assert decode > 0 if peer == "radix" else (decode is None or decode > 0)
    assert result["cpu"] and "radix-backend" in result["version"]


@pytest.mark.parametrize("script", sorted({p.driver for p in peers.PEERS.values()}))
def test_drivers_import_nothing_of_the_package(script):
    """They run inside the peers' venvs, where radix_backend is not installed."""
    source = (peers.DRIVERS / script).read_text()
    imports = [line for line in source.splitlines() if line.lstrip().startswith(("import ", "from "))]
    assert not [line for line in imports if "radix_backend" in line and script != "run_radix.py"]
    assert any("driver_protocol" in line for line in imports)


def test_rounds_take_the_systems_in_turn_and_keep_each_ones_best(tmp_path, monkeypatch):
    """With --rounds the systems alternate (order reversed each round) and each measure keeps the
    system's best round: a slow spell of the machine in one round does not decide a ratio."""
    calls = []
    walls = {("radix", ".r1"): 3.0, ("radix", ".r2"): 2.0, ("vllm", ".r1"): 4.0, ("vllm", ".r2"): 5.0, ("radix", ""): 1.0}

    def fake_run(peer, plan_path, out, peers_dir, timeout_s, tag=""):
        calls.append((peer.name, tag))
        if peer.name == "llamacpp":
            return None  # not installed: skipped every round
        wall = walls[(peer.name, tag)]
        return {"cpu": "test", "startup_s": wall, "workloads": {"few-shot": {"wall_s": wall, "texts": [tag]}},
                "micro": {"prefill_tok_s": 100 / wall, "decode_b1_tok_s": None if tag == ".r1" else 7.0}}

    monkeypatch.setattr(peers, "run_peer", fake_run)
    results = peers.run_rounds(["radix", "vllm", "llamacpp"], tmp_path / "plan.json", tmp_path, tmp_path, 60, 2)
    assert calls == [("radix", ".r1"), ("vllm", ".r1"), ("llamacpp", ".r1"),
                     ("llamacpp", ".r2"), ("vllm", ".r2"), ("radix", ".r2")]
    assert set(results) == {"radix", "vllm"}
    assert results["radix"]["workloads"]["few-shot"] == {"wall_s": 2.0, "texts": [".r2"]}
    assert results["vllm"]["workloads"]["few-shot"]["wall_s"] == 4.0
    assert results["vllm"]["micro"] == {"prefill_tok_s": 25.0, "decode_b1_tok_s": 7.0}  # a missing rate is skipped
    assert results["radix"]["startup_s"] == 2.0 and results["radix"]["rounds"] == 2
    assert "run 2 times in turn" in peers.format_table(results)
    calls.clear()
    assert peers.run_rounds(["radix"], tmp_path / "plan.json", tmp_path, tmp_path, 60, 1)["radix"]["rounds"] == 1
    assert calls == [("radix", "")]  # one round: the files keep their plain names
