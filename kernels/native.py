"""Native CPU kernels (`csrc/cpu_kernels.c`), compiled once per machine and called through ctypes.

A CPU decode step is dominated by many small torch ops and by gathering K/V out of the paged pool;
the C kernels read the pool in place and fuse the element-wise ops (see the C file). The source is
plain C, so the system C compiler (`$CC`, else `cc`) builds it in well under a second with
`-O3 -march=native` (or the lower x86 level `RADIX_BACKEND_CPU_ISA` names, see cpu_isa.py); the library is cached under the user cache dir keyed by the source, the flags,
the compiler and the CPU, so later processes only load it. Without a compiler, or with the kernel
settings' `native` off (`EngineConfig.native_kernels`), `available()` is False (a missing compiler is
logged once) and callers keep their torch path, which stays the reference the kernels are tested
against.

The kernels take fp32 CPU tensors (`supports(...)` says whether they can run; choosing the torch
path otherwise is the caller's job); the wrappers make their inputs contiguous.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

from . import cpu_isa, settings
from .user_cache import CACHE_ENV, cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "cpu_kernels.c", CSRC / "extend_attention.c", CSRC / "decode_stack.c", CSRC / "q8_matmul.c",
           CSRC / "q4_matmul.c", CSRC / "head_screen.c", CSRC / "f32_matmul.c", CSRC / "moe.c", CSRC / "q4_pack.c",
           CSRC / "ggml_rows.c", CSRC / "thread_pool.c")
HEADERS = (CSRC / "cpu_kernels.h", CSRC / "fast_exp.h", CSRC / "moe.h", CSRC / "prefetch.h", CSRC / "q16.h",
           CSRC / "q4.h", CSRC / "thread_pool.h")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-pthread")


def target_flags() -> tuple[str, ...]:
    """FLAGS with the instruction set the environment targets (cpu_isa.py: this CPU's by default)."""
    march = cpu_isa.march_flag()
    return tuple(march if flag == "-march=native" else flag for flag in FLAGS)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rb_decode_attention": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, _P, _P, _I], ctypes.c_int),
    "rb_decode_attention_invariant": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, _F, _P, _P, _P, _I, _I],
                                      ctypes.c_int),
    "rb_extend_attention": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, ctypes.c_int, _P, _P, _I],
                            ctypes.c_int),
    "rb_extend_attention_window": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, ctypes.c_int, _I, _F, _P,
                                    _P, _I, _I], ctypes.c_int),
    "rb_extend_attention_shared": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, ctypes.c_int, _I, _F, _P,
                                    _P, _P, _I, _I], ctypes.c_int),
    "rb_round_bf16": ([_P, _I, _P], None),
    "rb_store_kv": ([_P, _I, _P, _I, _I, _I, _P, _I, _P, _P, _I], ctypes.c_int),
    "rb_add_rms_norm_threads": ([_P, _P, _P, _I, _I, _F, _P, _P, _I], None),
    "rb_rope_threads": ([_P, _I, _I, _I, _I, _P, _P, _I, _P, _I], None),
    "rb_silu_and_mul_threads": ([_P, _I, _I, _P, _I], None),
    "rb_silu_and_mul_bf16": ([_P, _I, _I, _P], None),
    "rb_gelu_tanh_and_mul_threads": ([_P, _I, _I, _P, _I], None),
    "rb_argmax_threads": ([_P, _I, _I, _P, _I], None),
    "rb_sigmoid_gated_add": ([_P, _P, _P, _I, _I], None),
    "rb_q4_matmul": ([_P, _P, _I, _P, _I, _I], ctypes.c_int),
    "rb_q4_glu": ([_P, _P, _I, _P, _I, _I, _I], ctypes.c_int),
    "rb_q4_screen_table": ([_P, _P, _I], ctypes.c_int),
    "rb_q4_screened": ([_P, _P, _P, _I, _I, _P, _I], ctypes.c_int),
    "rb_q4_pack_codes": ([_P, _I, _I, _I, _P, _P, _I], None),
    "rb_ggml_pack": ([_I, _P, _I, _I, _I, _I, _I, _P, _P, _I], ctypes.c_int),
    "rb_ggml_rows": ([_I, _P, _I, _I, _I, _P, _I, _P], ctypes.c_int),
    "rb_q4_smallest_8bit_code": ([], ctypes.c_int),
    "rb_q4_tile_rows": ([], ctypes.c_int),
    "rb_q8_matmul": ([_P, _P, _I, _P, _I], ctypes.c_int),
    "rb_q8_tiled_supported": ([], ctypes.c_int),
    "rb_q8_tiled_matmul": ([_P, _P, _I, _P, _I, _I], ctypes.c_int),
    "rb_moe_route": ([_P, _I, _I, _I, _I, _P, _P], None),
    "rb_moe_experts": ([_P, _P, _I, _P, _I, _P, _P, _I, _P, _I, _I], ctypes.c_int),
    "rb_decode_stack": ([_P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I], ctypes.c_int),
}


