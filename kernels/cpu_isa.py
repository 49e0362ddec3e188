"""Which instruction set the CPU kernels target: this CPU's own, or a lower x86 level on request.

Kernels are chosen from the CPU's features, never timed. `RADIX_BACKEND_CPU_ISA` lowers the
target below what the CPU has, so one machine can run (and measure) what an older one runs:

- `native` (default): `-march=native`, every feature /proc/cpuinfo lists;
- `avx2`: `-march=haswell` (AVX2 + FMA, no VNNI, no AVX-512, no native bf16);
- `portable`: `-march=x86-64` (SSE2 only).

The features the Python side reads (native bf16 for attention and dense matmuls) follow the same
target. torch picks its own kernels: hold it to the same level with `ATEN_CPU_CAPABILITY=avx2`,
`ONEDNN_MAX_CPU_ISA=AVX2` and `MKL_ENABLE_INSTRUCTIONS=AVX2` set before torch is imported
(`isa_environment` gives them all). Other libraries that read the hardware themselves (vLLM's own
C++ kernels check for AVX-512) are not held.
"""

from __future__ import annotations

import os
import platform

ISA_ENV = "RADIX_BACKEND_CPU_ISA"
_MARCH = {"native": "native", "avx2": "haswell", "portable": "x86-64"}
# what holds torch to the same level: its own kernels, oneDNN's and MKL's GEMMs
_TORCH_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
              "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                           "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}
# flags a lowered target drops from the CPU's list (prefixes)
_DROPPED = {"avx2": ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx_vnni_int8"),
            "portable": ("avx", "amx", "fma", "f16c", "bmi", "sse3", "ssse3", "sse4", "pni", "popcnt", "movbe")}


def target() -> str:
    """The target named by the environment (`native` when unset); an unknown name is an error."""
    name = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if name not in _MARCH:
        raise ValueError(f"{ISA_ENV}={name!r}: expected one of {', '.join(_MARCH)}")
    if name != "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"{ISA_ENV}={name!r} names an x86 level; this CPU is {platform.machine()}")
    return name


def march_flag() -> str:
    return f"-march={_MARCH[target()]}"


def visible_flags(flags: set[str]) -> set[str]:
    """The CPU's feature flags as the kernels may use them under the current target."""
    dropped = _DROPPED.get(target(), ())
    return {flag for flag in flags if not flag.startswith(dropped)}


def isa_environment(name: str) -> dict[str, str]:
    """Environment variables that hold both our kernels and torch's to `name` (for child processes)."""
    if name not in _MARCH:
        raise ValueError(f"unknown CPU ISA {name!r}: expected one of {', '.join(_MARCH)}")
    return {ISA_ENV: name, **_TORCH_ENV.get(name, {})}
