"""A cluster predicted from one process: each rank's step dry-run over a fake process group.

PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``) answers every
collective at once and moves no data, and FSDP2's ``fully_shard`` and DDP run on fake tensors
over it. So a rank of a 64-GPU job is one more dry run in this process, with its own shards and
its own buckets. Ranks whose shards have the same sizes hold the same memory, so one dry run
stands for each such class of ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_memtenants._private import (
    ddp_call_without_rebuild,
    ddp_without_rank_checks,
    fake_process_group,
    reduce_scatter_operator,
    set_device_mesh,
)
from lightning_memtenants.analysis.engines import is_dtensor
from lightning_memtenants.checks import brief
from lightning_memtenants.predict.fake import preserved_globals

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class Parallel:
    """How a dry run spreads over ranks: the strategy, the ranks, and the strategy's settings that change memory.

    Args:
        strategy: ``"ddp"`` or ``"fsdp"``.
        world_size: the ranks, at least 1.
        gradient_as_bucket_view: DDP's setting: gradients are views into its buckets.
        bucket_cap_mb: DDP's bucket size after its first step, in MiB (25, DDP's default).
    """

    strategy: str
    world_size: int
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25.0

    @property
    def name(self) -> str:
        """The strategy in words, for notes and headers: ``FSDP2 over 64 ranks``."""
        kind = "FSDP2 (fully_shard)" if self.strategy == "fsdp" else "DDP"
        return f"{kind} over {self.world_size} rank{'s' if self.world_size != 1 else ''}"


def parallel_of(strategy: Any, world_size: Any) -> Parallel | None:
    """The ``strategy`` and ``world_size`` options of a dry run, checked: ``None`` for one device.

    Args:
        strategy: ``None``, ``"ddp"``, ``"fsdp"``, or a Lightning ``DDPStrategy`` or ``ModelParallelStrategy``.
        world_size: a positive integer; more than 1 needs a strategy.

    Returns:
        The plan, or None for a single device.

    Raises:
        ValueError: naming the argument, for a strategy not known or a bad world size.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {brief(world_size)}")
    if strategy is None:
        if world_size != 1:
            raise ValueError(
                f"world_size={world_size} needs a strategy: strategy='ddp' or 'fsdp' (FSDP2's fully_shard)"
            )
        return None
    if isinstance(strategy, str):
        name = strategy.strip().lower()
        if name not in STRATEGIES:
            raise ValueError(f"strategy must be None, 'ddp' or 'fsdp', or a Lightning strategy, got {strategy!r}")
        return Parallel(name, world_size)
    kind = type(strategy).__name__
    if kind == "ModelParallelStrategy":
        tensor_parallel = getattr(strategy, "_tensor_parallel_size", 1)
        if tensor_parallel not in (1, "auto"):
            raise ValueError(
                f"strategy: a ModelParallelStrategy with tensor_parallel_size={tensor_parallel} is not predicted;"
                " only data parallel FSDP2 (tensor_parallel_size=1) is"
            )
        return Parallel("fsdp", world_size)
    if kind == "DDPStrategy":
        kwargs = getattr(strategy, "_ddp_kwargs", {}) or {}
        return Parallel(
            "ddp",
            world_size,
            gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", False)),
            bucket_cap_mb=float(kwargs.get("bucket_cap_mb", 25.0)),
        )
    raise ValueError(
        f"strategy must be None, 'ddp' or 'fsdp', a DDPStrategy or a ModelParallelStrategy, got {brief(strategy)}"
    )


@contextlib.contextmanager
def fake_group(world_size: int, rank: int) -> Iterator[Any]:
    """This process as ``rank`` of ``world_size`` over PyTorch's fake process group, torn down on leaving.

    The process's global state (Python's ``random``, from which the fake collectives draw their work ids, and the
    rest of :func:`~lightning_memtenants.predict.fake.preserved_globals`) is as it was on leaving.

    Args:
        world_size: the ranks.
        rank: the rank this process plays.

    Yields:
        A ``(world_size, 1)`` device mesh named ``("data_parallel", "tensor_parallel")``, as Lightning's
        ``ModelParallelStrategy`` hands ``configure_model``.

    Raises:
        ValueError: if a process group is already initialised (a dry run never touches the caller's).
    """
    if dist.is_initialized():
        raise ValueError(
            "strategy: this process already has a torch.distributed process group; a cluster is dry-run in a"
            " process without one (the caller's group is never touched)"
        )
    from torch.distributed.device_mesh import init_device_mesh

    with preserved_globals():  # the fake collectives draw their work ids from Python's random: put back on leaving
        fake_process_group(rank, world_size)
        try:
            yield init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        finally:
            dist.destroy_process_group()


def named_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A model's blocks by path: the children of its longest ``nn.ModuleList`` (the first, where two are as long).

    The one rule for "the model's blocks": FSDP shards them one by one, and the advisor checkpoints them.

    Args:
        module: the model.

    Returns:
        ``(path, block)`` pairs (``"blocks.0"``), or none where the model has no ``ModuleList``.
    """
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    name, longest = max(lists, key=lambda item: len(item[1]))
    return [(f"{name}.{i}" if name else str(i), block) for i, block in enumerate(longest)]


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one where the model shards nothing itself (see :func:`named_blocks`).

    Args:
        module: the model.

    Returns:
        The children of the longest ``nn.ModuleList``, or none.
    """
    return [block for _, block in named_blocks(module)]


