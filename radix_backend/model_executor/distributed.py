"""Tensor parallelism over torch.distributed: process groups, worker processes, the per-forward broadcast.

Rank 0 is the Engine's process: it owns the scheduler, the radix cache and sampling. Ranks
1..N-1 hold only their weight shards and their KV heads. For every forward, rank 0 broadcasts the
ForwardInput, then all ranks run the same forward; the row-parallel layers all-reduce inside it.

Two launch modes:
- spawned (the default): rank 0 starts ranks 1..N-1 as `python -m radix_backend.model_executor.tp_worker`
  subprocesses that rendezvous on a TCPStore bound to a free loopback port. They load their own
  shards from the checkpoint path and serve forwards until rank 0 sends a stop message.
- torchrun: when RANK / WORLD_SIZE are set, every rank runs the user's script; `Engine(...,
  tp_size=N)` returns on rank 0 only, while the other ranks serve forwards inside the constructor
  and exit (SystemExit(0)) when rank 0 shuts down.

Two process groups, so that idling never looks like a failure: `group` (NCCL on CUDA, gloo on CPU)
carries the all-reduces inside a forward and has a bounded timeout, so a stuck rank raises instead
of hanging; `control` (gloo, CPU objects) carries the per-forward broadcast, on which workers wait
while the engine is idle, so its timeout is very long. A dead rank closes its sockets, which
fails the next collective on the others at once; rank 0 also polls its spawned workers before
each forward and raises TensorParallelError naming the rank that exited.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RadixBackendError

logger = logging.getLogger(__name__)

# env of spawned workers (distinct from torchrun's RANK/WORLD_SIZE so the two modes never mix)
ENV_RANK, ENV_WORLD, ENV_PORT = "RADIX_TP_RANK", "RADIX_TP_WORLD_SIZE", "RADIX_TP_PORT"
IDLE_TIMEOUT = timedelta(days=30)  # workers waiting for the next batch
STOP_GRACE_S = 10.0
GROUP_RELEASE_PAUSE_S = 0.1  # lets gloo's worker threads free the last work before the groups go


class TensorParallelError(RadixBackendError, RuntimeError):
    """A tensor-parallel rank failed or exited; shut this engine down and create a new one."""


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and ENV_RANK not in os.environ


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group and the handles to talk to the others."""

    rank: int
    size: int
    device: torch.device
    group: Any  # ProcessGroup for the all-reduces inside a forward
    control: Any  # gloo ProcessGroup for the per-forward broadcast
    workers: list[subprocess.Popen] = field(default_factory=list)  # ranks 1..N-1 when we spawned them
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False
    _broken: str | None = None  # why the ranks may be out of step; set on the first failure

    # ---- used by the model ------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    # ---- setup --------------------------------------------------------------------------------
    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (e.g. KV slots: every rank's pool must match)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control))
        return int(t.item())

    # ---- rank 0 -----------------------------------------------------------------------------
    @contextmanager
    def lockstep(self, batch: Any) -> Iterator[None]:
        """Rank 0: send `batch` to every rank; the body runs this rank's part of the forward.

        Two threads never interleave broadcasts; a failure inside marks the group broken (the
        workers may still wait in this forward's collectives), and a failed collective becomes a
        TensorParallelError naming the dead rank where it can."""
        with self._lock:
            if self._closed:
                raise TensorParallelError("the tensor-parallel group is shut down; create a new Engine")
            if self._broken:
                raise TensorParallelError(f"an earlier tensor-parallel forward failed ({self._broken}); the ranks "
                                          "are out of step: shut this engine down and create a new one")
            self.check_workers()
            payload = dataclasses.replace(batch, kv_indices=batch.kv_indices.cpu(), out_slots=batch.out_slots.cpu(),
                                          logits_indices=[])  # workers need no logits
            try:
                self._collective(lambda: dist.broadcast_object_list([payload], src=0, group=self.control))
                try:
                    yield
                except Exception as exc:
                    raise self._as_tp_error(exc) from exc
            except BaseException as exc:
                self._broken = f"{type(exc).__name__}: {exc}"[:300]
                raise

    def mark_broken(self, reason: str) -> None:
        """Set after a failure that may leave the ranks out of step, so shutdown kills instead of talking."""
        self._broken = self._broken or reason

    def check_workers(self) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is not None:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; see its output above. "
                    "Shut this engine down and create a new one")

    def _collective(self, fn):
        try:
            return fn()
        except Exception as exc:
            error = self._as_tp_error(exc)
            if error is exc:
                raise
            raise error from exc

    def _as_tp_error(self, exc: Exception) -> Exception:
        """A communication failure as a TensorParallelError (naming a rank that exited); others unchanged."""
        if isinstance(exc, TensorParallelError) or not isinstance(exc, (RuntimeError, dist.DistError)) \
                or not self._is_comm_error(exc):
            return exc
        time.sleep(0.2)  # let a crashing peer finish exiting so its exit code can be named
        try:
            self.check_workers()
        except TensorParallelError as dead:
            return dead
        return TensorParallelError(f"tensor-parallel collective failed on rank {self.rank}: {exc}. A peer rank probably "
                                   "died or timed out; shut this engine down and create a new one")

    @staticmethod
    def _is_comm_error(exc: Exception) -> bool:
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc).lower()
        return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))

    def shutdown(self) -> None:
        """Rank 0: tell the workers to stop, wait for them (kill on timeout), drop the process groups."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self.shutdown)
            if self.rank == 0 and not self._broken and all(p.poll() is None for p in self.workers):
                try:
                    dist.broadcast_object_list([None], src=0, group=self.control)
                except Exception as exc:  # a dead peer: fall through to killing the rest
                    logger.warning("could not send stop to tensor-parallel workers: %s", exc)
            _reap(self.workers, 0.0 if self._broken else STOP_GRACE_S)
            self._release_groups()

    def _release_groups(self) -> None:
        """Destroy the process groups and drop our references, so their gloo threads are joined now.

        Left to interpreter exit (the engine object is often still alive then), a gloo thread still
        freeing its last work's tensors needs the GIL while Python finalizes and the process aborts
        ("terminate called without an active exception"); the pause lets it finish first."""
        time.sleep(GROUP_RELEASE_PAUSE_S)
        _destroy_groups()
        self.group = self.control = None
        gc.collect()

    # ---- ranks 1..N-1 ------------------------------------------------------------------------
    def receive_batch(self) -> Any:
        """Workers: wait for rank 0's next batch; None means stop (the groups are then closed)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        if box[0] is None:
            self._release_groups()
        return box[0]


def _reap(procs: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
            proc.kill()
            proc.wait(timeout=10)


def _destroy_groups() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - best effort on a broken group
            logger.debug("destroy_process_group: %s", exc)


def _resolve_rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank {local_rank} needs cuda:{local_rank} but only "
                         f"{torch.cuda.device_count()} CUDA devices are visible; lower tp_size")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _init_groups(backend: str, rank: int, size: int, forward_timeout_s: float, store=None) -> tuple[Any, Any]:
    kwargs = {"store": store, "rank": rank, "world_size": size} if store is not None else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=forward_timeout_s), **kwargs)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return dist.group.WORLD, control


def init_tensor_parallel(tp_size: int, device: torch.device, worker_args: dict[str, Any], *,
                         forward_timeout_s: float, startup_timeout_s: float) -> TensorParallel:
    """Join (torchrun, spawned worker) or create (rank 0, spawning ranks 1..N-1) the TP group.

    `worker_args` ({"model": checkpoint path, "config": EngineConfig fields}) tells spawned
    workers how to build their own ModelRunner. `forward_timeout_s` bounds one collective inside a
    forward; `startup_timeout_s` the workers' start (they import torch and load weights).
    """
    if ENV_RANK in os.environ:  # we are a worker spawned by rank 0
        rank, size = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
        if size != tp_size:
            raise ValueError(f"worker started for world size {size} but tp_size={tp_size}")
        device = _resolve_rank_device(device, rank)
        store = dist.TCPStore("127.0.0.1", int(os.environ[ENV_PORT]), size, is_master=False,
                              timeout=timedelta(seconds=startup_timeout_s))
        store.set(f"radix_tp/hello/{rank}", "1")
        group, control = _init_groups(_backend_for(device), rank, size, forward_timeout_s, store)
        return TensorParallel(rank, size, device, group, control)
    if launched_by_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if size != tp_size:
            raise ValueError(f"torchrun started {size} processes but tp_size={tp_size}; "
                             f"pass --nproc-per-node {tp_size} or tp_size={size}")
        device = _resolve_rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
        if dist.is_initialized():
            if dist.get_world_size() != size:
                raise ValueError("torch.distributed is already initialised with another world size")
            control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            return TensorParallel(rank, size, device, dist.group.WORLD, control)
        group, control = _init_groups(_backend_for(device), rank, size, forward_timeout_s)
        return TensorParallel(rank, size, device, group, control)
    return _spawn_workers(tp_size, device, worker_args, forward_timeout_s, startup_timeout_s)


def _spawn_workers(tp_size: int, device: torch.device, worker_args: dict[str, Any], forward_timeout_s: float,
                   startup_timeout_s: float) -> TensorParallel:
    if dist.is_initialized():
        raise TensorParallelError(
            "torch.distributed is already initialised in this process (another tensor-parallel Engine?); "
            "shut that engine down first: one tensor-parallel engine per process")
    device = _resolve_rank_device(device, 0)
    store = dist.TCPStore("127.0.0.1", 0, tp_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=startup_timeout_s))
    threads = max(1, torch.get_num_threads() // tp_size) if device.type == "cpu" else torch.get_num_threads()
    args = json.dumps({**worker_args, "tp_size": tp_size, "threads": threads})
    workers = []
    try:
        for rank in range(1, tp_size):
            env = {**os.environ, ENV_RANK: str(rank), ENV_WORLD: str(tp_size), ENV_PORT: str(store.port)}
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key, None)
            workers.append(subprocess.Popen([sys.executable, "-m", "radix_backend.model_executor.tp_worker", args], env=env))
        _wait_for_hello(store, workers, startup_timeout_s)
        group, control = _init_groups(_backend_for(device), 0, tp_size, forward_timeout_s, store)
    except BaseException:
        for proc in workers:
            proc.kill()
        _reap(workers, 5.0)
        raise
    tp = TensorParallel(0, tp_size, device, group, control, workers)
    atexit.register(tp.shutdown)  # an engine never shut down still stops its workers at exit
    return tp


def _wait_for_hello(store, workers: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until every worker reached the store, failing fast if one exits first."""
    keys = [f"radix_tp/hello/{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        for rank, proc in enumerate(workers, start=1):
            if proc.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                                          "while starting; see its output above")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel workers did not start within {timeout_s:.0f} s")
        time.sleep(0.05)
