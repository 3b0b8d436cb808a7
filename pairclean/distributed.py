"""torch.distributed glue for runs launched by torchrun (NCCL on GPUs, gloo on CPU).

pairclean never manages processes itself: torchrun (or SLURM + torchrun) starts one process per
rank with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR set, and these helpers join the group.
Without those variables every helper is a no-op, so the same code runs single-process.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device_type: str | None = None, timeout_minutes: int = 120) -> None:
    """Join the process group torchrun describes in the environment (once)."""
    if not launched_by_torchrun() or dist.is_initialized():
        return
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def broadcast_object(obj=None, src: int = 0):
    """`obj` from rank `src` on every rank (pickled; for small objects such as beta or a unit list)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_any(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (e.g. an error one rank hit)."""
    if not is_distributed():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_reduce_sum(value: float) -> float:
    """The sum of `value` over all ranks (e.g. pairs scored, for the job's throughput)."""
    if not is_distributed():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def default_device_for_rank(requested: str) -> str:
    """Under torchrun with CUDA, `auto` means this rank's own GPU."""
    if requested == "auto" and launched_by_torchrun() and torch.cuda.is_available():
        return f"cuda:{local_rank()}"
    return requested
