"""`bench llama-bench` runs llama.cpp's pp/tg tests on our engine and reads llama-bench's own JSON
for the same tests (a stand-in binary here: llama.cpp is not built in CI; BENCHMARKS.md has real runs)."""

from __future__ import annotations

import json
import stat
import sys

from radix_backend.bench import llama_bench


def test_pp_and_tg_run_the_forwards_llama_bench_runs(engine) -> None:
    forwards: list[int] = []
    run = engine.runner.forward
    engine.runner.forward = lambda batch: forwards.append(len(batch.input_ids)) or run(batch)
    own_setting = engine.scheduler.set_speculative(False)  # as the bench's default engine runs
    try:
        rates = llama_bench.measure(engine, prompt=24, generate=6, repeats=2)
    finally:
        engine.scheduler.set_speculative(own_setting)
        del engine.runner.forward
    assert [r.test for r in rates] == ["pp24", "tg6"]
    assert all(r.mean > 0 and r.stddev >= 0 for r in rates)
    measured = forwards[-(2 * 1 + 2 * 6):]  # after the warm-up: pp as one 24-row pass, tg as 6 one-row passes
    assert measured[:2] == [24, 24] and measured[2:] == [1] * 12


def test_llama_benchs_json_is_read_for_the_same_tests(tmp_path) -> None:
    args = tmp_path / "args.json"
    fake = tmp_path / "llama-bench"
    reply = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 350.5, "stddev_ts": 2.0},
             {"n_prompt": 0, "n_gen": 128, "avg_ts": 157.0, "stddev_ts": 1.5}]
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(args)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                    f"print(json.dumps({reply!r}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    peer = llama_bench.llama_cpp(str(fake), "model.gguf", 512, 128, 3, 2)
    assert json.loads(args.read_text()) == ["-m", "model.gguf", "-t", "2", "-p", "512", "-n", "128", "-r", "3",
                                            "-o", "json"]
    assert [(r.test, r.mean) for r in peer] == [("pp512", 350.5), ("tg128", 157.0)]
    ours = {"pp512": llama_bench.Rate("pp512", 1751.0, 10.0), "tg128": llama_bench.Rate("tg128", 157.0, 3.0)}
    table = llama_bench.format_table(ours, {r.test: r for r in peer})
    assert "| pp512 | 1751.0 ± 10.0 | 350.5 ± 2.0 | 5.00x |" in table and "| tg128 | 157.0 ± 3.0 | 157.0 ± 1.5 | 1.00x |" in table
