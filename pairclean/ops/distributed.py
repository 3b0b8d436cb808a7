"""torch.distributed glue for runs launched by torchrun (NCCL for training on GPUs, gloo on CPU and for scoring).

pairclean never manages processes itself: torchrun (or SLURM + torchrun) starts one process per
rank with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR set, and these helpers join the group.
Without those variables every helper is a no-op, so the same code runs single-process.
"""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from pairclean.errors import UserError


# Where NCCL is the group (training on GPUs), a gloo group beside it for the values the host holds
# (a loss, "every rank still has a batch", pickled objects): through NCCL each would be copied to
# the GPU and back, and each copy waits for every step queued on the device. None: the one group.
_host_group = None


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device_type: str | None = None, timeout_minutes: int = 120, share_gpus: bool = False) -> None:
    """Join the process group torchrun describes in the environment (once).

    `share_gpus` (scoring, whose collectives are a few numbers and pickled objects): the group is
    gloo on every node, and a node may run more ranks than it has GPUs, the ranks sharing them in
    turn (`gpu_of_rank`; NCCL refuses two ranks on one GPU, and a choice made per node could
    differ between nodes). A host-bound pipeline - one prefetching thread, one JPEG decoder behind a
    process-wide lock, one interpreter dispatching the model - then runs once per process, and the
    GPU takes their kernels in turn. Without it (training: DDP's gradients go through NCCL), such a
    launch is refused."""
    if not launched_by_torchrun() or dist.is_initialized():
        return
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "gloo"
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        if local_world_size() > gpus and not share_gpus:
            raise UserError(f"{local_world_size()} ranks on this node and {gpus} GPU(s): training runs one rank "
                            f"per GPU (start {gpus} a node)")
        torch.cuda.set_device(gpu_of_rank())
        backend = "gloo" if share_gpus else "nccl"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    global _host_group
    _host_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
                   if backend == "nccl" else None)
    atexit.register(leave_group)


def leave_group() -> None:
    """Destroy the process group while the interpreter is still whole. A process that exits with
    the group alive leaves gloo's worker threads holding tensors; tearing those down during
    interpreter finalisation aborts the process (SIGABRT, "terminate called without an active
    exception"), seen on a rank that finished before rank 0 had written the output."""
    global _host_group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # every group, the host group too
    _host_group = None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gpu_of_rank() -> int:
    """This rank's GPU: its local rank, wrapping round where a node runs more ranks than it has GPUs."""
    return local_rank() % max(1, torch.cuda.device_count())


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
    dist.broadcast_object_list(box, src=src, group=_host_group)
    return box[0]


def _host_reduce(value: float, op) -> float:
    if not is_distributed():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=_host_group)
    return float(t.item())


def all_reduce_sum(value: float) -> float:
    """The sum of `value` over all ranks (e.g. pairs scored, for the job's throughput)."""
    return _host_reduce(value, dist.ReduceOp.SUM)


def gather_objects(obj) -> list:
    """Every rank's `obj` (pickled), in rank order, on every rank (per-pair arrays at an epoch's end)."""
    if not is_distributed():
        return [obj]
    parts = [None] * world_size()
    dist.all_gather_object(parts, obj, group=_host_group)
    return parts


def on_main(fn):
    """Run `fn` on rank 0 only and hand its result to every rank; a UserError on rank 0 is
    raised on every rank (so no rank waits forever for a broadcast that never comes)."""
    if not is_distributed():
        return fn()
    outcome = None
    if is_main():
        try:
            outcome = ("ok", fn())
        except UserError as exc:
            outcome = ("error", str(exc))
    kind, value = broadcast_object(outcome)
    if kind == "error":
        raise UserError(value)
    return value


def all_reduce_min(value: float) -> float:
    """The minimum of `value` over all ranks (e.g. whether every rank still has a full batch)."""
    return _host_reduce(value, dist.ReduceOp.MIN)


def all_reduce_mean(value: float) -> float:
    return all_reduce_sum(value) / world_size()


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the sum over ranks of the gradient of its own rows:
    what torch.distributed.nn's all_gather does (deprecated since torch 2.14 for a private module's),
    with one all_reduce in the backward, which gloo and NCCL both have."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor)
        ctx.rows = tensor.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # every rank's loss depends on every rank's rows
        start = dist.get_rank() * ctx.rows
        return grad[start:start + ctx.rows]


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, concatenated in rank order, differentiable (open_clip's gather_with_grad):
    the backward sends each rank the gradient of every rank's loss with respect to its own rows,
    so with DistributedDataParallel's gradient averaging the update equals one process training
    on the global batch. Every rank gives the same number of rows."""
    if not is_distributed():
        return tensor
    return _GatherWithGrad.apply(tensor)


def default_device_for_rank(requested: str) -> str:
    """Under torchrun with CUDA, `auto` means this rank's own GPU."""
    if requested == "auto" and launched_by_torchrun() and torch.cuda.is_available():
        return f"cuda:{gpu_of_rank()}"
    return requested
