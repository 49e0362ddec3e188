"""ModelRunner: owns the model weights, the KV pool and the attention backend; runs one ragged batch.

With tp_size > 1 the runner holds this rank's shard and KV heads only (radix_backend/model_executor/distributed.py
starts or joins the other ranks); `forward` on rank 0 broadcasts the batch so that every rank runs it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from radix_backend.kernels import AttentionMetadata, cpu_isa, create_attention_backend, heap, native, quant, settings
from radix_backend.kernels.ops import triton_available

from ..mem_cache.kv_pool import KVPool, KVPoolConfig, kv_tokens_for_budget
from .loader import Checkpoint, iter_weights
from ..models import build_model
from ..models.gguf_weights import build_gguf_model
from ..models.llama import TPShard, check_tp_divisible
from ..models.config_check import check_model_config
from ..config import DTYPE_NAMES, TORCH_DTYPES, EngineConfig
from .quantize import QuantizationReport, gguf_report, native_blocker, quantize_model

if TYPE_CHECKING:
    from .distributed import TensorParallel

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_FRACTION = 0.2
# A CPU step of at most this many tokens runs on one intra-op thread when called off the main
# thread (the scheduler's): there, every OpenMP region costs ~100 us of hand-off (libgomp), which
# outweighs what a second thread gains on small ops (measured on 2 cores, int4 SmolLM2: batch-1
# decode step 25 ms on 1 thread vs 37 ms on 2; batch 8: 85 vs 68 ms). The LM head is the exception:
# one 28 MB matmul, 4.1-4.5 ms on one thread and 2.6-2.8 ms on two, so it runs on all of them.
SINGLE_THREAD_MAX_TOKENS = 4
CPU_MAX_DEFAULT_KV_TOKENS = 131072


@dataclass(frozen=True)
class KernelPath:
    """What runs this model, decided once when it loads (logged; `Engine.kernel_path`)."""

    device: str
    dtype: str
    attention: str  # the attention backend: native, torch, triton or flashinfer
    layer_ops: str  # RMSNorm, RoPE, SiLU: native, triton or torch
    linears: str  # the quantization mode and why
    decode_stack: bool  # small decode steps run every layer in one native call
    cuda_graph: bool
    activation_bits: int  # of the native low-bit linears, every row
    batch_invariant: bool  # holds here: a row's logits do not depend on its batch-mates, the cache or the chunking
    # the native attention kernels multiply bf16 pairs (extends and invariant decode rows; with batch
    # invariance off, decode rows keep the fp32 split kernel), else fp32
    attention_bf16: bool = False
    cpu_isa: str = "native"  # the instruction set the native CPU kernels target (RADIX_BACKEND_CPU_ISA)
    kv_dtype: str = "float32"  # of the KV pool: bf16 rows where the attention products are bf16


@dataclass
class ForwardInput:
    """One forward pass: request i contributes new tokens at positions prefix_lens[i].."""

    input_ids: list[int]
    positions: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    kv_indices: torch.Tensor  # all slots of every sequence, prefix + new, concatenated
    out_slots: torch.Tensor  # slots of the new tokens
    logits_indices: list[int]  # rows of the flat token dim whose logits are wanted
    # rows of the logits (positions in logits_indices) only picked from by argmax: the LM head may
    # leave every value below the row's maximum inexact there (kernels/head_screen.py)
    argmax_rows: list[int] = field(default_factory=list)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    return TORCH_DTYPES[dtype]


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.config = checkpoint.config  # the model's (HF) config
        self.limits = check_model_config(self.config)  # before any weight is read
        if self.limits.capped_by is not None:
            logger.info("context limited to %d tokens by the model's %s (exact up to there)",
                        self.limits.context_length, self.limits.capped_by)
        check_tp_divisible(self.config, config.tp_size)  # before any process starts
        self.tp: TensorParallel | None = None
        if config.tp_size > 1:
            from .distributed import init_tensor_parallel

            worker_config = config.replace(device=self.device.type, dtype=str(self.dtype).removeprefix("torch."))
            self.tp = init_tensor_parallel(config.tp_size, self.device,
                                           {"model": str(checkpoint.path), "config": worker_config.as_dict()},
                                           forward_timeout_s=config.tp_timeout_s,
                                           startup_timeout_s=config.tp_startup_timeout_s)
            self.device = self.tp.device
        self.kernel_settings = settings.KernelSettings(native=config.native_kernels, triton_ops=config.triton_ops,
                                                       activation_bits=config.activation_bits,
                                                       batch_invariant=config.batch_invariant)
        try:
            with settings.active(self.kernel_settings):  # the linears pick their kernels while built
                self._build(checkpoint, config)
            self.kernel_settings = replace(self.kernel_settings,
                                           attention_bf16=self._attention_bf16(config.attention_dtype))
            self._build_pool(config)
            if self.device.type == "cpu" and config.retain_heap:
                heap.retain_freed_memory()  # after the load: its temporaries go back to the OS as before
        except BaseException as exc:
            if self.tp is not None:
                self.tp.mark_broken(f"building the model failed: {exc}")
            self.shutdown()
            raise
        self.graph_runner = None
        cuda_graph = config.cuda_graph
        masked = _masked_layers(self.model)
        if cuda_graph and masked:
            self.shutdown()
            raise ValueError("cuda_graph=True cannot capture this model: its sliding-window or soft-capped "
                             "attention layers plan each step from the sequences' lengths; leave cuda_graph unset")
        if cuda_graph is None:  # auto: hide Triton's launch overhead on CUDA
            cuda_graph = (self.device.type == "cuda" and self.attention_backend.name == "triton" and self.tp is None
                          and not masked)
        with settings.active(self.kernel_settings):
            if cuda_graph:
                self._init_graph_runner(config.max_running_requests)
            self.kernel_path = self._kernel_path()
        logger.info("kernel path: %s", self.kernel_path)
        if self.tp is not None and self.tp.rank != 0:
            self._serve_rank0()
            raise SystemExit(0)

    def _build(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        shard = TPShard(self.tp.rank, self.tp.size, self.tp.all_reduce) if self.tp is not None else None
        mode = config.quantization
        tp_size = self.tp.size if self.tp else 1
        if (checkpoint.gguf is not None and mode == "auto" and native.available()
                and native_blocker(self.device, self.dtype, tp_size) is None):
            self.model = build_gguf_model(self.config, checkpoint.gguf.tensors)
            self.quantization: QuantizationReport = gguf_report(self.model)
        else:
            self.model = build_model(self.config, iter_weights(checkpoint, dtype=torch.float32, device="cpu"),
                                     dtype=self.dtype, device=self.device, tp=shard)
            self.quantization = quantize_model(self.model, mode, from_gguf=checkpoint.gguf is not None,
                                               device=self.device, dtype=self.dtype, tp_size=tp_size)
        logger.info("quantization: %s (%s)", self.quantization.mode, self.quantization.reason)
        self.attention_backend = create_attention_backend(config.attention_backend, self.device,
                                                          page_size=config.page_size,
                                                          batch_invariant=config.batch_invariant)

    def _build_pool(self, config: EngineConfig) -> None:
        """The KV pool, in the model's dtype, or bf16 rows where the attention products are bf16
        (they round every K and V row to bf16 anyway: the same bits at half the bytes)."""
        attn = self.model.layers[0].self_attn
        kv_dtype = self._kv_dtype(config.kv_cache_dtype)
        pool_cfg = KVPoolConfig(num_layers=len(self.model.layers), num_kv_heads=attn.num_kv_heads,
                                head_dim=attn.head_dim, dtype=kv_dtype, device=self.device)
        num_slots = config.kv_cache_tokens or self._default_kv_tokens(pool_cfg, config.mem_fraction)
        if self.tp is not None:
            num_slots = self.tp.agree_min(num_slots)  # every rank's pool must have the same slots
        if num_slots < 16:
            raise ValueError(f"kv_cache_tokens must be >= 16, got {num_slots}")
        self.kv_pool = KVPool(pool_cfg, num_slots, page_size=config.page_size)
        self.kv_caches = [(self.kv_pool.k_cache(i), self.kv_pool.v_cache(i)) for i in range(pool_cfg.num_layers)]
        logger.info("model on %s/%s, %d KV slots (%s), tp_size=%d", self.device, self.dtype, num_slots,
                    str(kv_dtype).removeprefix("torch."), self.tp.size if self.tp else 1)

    def _kv_dtype(self, requested: str) -> torch.dtype:
        """bf16 rows where the attention products are bf16 (auto, or asked for), else the model's dtype."""
        bf16 = self.kernel_settings.attention_bf16
        if requested == "bf16" and not bf16 and self.dtype != torch.bfloat16:
            raise ValueError("kv_cache_dtype='bf16' needs bf16 attention products (attention_dtype 'auto' on a CPU with "
                             "native bf16, or 'bf16'); this model's products are "
                             f"{str(self.dtype).removeprefix('torch.')}")
        if requested == "fp32":
            if self.dtype != torch.float32:
                raise ValueError(f"kv_cache_dtype='fp32' needs an fp32 model; this one runs in "
                                 f"{str(self.dtype).removeprefix('torch.')}")
            return torch.float32
        return torch.bfloat16 if bf16 else self.dtype

    def _kernel_path(self) -> KernelPath:
        if self.device.type == "cpu":
            layer_ops = "native" if native.available() and self.dtype == torch.float32 else "torch"
        else:
            layer_ops = "triton" if settings.current().triton_ops and triton_available() else "torch"
        report = self.quantization
        attention = self.attention_backend.name
        return KernelPath(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                          attention=attention, layer_ops=layer_ops,
                          linears=f"{report.mode} ({report.reason})", decode_stack=report.decode_stack,
                          cuda_graph=self.graph_runner is not None,
                          activation_bits=settings.current().activation_bits,
                          batch_invariant=self._batch_invariant(attention, layer_ops),
                          attention_bf16=settings.current().attention_bf16,
                          cpu_isa=cpu_isa.target() if self.device.type == "cpu" else "n/a",
                          kv_dtype=str(self.kv_pool.dtype).removeprefix("torch."))

    def _attention_bf16(self, requested: str) -> bool:
        """Whether the native attention kernels multiply bf16 pairs: asked for, or (auto) for a model
        whose linears run low-bit (their activations are 8- or 16-bit already) on a CPU with native
        bf16; a GGUF file of float tensors only keeps fp32 products, as an fp checkpoint does. Read
        from the CPU's features, never timed: a busy machine must not change precision."""
        head_dim = self.model.layers[0].self_attn.head_dim
        can = (self.attention_backend.name == "native" and self.dtype == torch.float32 and native.available()
               and native.bf16_attention_dim_ok(head_dim))
        if requested == "bf16" and not can:
            raise ValueError(f"attention_dtype='bf16' needs the native CPU attention kernels, an fp32 model and a "
                             f"head size that is a multiple of 32; this model runs {self.attention_backend.name} "
                             f"attention on {self.device}/{str(self.dtype).removeprefix('torch.')}, head size {head_dim}")
        if requested != "auto":
            return requested == "bf16"
        return can and self.quantization.low_bit and quant.has_native_bf16()

    def _batch_invariant(self, attention: str, layer_ops: str) -> bool:
        """Whether the guarantee holds for this model, not only whether it was asked for: one
        process, no low-bit linear off our native kernels, and either every op on our native CPU
        kernels (fp32, a head size the extend kernel takes) or, on a GPU, Triton attention (its
        invariant kernel) and Triton layer ops (with the fixed-configuration matmul)."""
        if not (settings.current().batch_invariant and self.tp is None and quant.low_bit_linears_run_natively(self.model)
                and not _masked_layers(self.model)):  # a windowed decode row reads fewer key blocks than its extend
            return False
        if self.device.type == "cuda":
            return attention == "triton" and layer_ops == "triton" and self.attention_backend.batch_invariant
        return (attention == "native" and layer_ops == "native"
                and native.extend_attention_dim_ok(self.model.layers[0].self_attn.head_dim))

    def _init_graph_runner(self, max_batch_size: int) -> None:
        """Capture the decode step per batch size (eagerly padded on CPU, which is how it is tested)."""
        from radix_backend.kernels.cuda_graph import CudaGraphDecodeRunner

        if self.tp is not None:
            raise ValueError("cuda_graph is not supported with tensor parallelism yet")

        def decode_fn(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)
            return self.model(input_ids, positions, self.kv_caches, self.attention_backend, meta, rows)

        self.graph_runner = CudaGraphDecodeRunner(
            decode_fn, max_batch_size=max_batch_size, device=self.device, max_context_len=self.context_length,
            max_kv_tokens=max(self.kv_pool.num_slots, max_batch_size * self.context_length),
            use_graphs=self.device.type == "cuda")
        self.graph_runner.capture()

    def _default_kv_tokens(self, cfg: KVPoolConfig, mem_fraction: float | None) -> int:
        available = _available_memory_bytes(self.device)
        if self.device.type == "cuda":
            return kv_tokens_for_budget(cfg, int(available * (mem_fraction or 0.8)))
        tokens = kv_tokens_for_budget(cfg, int(available * (mem_fraction or CPU_DEFAULT_KV_FRACTION)))
        return tokens if mem_fraction else min(tokens, CPU_MAX_DEFAULT_KV_TOKENS)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def context_length(self) -> int:
        """max_position_embeddings, or less where `models/config_check.py` caps it (a shorter sliding
        window, LongRoPE's short-factor range)."""
        return self.limits.context_length

    @property
    def matmul_tile_rows(self) -> int:
        """Activation rows the native low-bit matmul takes per pass over the weights (1 without it)."""
        if self.device.type != "cpu":
            return 1
        with settings.active(self.kernel_settings):
            return native.matmul_tile_rows()

    def forward(self, batch: ForwardInput) -> torch.Tensor:
        """Run the batch; returns float32 logits [len(logits_indices), vocab]. With tensor
        parallelism every rank is sent the batch first and runs its shard alongside."""
        if self.tp is None:
            return self.forward_local(batch)
        with self.tp.lockstep(batch):
            return self.forward_local(batch)

    def _serve_rank0(self) -> None:
        """A worker rank: run every forward rank 0 sends until it sends the stop message."""
        while (batch := self.tp.receive_batch()) is not None:
            self.forward_local(batch)

    def forward_local(self, batch: ForwardInput) -> torch.Tensor:
        """This process's part of the forward (all of it without tensor parallelism)."""
        with settings.active(self.kernel_settings):
            return self._forward_on_threads(batch)

    def _forward_on_threads(self, batch: ForwardInput) -> torch.Tensor:
        threads = torch.get_num_threads()
        if (self.device.type != "cpu" or threads == 1 or len(batch.input_ids) > SINGLE_THREAD_MAX_TOKENS
                or threading.current_thread() is threading.main_thread()):
            return self._forward_local(batch)
        torch.set_num_threads(1)
        self.model.head_threads = threads  # the LM head, one large matmul, still gets them all
        try:
            with settings.native_matmul_threads(threads):  # and so do our own matmuls (no OpenMP hand-off)
                return self._forward_local(batch)
        finally:
            self.model.head_threads = 0
            torch.set_num_threads(threads)

    def _forward_local(self, batch: ForwardInput) -> torch.Tensor:
        dev = self.device
        meta = AttentionMetadata.build(batch.prefix_lens, batch.extend_lens, batch.kv_indices.to(dev),
                                       batch.out_slots.to(dev), dev)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=dev)
        if (self.graph_runner is not None and batch.logits_indices == list(range(len(batch.input_ids)))
                and self.graph_runner.can_run(meta)):
            return self.graph_runner.run(input_ids, positions, meta)
        logits_indices = torch.tensor(batch.logits_indices, dtype=torch.int64, device=dev)
        return self.model(input_ids, positions, self.kv_caches, self.attention_backend, meta, logits_indices,
                          argmax_rows=batch.argmax_rows)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (a no-op for one process)."""
        if self.tp is not None:
            self.tp.shutdown()


def _masked_layers(model: torch.nn.Module) -> bool:
    """Whether any attention layer has a sliding window or soft-capped scores."""
    return any(not layer.self_attn.mask.plain for layer in model.layers)
