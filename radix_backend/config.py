"""EngineConfig: every engine knob, its default and its check, in one place.

`Engine(model, config=None, **overrides)` builds one; the model runner, the scheduler and the
tensor-parallel workers read it; the server's and CLI's flags are generated from its fields
(`add_cli_args` / `from_cli_args`), so a default or a choice list is written once, here. The
environment is read here only, once per config (`from_env`: the `RADIX_*` variables of
`ENV_KNOBS`); nothing below reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .kernels.registry import BACKEND_NAMES

TORCH_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DTYPE_NAMES = ("auto", *TORCH_DTYPES)
QUANTIZATION_MODES = ("auto", "none", "int4", "int8")
ACTIVATION_BITS = (8, 16)
ATTENTION_DTYPES = ("auto", "fp32", "bf16")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")  # the order of waiting requests (see scheduler/admission.py)


def _knob(default: Any, help: str, choices: tuple[str, ...] | None = None, cli: bool = True) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine runs its model. Immutable: derive variants with `replace(**overrides)`."""

    device: str = _knob("auto", "cpu, cuda, cuda:N, or auto (CUDA when available)")
    dtype: str = _knob("auto", "weights and KV dtype; auto: bf16 on CUDA, fp32 on CPU", DTYPE_NAMES)
    quantization: str = _knob(
        "auto", "weight-only quantized linears; auto: a GGUF model in its own types where the native CPU kernels "
        "run, fp otherwise", QUANTIZATION_MODES)
    kv_cache_tokens: int | None = _knob(None, "KV pool size in tokens (default: from mem_fraction)")
    mem_fraction: float | None = _knob(None, "share of free memory for the KV pool (default: 0.8 CUDA, 0.2 CPU)")
    page_size: int = _knob(1, "tokens per KV page (radix matches round down to whole pages)")
    schedule_policy: str = _knob("lpm", "admission order: longest cached prefix, radix-subtree groups, or arrival",
                                 SCHEDULE_POLICIES)
    attention_backend: str = _knob("auto", "attention kernels; auto: flashinfer, then triton on CUDA; native, else "
                                   "torch on the CPU", BACKEND_NAMES)
    max_running_requests: int = _knob(64, "requests decoding at once")
    chunked_prefill_tokens: int = _knob(2048, "prefill tokens per forward; longer prompts are chunked")
    disable_radix_cache: bool = _knob(False, "never reuse KV across requests (for comparison)")
    enable_jump_forward: bool = _knob(True, "append grammar-forced tokens without decode steps")
    seed: int = _knob(0, "seed of sampled requests that give none")
    tp_size: int = _knob(1, "tensor-parallel ranks (one process each)")
    cuda_graph: bool | None = _knob(None, "capture decode steps in CUDA graphs (default: with triton on CUDA)")
    disk_cache_dir: str | None = _knob(
        None, "directory of the persistent KV tier: KV evicted or written through goes there and is loaded back "
        "instead of recomputed, across restarts (off when unset)")
    disk_cache_bytes: int = _knob(8 << 30, "size cap of the disk KV tier in bytes (least recently used files go first)")
    disk_cache_write_through_tokens: int = _knob(
        256, "sequences at least this long are written to the disk tier as soon as cached; shorter ones on eviction")
    native_kernels: bool = _knob(True, "our C kernels for CPU tensors where a compiler builds them (off: torch ops, "
                                 "the reference); process-wide")
    triton_ops: bool = _knob(True, "Triton layer ops for CUDA tensors (off: torch ops); process-wide")
    retain_heap: bool = _knob(True, "on the CPU, keep freed heap blocks of up to 64 MiB for reuse (glibc's mmap and "
                              "trim thresholds) instead of handing them back to the OS, which makes every layer of "
                              "a prefill fault its tensors in anew; process-wide")
    activation_bits: int = _knob(8, "activation integers of the native low-bit linears (16 keeps a GGUF model's "
                                 "greedy tokens equal to its fp32 reference's, at 1.2-1.5x the time)")
    attention_dtype: str = _knob(
        "auto", "products of the native CPU attention kernels: fp32, or bf16 pairs (the same bits on every CPU with "
        "FMA; ~1.4x faster extend attention where the CPU has native bf16); auto: bf16 for a model with low-bit "
        "linears on a CPU with native bf16 (AVX512-BF16 or AMX), fp32 otherwise (fp checkpoints, GGUF files of float "
        "tensors); with batch_invariant off, decode "
        "rows keep the fp32 split kernel (the bf16 pool aside)", ATTENTION_DTYPES)
    kv_cache_dtype: str = _knob(
        "auto", "the KV pool's rows on the CPU: auto = bf16 where the attention products are bf16 (they round every K "
        "and V to bf16 anyway: the same bits at half the memory and reads), else the model's dtype; fp32 keeps an fp32 "
        "pool; bf16 needs bf16 attention products", KV_CACHE_DTYPES)
    batch_invariant: bool = _knob(True, "a request's logits never depend on its batch-mates, the cache state or the "
                                  "chunking (CPU native kernels; GPU: Triton's invariant kernels); off: faster "
                                  "shared-prefix / split-K decode and BLAS linears")
    speculative: bool | None = _knob(
        None, "speculative decoding from the request's own context and the radix tree (no draft model), drafts sized "
        "per request by their acceptance; default: on where the kernel path is batch invariant, so the output is "
        "bit-identical to plain decoding (elsewhere verification rows may round differently, as batching does)")
    speculative_max_draft: int = _knob(8, "most draft tokens a request verifies in one step")
    tp_timeout_s: float = _knob(300.0, "seconds one tensor-parallel collective may take before the group fails")
    tp_startup_timeout_s: float = _knob(300.0, "seconds tensor-parallel workers may take to start and load")
    debug_slots: bool = _knob(False, "check every KV slot free/alloc (slow; for tests)", cli=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
        for name, low in (("page_size", 1), ("max_running_requests", 1), ("chunked_prefill_tokens", 1),
                          ("tp_size", 1), ("kv_cache_tokens", 16), ("disk_cache_bytes", 1),
                          ("disk_cache_write_through_tokens", 1), ("speculative_max_draft", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                wanted = "a positive int" if low == 1 else f"an int >= {low}"
                raise ValueError(f"{name} must be {wanted}, got {value!r}")
        if self.disk_cache_dir is not None and (self.disable_radix_cache or self.tp_size > 1):
            raise ValueError("disk_cache_dir needs the radix cache and one process (tp_size 1)")
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction!r}")
        if self.activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits must be 8 or 16, got {self.activation_bits!r}")
        for name in ("tp_timeout_s", "tp_startup_timeout_s"):
            if not isinstance(getattr(self, name), (int, float)) or not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """The defaults, then the `RADIX_*` variables of `ENV_KNOBS` set in `environ` (default:
        the process environment), then `overrides`. A malformed value is an error naming it."""
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for name, var in ENV_KNOBS.items():
            if var in env:
                values[name] = _parse_env(var, env[var], _base_type(hints[name]))
        return cls(**values).replace(**overrides)

    def replace(self, **overrides: Any) -> EngineConfig:
        """A copy with `overrides` applied (checked); an unknown name is a TypeError naming the knobs."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; "
                            f"known: {', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides) if overrides else self

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ENV_KNOBS = {
    "quantization": "RADIX_BACKEND_QUANTIZATION",
    "native_kernels": "RADIX_BACKEND_NATIVE",
    "triton_ops": "RADIX_BACKEND_TRITON_OPS",
    "retain_heap": "RADIX_BACKEND_RETAIN_HEAP",
    "activation_bits": "RADIX_BACKEND_ACTIVATION_BITS",
    "batch_invariant": "RADIX_BACKEND_BATCH_INVARIANT",
    "attention_dtype": "RADIX_BACKEND_ATTENTION_DTYPE",
    "kv_cache_dtype": "RADIX_BACKEND_KV_CACHE_DTYPE",
    "speculative": "RADIX_BACKEND_SPECULATIVE",
    "tp_timeout_s": "RADIX_TP_TIMEOUT_S",
    "tp_startup_timeout_s": "RADIX_TP_STARTUP_TIMEOUT_S",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_env(var: str, text: str, kind: type) -> Any:
    value = text.strip()
    try:
        if kind is bool:
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError("expected 1/0, true/false, yes/no or on/off")
            return value.lower() in _TRUE
        return kind(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {var}={text!r} is not a valid {kind.__name__}: {exc}") from None


Parser = typing.Union[argparse.ArgumentParser, "argparse._ArgumentGroup"]


def add_cli_args(parser: Parser, only: typing.Iterable[str] | None = None) -> Parser:
    """Add `--kebab-case` flags for EngineConfig's fields (all CLI fields, or `only` these)."""
    hints = typing.get_type_hints(EngineConfig)
    wanted = set(only) if only is not None else None
    defaults = EngineConfig.from_env()  # a RADIX_* variable sets a flag's default
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata["cli"] or (wanted is not None and f.name not in wanted):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        default = getattr(defaults, f.name)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=default, choices=f.metadata["choices"],
                                help=f.metadata["help"])
    return parser


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags `add_cli_args` added (others keep their defaults)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def _base_type(annotation: Any) -> type:
    """int for `int | None`, and so on."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation
