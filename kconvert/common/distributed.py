"""One job over many processes: torch.distributed, as torchrun starts it.

`torchrun --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT --rdzv-id ID] -m kconvert
COMMAND ...` starts N processes per node, each with RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE in its environment. The first call that asks for the world joins the group:
NCCL with `cuda:LOCAL_RANK` when every local rank has a GPU of its own, else gloo (NCCL refuses
two ranks on one GPU; on a CPU-only node each local rank gets its own slice of the cores).
Without torchrun (no WORLD_SIZE) nothing here starts anything: world 1, rank 0, and every
helper below runs its step as a plain call.

Failure: `agree(step)` runs a step on every rank and, if it raised on any, raises the first
error (the earliest by wall clock, named by rank) on every rank, so a job never half-succeeds.
A rank that dies outright (killed, out of memory) breaks the others' next collective, which
raises a KconvertError saying so; torchrun also stops the remaining ranks and exits non-zero.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kconvert.errors import KconvertError

T = TypeVar("T")

# How long a collective waits for the slowest rank. Conversions are balanced to within one
# shard; a calibration layer is the same work on every rank.
TIMEOUT = datetime.timedelta(minutes=60)

# How long a rank waits at shutdown for the others to finish too.
SHUTDOWN_TIMEOUT = datetime.timedelta(seconds=60)

# Set when a collective or a step failed on any rank: shutdown then waits for no one.
_failed = False

LOST = ("lost contact with another rank (it failed or was killed: see its output or "
        "torchrun's summary): {exc}; nothing was marked complete, run the same command again "
        "with --resume")


def launched() -> bool:
    """True when torchrun (or another launcher of torch.distributed) started this process."""
    return "WORLD_SIZE" in os.environ


def init() -> None:
    """Join the process group the environment describes (once; nothing without a launcher)."""
    if not launched() or dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = "gloo"
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(local_rank % gpus)
        if local_world <= gpus:
            backend = "nccl"
    else:
        _take_core_share(local_rank, local_world)
    dist.init_process_group(backend, timeout=TIMEOUT)
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the process group in step with the other ranks, on the calling thread: after a
    job that went well, a barrier first (bounded by SHUTDOWN_TIMEOUT), so that no rank closes
    its connections while a peer is still sending on them, then the group is destroyed before
    the interpreter starts tearing down (a gloo group torn down under a peer, or left to
    interpreter exit, can abort a rank with "terminate called without an active exception").
    After a failure (a peer may be gone) it only destroys. Idempotent; also run at exit."""
    global _failed
    if not dist.is_initialized():
        return
    if not _failed:
        with contextlib.suppress(Exception):
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=SHUTDOWN_TIMEOUT)
            else:
                dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    _failed = False


def mark_failed() -> None:
    """This rank's job failed (its command exits non-zero): shutdown waits for no one, so that
    the others' collectives fail at once instead of waiting for this rank."""
    global _failed
    _failed = True


def _take_core_share(local_rank: int, local_world: int) -> None:
    """Local ranks on a CPU node split its cores instead of each using them all."""
    if not hasattr(os, "sched_getaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 * local_world:
        return
    share = cores[local_rank::local_world]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


def world() -> int:
    """Processes in the job (1 without a launcher)."""
    init()
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's rank, 0..world()-1 (0 without a launcher)."""
    init()
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the rank that prints, holds DST's lock and writes the files that say "done"."""
    return rank() == 0


@contextlib.contextmanager
def _collective() -> Iterator[None]:
    """A collective whose failure (a peer gone) reads as what it is."""
    global _failed
    try:
        yield
    except RuntimeError as exc:  # torch.distributed.DistBackendError is one
        _failed = True
        raise KconvertError(f"rank {rank()}: " + LOST.format(exc=exc)) from exc


def barrier() -> None:
    if world() > 1:
        with _collective():
            dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, by rank."""
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    with _collective():
        dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if world() == 1:
        return obj
    box = [obj]
    with _collective():
        dist.broadcast_object_list(box, src=src)
    return box[0]


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_(tensors: list[torch.Tensor], op: str) -> None:
    """Reduce `tensors` in place across ranks, op "sum" (in float64) or "max"; one collective
    for the whole list. A sum of float64 or int64 tensors is exact up to its reduction order."""
    if world() == 1 or not tensors:
        return
    dtype = torch.float64 if op == "sum" else torch.float32
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors]).to(_comm_device())
    with _collective():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    pos = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[pos:pos + n].reshape(t.shape))
        pos += n


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a flat uint8 view (a dtype every backend sends: gloo has no bf16)."""
    return t.reshape(-1).view(torch.uint8)


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `t` into every rank's `t` (same shape and dtype, contiguous), in place;
    returns `t`."""
    if world() == 1:
        return t
    buf = _bytes_of(t).to(_comm_device())
    with _collective():
        dist.broadcast(buf, src=src)
    _bytes_of(t).copy_(buf)
    return t


def all_gather_rows(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's rows (rank r holds counts[r] rows of t's row shape and dtype) on every
    rank, in rank order, on `t`'s device."""
    if world() == 1:
        return t
    device, most = _comm_device(), max(counts)
    padded = t.new_zeros((most, *t.shape[1:]))
    padded[:len(t)] = t
    mine = _bytes_of(padded).to(device)
    bufs = [torch.empty_like(mine) for _ in counts]
    with _collective():
        dist.all_gather(bufs, mine)
    rows = [b.view(t.dtype).reshape(padded.shape)[:n] for b, n in zip(bufs, counts, strict=True)]
    return torch.cat(rows).to(t.device)


def all_to_all(t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows of `t` to every rank (send[r] rows to rank r, in rank order) -> the rows every rank
    sent here (recv[r] from rank r, in rank order), on `t`'s device."""
    if world() == 1:
        return t
    device = _comm_device()
    out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=device)
    with _collective():
        dist.all_to_all_single(out, t.to(device).contiguous(), recv, send)
    return out.to(t.device)


def all_to_all_counts(send: list[int]) -> list[int]:
    """How many rows each rank sends here, from how many this rank sends to each."""
    if world() == 1:
        return send
    return all_to_all(torch.tensor(send, dtype=torch.int64), [1] * world(),
                      [1] * world()).tolist()


def agree(step: Callable[[], T]) -> T:
    """`step()` on every rank; if it raised on any rank, every rank raises the first error
    (the rank that raised it re-raises its own exception, the others a KconvertError that
    names the rank and repeats its message: file and tensor included)."""
    if world() == 1:
        return step()
    failure: Exception | None = None
    result = None
    try:
        result = step()
    except Exception as exc:  # reported to every rank below, then raised
        failure = exc
    report = None if failure is None else (time.time(), rank(), _describe(failure))
    try:
        reports = all_gather_object(report)
    except KconvertError:
        if failure is not None:  # the others are gone: this rank's own error is the news
            raise failure from None
        raise
    failed = [r for r in reports if r is not None]
    if not failed:
        return result  # type: ignore[return-value]
    global _failed
    _failed = True
    _, first_rank, message = min(failed)
    if failure is not None and first_rank == rank():
        raise failure
    raise KconvertError(f"rank {first_rank} failed: {message}") from failure


def _describe(exc: Exception) -> str:
    if isinstance(exc, KconvertError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def from_main(step: Callable[[], T]) -> T:
    """`step()` on rank 0 only (e.g. what touches DST), its result on every rank; an error
    there is raised on every rank."""
    result = agree(lambda: step() if is_main() else None)
    return broadcast_object(result)


def own_batch_ids(n_batches: int) -> range:
    """The batches (0..n_batches-1, in order) this rank runs: batch b on rank b % world."""
    return range(rank(), n_batches, world())


def own_batches(n_items: int, batch: int) -> list[int]:
    """Indices of the items (sequences) this rank runs: whole batches of `batch` items, batch b
    on rank b % world (`own_batch_ids`), so each batch is computed exactly as in a one-process
    run."""
    return [i for b in own_batch_ids(-(-n_items // batch))
            for i in range(b * batch, min((b + 1) * batch, n_items))]
