"""RADIX_BACKEND_CPU_ISA: the kernels held to a lower x86 level than the CPU's, so one machine can
run what an older CPU runs (the AVX2-only measurements), chosen from flags, never timed."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from radix_backend import SamplingParams
from radix_backend.bench import peers
from radix_backend.kernels import cpu_isa, native, quant

X86 = platform.machine().lower() in ("x86_64", "amd64")
ZEN4_FLAGS = "flags\t: fpu sse2 ssse3 sse4_1 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 amx_tile"


def test_the_target_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    assert cpu_isa.target() == "native" and native.target_flags() == native.FLAGS
    monkeypatch.setenv(cpu_isa.ISA_ENV, "bogus")
    with pytest.raises(ValueError, match="RADIX_BACKEND_CPU_ISA='bogus': expected one of native, avx2, portable"):
        cpu_isa.target()
    if X86:
        monkeypatch.setenv(cpu_isa.ISA_ENV, " AVX2 ")
        assert cpu_isa.target() == "avx2" and "-march=haswell" in native.target_flags()
        monkeypatch.setenv(cpu_isa.ISA_ENV, "portable")
        assert "-march=x86-64" in native.target_flags()


@pytest.mark.skipif(not X86, reason="the lowered targets are x86 levels")
def test_a_lower_target_hides_the_features_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = quant._flags_of(ZEN4_FLAGS)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "native")
    assert cpu_isa.visible_flags(flags) == flags and quant.has_native_bf16(ZEN4_FLAGS)
    assert peers.vllm_dtype_for_cpu(ZEN4_FLAGS) == "bfloat16"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert cpu_isa.visible_flags(flags) == {"fpu", "sse2", "ssse3", "sse4_1", "avx", "avx2", "fma", "f16c"}
    assert not quant.has_native_bf16(ZEN4_FLAGS) and peers.vllm_dtype_for_cpu(ZEN4_FLAGS) == "float32"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "portable")
    assert cpu_isa.visible_flags(flags) == {"fpu", "sse2"}


def test_isa_environment_holds_torch_too() -> None:
    assert cpu_isa.isa_environment("avx2") == {cpu_isa.ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                               "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cpu_isa.isa_environment("portable")["ATEN_CPU_CAPABILITY"] == "default"
    assert cpu_isa.isa_environment("native") == {cpu_isa.ISA_ENV: "native"}
    with pytest.raises(ValueError, match="unknown CPU ISA"):
        cpu_isa.isa_environment("sse9")


_ENGINE_SCRIPT = """
import json
from radix_backend import Engine, SamplingParams
from radix_backend.kernels import native, cpu_isa
engine = Engine()
out = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=4, temperature=0))
print(json.dumps({"path": engine.kernel_path.__dict__, "library": native.library()._name,
                  "expected": str(native.build(native._compiler(), native.cache_dir() / "native",
                                               native.target_flags())),
                  "tokens": out[0].token_ids}))
engine.shutdown()
"""


@pytest.mark.skipif(not X86 or not native.available(), reason="needs an x86 CPU and a C compiler")
def test_smollm2_runs_on_the_avx2_build(engine) -> None:
    """The embedded model on the -march=haswell kernels with torch held to AVX2: the path says so,
    no bf16 products, and its greedy text is the native build's (first tokens: the activation
    rounding of the AVX2 path differs by one code step, so only the start is pinned)."""
    env = os.environ | cpu_isa.isa_environment("avx2")
    done = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["path"]["cpu_isa"] == "avx2" and not report["path"]["attention_bf16"]
    assert report["library"] == report["expected"]
    native_tokens = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=4, temperature=0))
    assert report["tokens"][:2] == native_tokens[0].token_ids[:2]