class NativeKernelError(RuntimeError):
    """A native kernel reported a failure (e.g. out of memory for its scratch space)."""


def _cpu_identity() -> str:
    """The CPU's model and flags: a library built with -march=native runs only where they match."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part",
            "isa", "uarch", "vendor_id", "cpu family", "model\t")  # x86, ARM and RISC-V spellings
    lines = [ln for ln in info.splitlines() if ln.startswith(keys)]
    return "\n".join([platform.machine(), *sorted(set(lines))])


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of the kernels' C sources: what they compute changes only with it (and the flags)."""
    return hashlib.sha256("\0".join(path.read_text() for path in (*SOURCES, *HEADERS)).encode()).hexdigest()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def build(compiler: str, out_dir: Path, flags: tuple[str, ...] | None = None) -> Path:
    """Compile the kernels into `out_dir` (reused when the same build exists) and return the path.
    `flags` (default: `target_flags()`) other than FLAGS serve the tests, which build the AVX2 and
    portable code paths too."""
    flags = target_flags() if flags is None else flags
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source_digest(), " ".join(flags), version, _cpu_identity()]).encode())
    target = out_dir / f"rb_cpu_kernels_{key.hexdigest()[:16]}.so"
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(out_dir)
    if target.exists():
        check_private(target)  # loading a library runs its code: only ever one this user wrote
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.chmod(tmp, 0o700)  # whatever the umask: check_private must accept it on the next load
        os.replace(tmp, target)  # atomic: concurrent builders each publish a complete file
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def check_private(path: Path) -> None:
    """Raise unless `path` is a directory or regular file (not a link) owned by this user and not
    writable by others: a library planted in a shared cache would run as this user."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
        raise RuntimeError(f"{path} is not a plain directory or file; refusing to load native kernels from it")
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"{path} is not owned by this user or is writable by others; refusing to load native "
                           f"kernels from it (fix its owner/permissions, or point {CACHE_ENV} elsewhere)")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (with the reason logged once) when they cannot be built here."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC or install gcc): native CPU kernels off, torch ops used")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler, cache_dir(create=False) / "native")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels unavailable, torch ops used: %s", exc)
        return None
    return declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of the kernels on a loaded library."""
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def check_activation_bits(bits: int) -> None:
    """The integer matmuls (4-bit, tiled 8-bit, decode stack) take activations as 8 or 16 bits."""
    if bits not in (8, 16):
        raise ValueError(f"activation_bits must be 8 or 16, got {bits}")


def available() -> bool:
    """The kernels may run: the settings allow them and they built here."""
    return settings.current().native and library() is not None


def matmul_tile_rows() -> int:
    """Activation rows the low-bit matmul takes per pass over the weights (8 on AVX-512, 4 on AVX2,
    1 portable; 1 without the kernels)."""
    return int(library().rb_q4_tile_rows()) if available() else 1