def shard(module: nn.Module, mesh: Any, *, lightning: bool) -> str:
    """Shard ``module`` with FSDP2 as training would: its own ``configure_model``, else per block and the root.

    Args:
        module: the fake model.
        mesh: the device mesh from :func:`fake_group`.
        lightning: whether ``module`` is a LightningModule, whose ``configure_model`` (if it has its own) shards it.

    Returns:
        A sentence on how the model was sharded.

    Raises:
        ValueError: if the model's ``configure_model`` shards nothing.
    """
    from torch.distributed.fsdp import fully_shard

    if lightning and is_overridden("configure_model", module):  # Lightning's own test, as ModelParallelStrategy's
        set_device_mesh(module, mesh)  # what ModelParallelStrategy hands the hook
        module.configure_model()  # type: ignore[operator]
        if not any(is_dtensor(p) for p in module.parameters()):
            raise ValueError(
                "strategy='fsdp': the model's configure_model() applied no fully_shard; shard it there, as"
                " Lightning's ModelParallelStrategy requires, or remove configure_model to shard per block"
            )
        return "sharded by the model's own configure_model() over the data_parallel mesh"
    data_parallel = mesh["data_parallel"]
    blocks = blocks_of(module)
    for block in blocks:
        fully_shard(block, mesh=data_parallel)
    fully_shard(module, mesh=data_parallel)
    if blocks:
        return f"sharded with fully_shard per block of its longest ModuleList ({len(blocks)} blocks) and the root"
    return "sharded with fully_shard as one unit (the model has no ModuleList of blocks)"


def rank_classes(module: nn.Module, parallel: Parallel, optimizers: Sequence[Any] = ()) -> list[list[int]]:
    """The ranks grouped by what they hold: ranks of one group hold shards of the same sizes, so the same memory.

    DDP's ranks all hold the whole model, unless a ``ZeroRedundancyOptimizer`` gives each rank its own
    parameters' state: then each rank is its own group. FSDP2 splits each parameter along its first
    dimension as ``torch.chunk`` does (ceil(d / N) rows a rank, the last ranks fewer or none); its padded
    shard storage is the same on every rank, its gradients and optimizer state are not.

    Args:
        module: the model (its parameters' shapes are read; nothing runs).
        parallel: the plan.
        optimizers: the optimizers (a ``ZeroRedundancyOptimizer`` shards by rank).

    Returns:
        The groups, in rank order; each is run once, by its first rank.
    """
    n = parallel.world_size
    if any(type(optimizer).__name__ == "ZeroRedundancyOptimizer" for optimizer in optimizers):
        return [[rank] for rank in range(n)]
    if parallel.strategy != "fsdp":
        return [list(range(n))]
    rows = sorted({p.shape[0] if p.dim() else 1 for p in module.parameters()})
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(n):
        key = tuple(_rows_on(rank, d, n) for d in rows)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def _rows_on(rank: int, rows: int, world_size: int) -> int:
    """The rows of a dimension of ``rows`` that ``torch.chunk`` gives ``rank`` of ``world_size``."""
    chunk = math.ceil(rows / world_size) if rows else 0
    return max(0, min(chunk, rows - rank * chunk))


class StepModule(nn.Module):
    """The step as a module, so that DDP wraps it as Lightning's wrapper does: forward runs the training step.

    Args:
        module: the fake model.
        run: ``run(batch, index) -> output``: the LightningModule's ``training_step`` or the caller's loss.
    """

    def __init__(self, module: nn.Module, run: Any) -> None:
        super().__init__()
        self.module = module
        self._run = run

    def forward(self, batch: Any, index: int) -> Any:
        return self._run(batch, index)


def wrap_ddp(step: StepModule, parallel: Parallel) -> Any:
    """``step`` wrapped in DistributedDataParallel over the fake group, as Lightning's DDPStrategy wraps its module.

    DDP checks the ranks' shapes and broadcasts its buffers when built, and reads the first step's gradient
    order from its buckets: none of that has data on fake tensors, so the first two are skipped (every rank
    builds the same model) and the reducer is told not to rebuild its buckets; the
    all-reduce is a comm hook that returns each bucket as it is, which is what the fake group does anyway.
    (The private calls are in ``_private``: ``ddp_without_rank_checks`` and ``ddp_call_without_rebuild``.)

    Args:
        step: the step module over the fake model.
        parallel: the plan (``gradient_as_bucket_view``, ``bucket_cap_mb``).

    Returns:
        The DDP module.
    """
    from torch.nn.parallel import DistributedDataParallel

    ddp = ddp_without_rank_checks(
        lambda: DistributedDataParallel(
            step,
            init_sync=False,
            gradient_as_bucket_view=parallel.gradient_as_bucket_view,
            bucket_cap_mb=parallel.bucket_cap_mb,
        )
    )

    def all_reduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads real annotations, not strings
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp.register_comm_hook(None, all_reduce)
    return ddp


def ddp_forward(ddp: Any, batch: Any, index: int) -> Any:
    """One forward through DDP, its buckets never rebuilt (see :func:`wrap_ddp`)."""
    return ddp_call_without_rebuild(ddp, batch, index)


def gloo_scratch(tracker: Any, rewrite: Any) -> Any:
    """The dry run's ``rewrite`` with gloo's scratch: its reduce-scatter copies the whole input while it runs.

    The fake process group allocates nothing; gloo, the CPU's backend, reduces a copy of the input and
    frees it before the call returns, so a CPU rank's backward peaks that much higher (NCCL needs no copy).

    Args:
        tracker: the dry run's :class:`~lightning_memtenants.core.tracker.LiveTensorTracker`.
        rewrite: the rewrite it already has, or None.

    Returns:
        The rewrite to install.
    """
    reduce_scatter = reduce_scatter_operator()

    def rewritten(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        if func is reduce_scatter:
            given = args[1]
            tracker.transient(given.numel() * given.element_size())
        return out if rewrite is None else rewrite(func, args, kwargs, out)

    return rewritten