def supports(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """True when the kernels can run on these tensors: CPU tensors of `dtypes` (most kernels are
    fp32 only), and the library loaded."""
    for t in tensors:
        if t.dtype not in dtypes or t.device.type != "cpu":
            return False
    return available()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---- argument checks: the C code trusts its arguments, so every wrapper checks them first ----------
def check_float32(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d fp32 CPU tensor, got {t.dim()}-d {t.dtype} on {t.device}")


def checked_indices(name: str, t: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """An int index tensor as the kernels read it: int64, contiguous, 1-d (of `length`)."""
    if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1 or (length is not None and t.numel() != length):
        raise ValueError(f"{name} must be a 1-d int tensor{f' of {length}' if length is not None else ''}, "
                         f"got {t.dim()}-d {t.dtype} with {t.numel()} entries")
    return t.to(torch.int64).contiguous()


def check_within(name: str, t: torch.Tensor, upper: int) -> None:
    """Every entry of `t` in [0, upper)."""
    if t.numel() and (int((bounds := torch.aminmax(t)).min) < 0 or int(bounds.max) >= upper):
        raise ValueError(f"{name} holds values outside [0, {upper})")


def check_ranges(name: str, starts: torch.Tensor, lens: torch.Tensor, total: int) -> None:
    """Every non-empty range [starts[b], starts[b] + lens[b]) inside [0, total). The kernels read
    nothing for an empty (or negative) one: a padding row, whose output is discarded."""
    if any(n > 0 and (s < 0 or s + n > total) for s, n in zip(starts.tolist(), lens.tolist())):  # one per request
        raise ValueError(f"{name} ranges fall outside their {total} entries")


KV16_POOL = 2  # the kernels' `bf16` argument for a pool of bf16 rows (cpu_kernels.h)
POOL_DTYPES = (torch.float32, torch.bfloat16)  # what the attention kernels read a pool in


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     bf16: bool = False) -> tuple[int, int, int]:
    """(query heads, kv heads, the kernels' `bf16` mode) after checking q [T, Hq, D] against the
    caches [slots, Hkv, D]: fp32, or bf16 rows (which only the bf16 products read, rounded as they
    are: the same bits as the fp32 pool they were rounded from)."""
    check_float32("q", q, 3)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in POOL_DTYPES or cache.device.type != "cpu" or cache.dim() != 3:
            raise ValueError(f"{name} must be a 3-d fp32 or bf16 CPU tensor, got {cache.dim()}-d {cache.dtype} "
                             f"on {cache.device}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape and dtype")
    kv16 = k_cache.dtype == torch.bfloat16
    if kv16 and not bf16:
        raise ValueError("a bf16 KV pool is read with bf16 products only (bf16=True)")
    hq, hkv = q.shape[1], k_cache.shape[1]
    if q.shape[2] != k_cache.shape[2] or hkv == 0 or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (head size, GQA groups)")
    return hq, hkv, KV16_POOL if kv16 else int(bf16)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, CPU) rounded to bf16 exactly as the attention kernels' bf16 products round it (to
    nearest even, denormals to signed zero): what a bf16 KV pool stores."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"round_bf16 takes an fp32 CPU tensor, got {x.dtype} on {x.device}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    library().rb_round_bf16(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def head_rows_ok(x: torch.Tensor) -> bool:
    """x [T, H, D] whose heads sit contiguously within each row (e.g. a slice of a fused qkv)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """k, v [T, kv_heads, dim] (fp32) into pool rows `slots` of k_cache / v_cache (fp32, or bf16
    rounded as `round_bf16`) in one native pass. False (nothing written) where it does not apply:
    the caller stores them another way."""
    pool = k_cache.dtype
    if not (available() and k.dtype == v.dtype == torch.float32 and pool in (torch.float32, torch.bfloat16)
            and v_cache.dtype == pool
            and k.device.type == v.device.type == k_cache.device.type == v_cache.device.type == "cpu"
            and k.shape == v.shape and k.shape[1:] == k_cache.shape[1:] == v_cache.shape[1:]
            and head_rows_ok(k) and head_rows_ok(v) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.is_contiguous()
            and slots.numel() == k.shape[0]):
        return False
    kv_size = k.shape[1] * k.shape[2]
    if library().rb_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], kv_size,
                             slots.data_ptr(), k_cache.shape[0], k_cache.data_ptr(), v_cache.data_ptr(),
                             int(pool == torch.bfloat16)):
        raise IndexError(f"a KV slot is outside the pool of {k_cache.shape[0]} rows")
    return True


# ---- decode rows that begin with the same keys ---------------------------------------------------
SHARED_BLOCK_KEYS = 64  # the invariant kernels' softmax block (BLOCK_KEYS): only whole blocks are read together
# Requests per chunk that reads a shared prefix once, its members' query heads the rows of one tile
# (16 x 3 heads fill three 16-lane vectors; 32 requests x 3 kv heads on 2 threads: 6 tasks). Timing
# script, 32 requests behind 1,024 shared keys: 8 -> 16 members 0.49-0.64 -> 0.39-0.40 ms a layer
# (bf16 products), 0.95 -> 0.77-0.82 ms (fp32); 32 members left one thread idle for a third of it.
MAX_SHARING_MEMBERS = 16


class _KeySharingStruct(ctypes.Structure):
    _fields_ = [("order", _P), ("bounds", _P), ("shared", _P), ("chunks", _I)]


class KeySharing:
    """Decode rows in chunks whose requests begin with the same pool slots (`rb_key_sharing`): the
    invariant decode kernel loads and transposes those keys once per chunk instead of once per
    request. Built from the step's own slot table by `KeySharing.find`; changes no bit of any row.
    A chunk of at least one vector's lanes of rows (members x query heads per kv head) reads its
    shared blocks as one tile's rows; a smaller one (a transcript's few branches, one request's draft
    rows) loads each shared block once and its members take it in turn."""

    def __init__(self, chunks: list[tuple[list[int], int]]) -> None:
        self.order = torch.tensor([b for members, _ in chunks for b in members], dtype=torch.int64)
        self.bounds = torch.tensor([0] + [len(members) for members, _ in chunks], dtype=torch.int64).cumsum(0)
        self.shared = torch.tensor([shared for _, shared in chunks], dtype=torch.int64)
        self.struct = _KeySharingStruct(self.order.data_ptr(), self.bounds.data_ptr(), self.shared.data_ptr(),
                                        len(chunks))
        self._checked: torch.Tensor | None = None  # the lens last checked (every layer of a step passes the same)

    @classmethod
    def find(cls, kv_indices: torch.Tensor, starts: list[int], lens: list[int],
             max_members: int = MAX_SHARING_MEMBERS) -> KeySharing | None:
        """Chunks of the requests whose keys kv_indices[starts[b]:][:lens[b]] begin with at least
        one whole block of the same slots (requests continuing one radix node; `_block_chunks`
        picks the depth each group shares), every other request alone; None when no two requests
        share a block."""
        slots = kv_indices.cpu()
        ends = [slots[start + SHARED_BLOCK_KEYS - 1:start + n - 1:SHARED_BLOCK_KEYS].tolist() for start, n in zip(starts, lens)]
        chunks = _block_chunks(list(range(len(lens))), 0, ends, lens, max_members)[1]
        if all(len(members) == 1 for members, _ in chunks):
            return None
        return cls(chunks)

    def check(self, lens: torch.Tensor) -> None:
        """The C code trusts the chunks: every row exactly once, each shared prefix inside every member's keys."""
        if self._checked is not None and (lens is self._checked or torch.equal(lens, self._checked)):
            return
        batch = lens.numel()
        if self.order.numel() != batch or not torch.equal(self.order.sort().values, torch.arange(batch)):
            raise ValueError(f"key sharing does not cover the batch's {batch} rows exactly once")
        counts = self.bounds.diff()
        if bool((counts < 1).any()) or bool((self.shared < 0).any()):
            raise ValueError("key sharing has an empty chunk or a negative shared length")
        if bool((self.shared.repeat_interleave(counts) >= lens[self.order]).any()):
            raise ValueError("a shared prefix is not shorter than every member's keys")
        self._checked = lens


def _block_chunks(members: list[int], depth: int, ends: list[list[int]], lens: list[int],
                  max_members: int) -> tuple[int, list[tuple[list[int], int]]]:
    """The cheapest split into chunks (keys loaded, shared ones once a chunk) of `members`, which
    share their first `depth` whole blocks; ends[b][k] is the slot that ends request b's block k.

    A slot holds one token's K/V after one prefix, so two requests with the same slot at a position
    have the same slots before it: equal block ends mean equal blocks, and the requests form a trie
    over their block ends. At each node the members either read its `depth` blocks together (one
    chunk, several of at most `max_members`) or split by their next block, whichever loads fewer
    keys: a batch's branches of one transcript share it even where every request of the batch also
    begins with the same short system prompt."""
    if len(members) == 1:
        return lens[members[0]], [(members, 0)]
    first, common = ends[members[0]], len(ends[members[0]])
    for b in members[1:]:  # the blocks all of them share: no split before their end
        e, d = ends[b], depth
        while d < common and d < len(e) and e[d] == first[d]:
            d += 1
        common = d
    if common > depth:
        return _block_chunks(members, common, ends, lens, max_members)
    shared = depth * SHARED_BLOCK_KEYS
    together = -(-len(members) // max_members) * shared + sum(lens[b] - shared for b in members)
    children: dict[int, list[int]] = {}
    alone = []
    for b in members:
        if len(ends[b]) > depth:
            children.setdefault(ends[b][depth], []).append(b)
        else:
            alone.append(b)
    cost, chunks = sum(lens[b] for b in alone), [([b], 0) for b in alone]
    for group in children.values():
        group_cost, group_chunks = _block_chunks(group, depth + 1, ends, lens, max_members)
        cost += group_cost
        chunks += group_chunks
    if depth and together <= cost:
        return together, [(members[i:i + max_members], shared) for i in range(0, len(members), max_members)]
    return cost, chunks


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
                     starts: torch.Tensor, lens: torch.Tensor, scale: float, with_lse: bool = False,
                     threads: int = 1, invariant: bool = False, softcap: float | None = None,
                     sharing: KeySharing | None = None, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query row per request over its keys at `kv_indices[starts[b] : starts[b] + lens[b]]`,
    read from the pool in place. q [B, Hq, D]; caches [slots, Hkv, D]; returns (out [B, Hq, D],
    lse [B, Hq] or None). A request with lens[b] < 1 (padding) reads nothing and gets an undefined
    row; every slot must lie inside the pool. `invariant` (head sizes that are multiples of 16):
    each row gets exactly the bits `extend_attention` gives that row, whatever the batch (about
    1.5x the time of the default kernel, which splits long requests' keys over the threads).
    `softcap` (Gemma 2): scores capped as softcap * tanh(s / softcap); the invariant kernel runs it.
    `sharing` (invariant kernel): chunks of requests that begin with the same slots, read once.
    `bf16` (invariant kernel, head sizes that are multiples of 32): the extend kernel's bf16 products."""
    hq, hkv, mode = _check_attention(q, k_cache, v_cache, bf16)
    batch, _, dim = q.shape
    check_softcap(softcap, dim)
    _check_bf16(bf16, dim)
    kv_indices = checked_indices("kv_indices", kv_indices)
    starts, lens = checked_indices("starts", starts, batch), checked_indices("lens", lens, batch)
    check_ranges("starts/lens", starts, lens, kv_indices.numel())
    check_within("kv_indices", kv_indices, k_cache.shape[0])
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32) if with_lse else None
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_indices.data_ptr(), starts.data_ptr(),
            lens.data_ptr(), batch, hkv, hq // hkv, dim, scale)
    if (invariant or softcap or mode == KV16_POOL) and extend_attention_dim_ok(dim):  # a bf16 pool: this kernel
        if sharing is not None:
            sharing.check(lens)
        shared = ctypes.byref(sharing.struct) if sharing is not None else None
        rc = library().rb_decode_attention_invariant(*args, softcap or 0.0, shared, out.data_ptr(), _ptr(lse),
                                                     threads, mode)
    else:
        rc = library().rb_decode_attention(*args, out.data_ptr(), _ptr(lse), threads)
    if rc != 0:
        raise NativeKernelError("decode attention could not allocate its scratch memory")
    return out, lse


def check_softcap(softcap: float | None, dim: int) -> None:
    """A soft-capped score needs a cap > 0 and the extend kernel's head sizes (multiples of 16)."""
    if softcap is not None and not (softcap > 0 and extend_attention_dim_ok(dim)):
        raise ValueError(f"soft-capped attention needs a cap > 0 and a head size that is a multiple of 16, "
                         f"got softcap={softcap!r}, head size {dim}")


def extend_attention_dim_ok(dim: int) -> bool:
    """The extend kernel handles head sizes that are multiples of 16 (all common ones)."""
    return dim % 16 == 0


def bf16_attention_dim_ok(dim: int) -> bool:
    """The kernels' bf16 products take head sizes that are multiples of 32 (64, 96, 128, 256)."""
    return dim % 32 == 0


def _check_bf16(bf16: bool, dim: int) -> None:
    if bf16 and not bf16_attention_dim_ok(dim):
        raise ValueError(f"bf16 attention products need a head size that is a multiple of 32, got {dim}")


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
                     q_starts: torch.Tensor, q_lens: torch.Tensor, kv_starts: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float, causal: bool = True, with_lse: bool = False,
                     threads: int = 1, window: int | None = None, softcap: float | None = None,
                     bf16: bool = False, sharing: KeySharing | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Many query rows per request over its keys, read from the pool in place. Request b owns q rows
    [q_starts[b], + q_lens[b]) and keys at `kv_indices[kv_starts[b] : + kv_lens[b]]`; causal: its
    new token i sees its first kv_lens[b] - q_lens[b] + i + 1 keys (with a sliding `window`, only
    the last `window` of those); `softcap` (Gemma 2) caps every score as softcap * tanh(s / softcap);
    `bf16`: Q, K, V and the probabilities rounded to bf16 and multiplied in pairs with fp32 sums
    (vdpbf16ps where the CPU has it; the same bits on every build with fused multiply-adds; head
    sizes that are multiples of 32). `sharing` (`KeySharing.find` over the requests' cached
    prefixes): requests that begin with the same slots attend those keys' whole blocks in full
    tiles first, the same bits (ignored with a window). q [T, Hq, D]; caches [slots, Hkv, D]; int64
    index tensors; returns (out [T, Hq, D], lse [T, Hq] or None)."""
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal attention and window >= 1, got window={window!r}")
    hq, hkv, mode = _check_attention(q, k_cache, v_cache, bf16)
    tokens, _, dim = q.shape
    check_softcap(softcap, dim)
    _check_bf16(bf16, dim)
    batch = q_starts.numel()
    kv_indices = checked_indices("kv_indices", kv_indices)
    q_starts, q_lens, kv_starts, kv_lens = (checked_indices(name, t, batch) for name, t in (
        ("q_starts", q_starts), ("q_lens", q_lens), ("kv_starts", kv_starts), ("kv_lens", kv_lens)))
    check_ranges("q_starts/q_lens", q_starts, q_lens, tokens)
    check_ranges("kv_starts/kv_lens", kv_starts, kv_lens, kv_indices.numel())
    if batch and causal and bool((kv_lens < q_lens).any()):
        raise ValueError("causal attention needs kv_lens >= q_lens (the new tokens' keys are in the pool)")
    check_within("kv_indices", kv_indices, k_cache.shape[0])
    if sharing is not None:
        sharing.check((kv_lens - q_lens if causal else kv_lens) + 1)  # shared keys within what every row sees
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(tokens, hq, dtype=torch.float32) if with_lse else None
    rc = library().rb_extend_attention_shared(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_indices.data_ptr(), q_starts.data_ptr(),
        q_lens.data_ptr(), kv_starts.data_ptr(), kv_lens.data_ptr(), len(q_lens), hkv, hq // hkv, dim, scale,
        int(causal), window or 0, softcap or 0.0, None if sharing is None else ctypes.byref(sharing.struct),
        out.data_ptr(), _ptr(lse), threads, mode)
    if rc == -2:
        raise ValueError(f"extend attention needs a head size that is a multiple of 16, got {dim}")
    if rc == -3:
        raise ValueError("key sharing reaches past a member's cached prefix")
    if rc != 0:
        raise NativeKernelError("extend attention could not allocate its scratch memory")
    return out, lse


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); with x None, (rms_norm(residual) * weight, residual)."""
    dim = residual.shape[-1]
    if residual.dtype != torch.float32 or weight.shape != (dim,) or weight.dtype != torch.float32 \
            or (x is not None and (x.shape != residual.shape or x.dtype != torch.float32)):
        raise ValueError(f"add_rms_norm needs fp32 x and residual of one shape [..., {dim}] and a [{dim}] fp32 weight")
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    new_residual = residual if x is None else torch.empty_like(residual)
    x = None if x is None else x.contiguous()
    library().rb_add_rms_norm_threads(_ptr(x), residual.data_ptr(), weight.contiguous().data_ptr(),
                                      residual.numel() // dim, dim, eps, out.data_ptr(),
                                      None if x is None else new_residual.data_ptr(), settings.matmul_threads())
    return out, new_residual


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x [T, H, D] (see `head_rows_ok`) into a new contiguous tensor."""
    if not head_rows_ok(x) or x.dtype != torch.float32:
        raise ValueError("rope needs fp32 x [T, H, D] with each row's heads contiguous")
    tokens, heads, dim = x.shape
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or not cos_sin_cache.is_contiguous() \
            or rot % 2 or rot > dim:
        raise ValueError(f"the RoPE table must be contiguous fp32 [positions, rot] with an even rot <= {dim}")
    positions = checked_indices("positions", positions, tokens)
    check_within("positions", positions, cos_sin_cache.shape[0])
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    library().rb_rope_threads(x.data_ptr(), x.stride(0), tokens, heads, dim, positions.data_ptr(),
                              cos_sin_cache.data_ptr(), rot, out.data_ptr(), settings.matmul_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """fp32 or bf16 x [..., 2d]; computed in fp32 either way, returned in x's dtype."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs fp32 or bf16 x [..., 2d], got {x.dtype} [..., {x.shape[-1]}]")
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    if x.dtype == torch.bfloat16:
        library().rb_silu_and_mul_bf16(x.data_ptr(), x.numel() // (2 * d), d, out.data_ptr())
    else:
        library().rb_silu_and_mul_threads(x.data_ptr(), x.numel() // (2 * d), d, out.data_ptr(), settings.matmul_threads())
    return out


def argmax_rows(x: torch.Tensor) -> list[int]:
    """torch.argmax(x, dim=-1).tolist() for fp32 x [rows, n] on the CPU (the first maximum of a
    row, or its first NaN), the rows split over the kernel threads: greedy sampling's pick."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or x.shape[1] < 1:
        raise ValueError(f"argmax_rows needs fp32 CPU x [rows, n >= 1], got {x.dtype} {list(x.shape)} on {x.device}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library().rb_argmax_threads(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), settings.matmul_threads())
    return out.tolist()


def sigmoid_gated_add(y: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y + sigmoid(gate) * x for fp32 y, x [T, d] and gate [T, 1] (Qwen2-MoE's shared expert), as a
    new tensor; the decode stack adds it with the same function."""
    for name, t in (("y", y), ("gate", gate), ("x", x)):
        check_float32(name, t, 2)
    if x.shape != y.shape or gate.shape != (y.shape[0], 1):
        raise ValueError(f"y, x [T, d] and gate [T, 1]; got {tuple(y.shape)}, {tuple(x.shape)}, {tuple(gate.shape)}")
    out, gate, x = y.clone(memory_format=torch.contiguous_format), gate.contiguous(), x.contiguous()
    library().rb_sigmoid_gated_add(out.data_ptr(), gate.data_ptr(), x.data_ptr(), out.shape[0], out.shape[1])
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """fp32 x [..., 2d] -> gelu_tanh(gate) * up [..., d] (Gemma's GeGLU)."""
    if x.dtype != torch.float32 or x.shape[-1] % 2:
        raise ValueError(f"gelu_tanh_and_mul needs fp32 x [..., 2d], got {x.dtype} [..., {x.shape[-1]}]")
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    library().rb_gelu_tanh_and_mul_threads(x.data_ptr(), x.numel() // (2 * d), d, out.data_ptr(),
                                           settings.matmul_threads())
    return out
