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
    dtensor_caches_cleared,
    fake_process_group,
    real_device_meshes,
    reduce_scatter_operator,
    set_device_mesh,
    wait_tensor_operator,
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
        tensor_parallel: the ranks of one tensor-parallel group (FSDP only): the mesh is
            ``(world_size // tensor_parallel, tensor_parallel)``, named ``("data_parallel", "tensor_parallel")``.
    """

    strategy: str
    world_size: int
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25.0
    tensor_parallel: int = 1

    @property
    def data_parallel(self) -> int:
        """The ranks of one data-parallel group: ``world_size // tensor_parallel``."""
        return self.world_size // self.tensor_parallel

    @property
    def name(self) -> str:
        """The strategy in words, for notes and headers: ``FSDP2 over 64 ranks``."""
        kind = "FSDP2 (fully_shard)" if self.strategy == "fsdp" else "DDP"
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.tensor_parallel > 1:
            return (
                f"{kind} and tensor parallelism over {ranks} (a {self.data_parallel} x {self.tensor_parallel} mesh,"
                " data_parallel x tensor_parallel)"
            )
        return f"{kind} over {ranks}"


def parallel_of(strategy: Any, world_size: Any, tensor_parallel: Any = 1) -> Parallel | None:
    """The ``strategy``, ``world_size`` and ``tensor_parallel`` options of a dry run, checked: ``None`` for one device.

    Args:
        strategy: ``None``, ``"ddp"``, ``"fsdp"``, or a Lightning ``DDPStrategy`` or ``ModelParallelStrategy``
            (whose ``data_parallel_size`` and ``tensor_parallel_size`` are read, ``"auto"`` resolved as Lightning
            does on one node: ``data_parallel_size=1``, ``tensor_parallel_size=world_size``).
        world_size: a positive integer; more than 1 needs a strategy.
        tensor_parallel: the ranks of one tensor-parallel group under ``strategy="fsdp"``: a positive integer that
            divides ``world_size`` (default 1). With a ``ModelParallelStrategy`` it is read from the strategy; a
            different value given here is refused.

    Returns:
        The plan, or None for a single device.

    Raises:
        ValueError: naming the argument, for a strategy not known, a bad world size or a bad tensor-parallel size.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {brief(world_size)}")
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {brief(tensor_parallel)}")
    if strategy is None:
        if world_size != 1:
            raise ValueError(
                f"world_size={world_size} needs a strategy: strategy='ddp' or 'fsdp' (FSDP2's fully_shard)"
            )
        if tensor_parallel != 1:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs strategy='fsdp' and a world_size it divides")
        return None
    if isinstance(strategy, str):
        name = strategy.strip().lower()
        if name not in STRATEGIES:
            raise ValueError(f"strategy must be None, 'ddp' or 'fsdp', or a Lightning strategy, got {strategy!r}")
        if name == "ddp" and tensor_parallel != 1:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} needs strategy='fsdp' (Lightning's ModelParallelStrategy);"
                " DDP replicates the whole model"
            )
        _check_divides(tensor_parallel, world_size)
        return Parallel(name, world_size, tensor_parallel=tensor_parallel)
    kind = type(strategy).__name__
    if kind == "ModelParallelStrategy":
        mesh = _mesh_of(strategy, world_size)
        if tensor_parallel not in (1, mesh[1]):
            raise ValueError(
                f"tensor_parallel={tensor_parallel} differs from the strategy's tensor_parallel_size={mesh[1]};"
                " give it once, in the ModelParallelStrategy"
            )
        return Parallel("fsdp", world_size, tensor_parallel=mesh[1])
    if tensor_parallel != 1:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} needs strategy='fsdp' or a ModelParallelStrategy, got {kind}"
        )
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


def _check_divides(tensor_parallel: int, world_size: int) -> None:
    """Refuse a tensor-parallel size that does not divide the world size, as Lightning's mesh would."""
    if world_size % tensor_parallel:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} must divide world_size={world_size}: the mesh is"
            " (world_size // tensor_parallel, tensor_parallel)"
        )


def _mesh_of(strategy: Any, world_size: int) -> tuple[int, int]:
    """A ``ModelParallelStrategy``'s ``(data_parallel, tensor_parallel)`` sizes, ``"auto"`` resolved as Lightning does.

    Lightning's ``setup_environment`` makes ``data_parallel_size="auto"`` the number of nodes and
    ``tensor_parallel_size="auto"`` the devices of a node; the product must be the world size.
    """
    nodes = getattr(strategy, "num_nodes", 1) or 1
    data = getattr(strategy, "_data_parallel_size", "auto")
    tensor = getattr(strategy, "_tensor_parallel_size", "auto")
    data = nodes if data == "auto" else data
    tensor = world_size // nodes if tensor == "auto" else tensor
    if not isinstance(data, int) or not isinstance(tensor, int) or data * tensor != world_size:
        raise ValueError(
            f"strategy: ModelParallelStrategy's data_parallel_size={data} times tensor_parallel_size={tensor} must"
            f" equal world_size={world_size}, as Lightning requires"
        )
    return data, tensor


@contextlib.contextmanager
def fake_group(world_size: int, rank: int, tensor_parallel: int = 1) -> Iterator[Any]:
    """This process as ``rank`` of ``world_size`` over PyTorch's fake process group, torn down on leaving.

    The process's global state (Python's ``random``, from which the fake collectives draw their work ids, and the
    rest of :func:`~lightning_memtenants.predict.fake.preserved_globals`) is as it was on leaving.

    Args:
        world_size: the ranks.
        rank: the rank this process plays.
        tensor_parallel: the ranks of one tensor-parallel group (a divisor of ``world_size``).

    Yields:
        A ``(world_size // tensor_parallel, tensor_parallel)`` device mesh named ``("data_parallel",
        "tensor_parallel")``, as Lightning's ``ModelParallelStrategy`` hands ``configure_model``.

    Raises:
        ValueError: if a process group is already initialised (a dry run never touches the caller's).
    """
    if dist.is_initialized():
        raise ValueError(
            "strategy: this process already has a torch.distributed process group; a cluster is dry-run in a"
            " process without one (the caller's group is never touched)"
        )
    from torch.distributed.device_mesh import init_device_mesh

    # the fake collectives draw their work ids from Python's random: put back on leaving; the meshes FSDP2 joins
    # for tensor parallelism compute their few rank numbers for real
    with preserved_globals(), real_device_meshes():
        fake_process_group(rank, world_size)
        dtensor_caches_cleared()  # DTensor's caches hold meshes of another rank's groups: computed again
        try:
            shape = (world_size // tensor_parallel, tensor_parallel)
            yield init_device_mesh("cpu", shape, mesh_dim_names=("data_parallel", "tensor_parallel"))
        finally:
            dist.destroy_process_group()
            dtensor_caches_cleared()


def named_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A model's blocks by path: its repeated layers, whole blocks and not their sub-layers.

    The one rule for "the model's blocks", so that FSDP shards and the advisor checkpoints the same units. A
    ``ModuleList`` inside a block of another holds that block's sub-layers (T5's ``block.0.layer``), never blocks; a
    ``ModuleList`` of ``ModuleList``s stands for the lists it holds. A list of sub-layers of different classes whose
    owner is one of two or more siblings of its class (two ``Block``s of a ``Sequential``, each with
    ``layer = ModuleList([attention, mlp])``) stands for those siblings. Of the lists found, where any holds Hugging
    Face's repeated layers (``GradientCheckpointingLayer``), the blocks are every such list (both stacks of an
    encoder-decoder, of any lengths); else the longest list (the first, where two are as long) and every other list
    as long whose blocks are of the same classes (the two stacks of an encoder-decoder that does not mark its layers).

    Args:
        module: the model.

    Returns:
        ``(path, block)`` pairs in the model's order (``"blocks.0"``), or none where the model has no ``ModuleList``.
    """
    groups: list[list[tuple[str, nn.Module]]] = []
    _block_groups(module, "", None, "", groups)
    # a list inside a block of another list holds that block's sub-layers
    roots = [path for group in groups for path, _ in group]
    groups = [g for g in groups if not any(g[0][0].startswith(root + ".") for root in roots)]
    seen: set[int] = set()  # a module shared under two paths is one block, found once
    unique = []
    for group in groups:
        kept = [(path, block) for path, block in group if id(block) not in seen]
        seen.update(id(block) for _, block in kept)
        if kept:
            unique.append(kept)
    groups = unique
    if not groups:
        return []
    marked = [group for group in groups if all(hf_layer(block) for _, block in group)]
    if marked:
        return [pair for group in marked for pair in group]
    longest = max(groups, key=len)  # the first of the longest
    kinds = [type(block) for _, block in longest]
    chosen = [g for g in groups if g is longest or (len(g) == len(longest) and [type(b) for _, b in g] == kinds)]
    return [pair for group in chosen for pair in group]


def _block_groups(
    module: nn.Module, prefix: str, parent: nn.Module | None, parent_prefix: str, groups: list[list[Any]]
) -> None:
    """Add the ``ModuleList``s under ``module`` (at ``prefix``) to ``groups`` as lists of ``(path, block)``, in the
    model's order; ``parent`` holds ``module``, for a list of sub-layers whose owner is repeated."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        # a module, an empty list, or a list of lists (each holds blocks): searched further
        if not isinstance(child, nn.ModuleList) or all(isinstance(item, nn.ModuleList) for item in child):
            _block_groups(child, path + ".", module, prefix, groups)
        else:
            siblings = (
                [(f"{parent_prefix}{n}", m) for n, m in parent.named_children() if type(m) is type(module)]
                if parent is not None and len({type(item) for item in child}) > 1
                else []
            )
            if len(siblings) < 2:
                groups.append([(f"{path}.{i}", block) for i, block in child.named_children()])
            elif not any(group[0][1] is siblings[0][1] for group in groups):  # each repeated owner is a block
                groups.append(siblings)


def hf_layer(block: nn.Module) -> bool:
    """Whether ``block`` is a Hugging Face ``GradientCheckpointingLayer``, transformers' mark of a repeated layer.

    Found by class name, so that transformers is never imported here.

    Args:
        block: a module.

    Returns:
        True for a transformers layer that checkpoints itself when its ``gradient_checkpointing`` is set.
    """
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(block).__mro__)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one where the model shards nothing itself (see :func:`named_blocks`).

    Args:
        module: the model.

    Returns:
        The model's repeated layers (:func:`named_blocks`), or none.
    """
    return [block for _, block in named_blocks(module)]


def shard(module: nn.Module, mesh: Any, *, lightning: bool, called: Sequence[str] | None = None) -> str:
    """Shard ``module`` with FSDP2 as training would: its own ``configure_model``, else per block and the roots.

    Without a ``configure_model`` of the model's own, the prediction assumes what an FSDP2 user writes: a
    ``fully_shard`` on each block of the longest ``nn.ModuleList``, then on each module the step calls (``called``,
    from :func:`top_level_calls`): ``self.model`` for a LightningModule whose step calls ``self.model(x)``, the
    module itself for one that calls ``self(x)`` or for a plain module. Parameters outside every module the
    step calls (a parameter of the LightningModule's own, read in ``training_step``) stay whole on every rank:
    FSDP2 could only gather them in a forward that never runs.

    Args:
        module: the fake model.
        mesh: the device mesh from :func:`fake_group`.
        lightning: whether ``module`` is a LightningModule, whose ``configure_model`` (if it has its own) shards it.
        called: the paths of the modules the step calls (``""`` for ``module``), or None for the module itself.

    Returns:
        A sentence on how the model was sharded.

    Raises:
        ValueError: if the model's ``configure_model`` shards nothing, or under tensor parallelism, if the model
            has no ``configure_model`` to apply its plan.
    """
    from torch.distributed.fsdp import fully_shard

    tensor_parallel = mesh["tensor_parallel"].size()
    if lightning and has_configure_model(module):  # Lightning's own test, as ModelParallelStrategy's
        set_device_mesh(module, mesh)  # what ModelParallelStrategy hands the hook
        module.configure_model()  # type: ignore[operator]
        if not any(is_dtensor(p) for p in module.parameters()):
            raise ValueError(
                "strategy='fsdp': the model's configure_model() applied no fully_shard nor parallelize_module; shard"
                " it there, as Lightning's ModelParallelStrategy requires, or remove configure_model to shard per"
                " block"
            )
        if tensor_parallel > 1:
            return (
                f"sharded by the model's own configure_model() over a {mesh.shape[0]} x {tensor_parallel} mesh"
                " (data_parallel x tensor_parallel)"
            )
        return "sharded by the model's own configure_model() over the data_parallel mesh"
    if tensor_parallel > 1:
        raise ValueError(
            f"tensor_parallel={tensor_parallel}: the model applies no tensor-parallel plan; a LightningModule applies"
            " it in configure_model() (parallelize_module over self.device_mesh['tensor_parallel'], then fully_shard"
            " over self.device_mesh['data_parallel']), as Lightning's ModelParallelStrategy requires"
        )
    data_parallel = mesh["data_parallel"]
    names = [""] if not called or "" in called else list(called)
    roots = [module.get_submodule(name) for name in names]
    blocks = [b for path, b in named_blocks(module) if any(_inside(path, name) for name in names)]
    root_ids = {id(root) for root in roots}
    for block in blocks:
        if id(block) not in root_ids:
            fully_shard(block, mesh=data_parallel)
    for name in sorted(names, key=lambda n: -n.count(".") - bool(n)):  # the innermost first, as FSDP2 requires
        fully_shard(module.get_submodule(name), mesh=data_parallel)
    per_block = f"per block of its repeated layers ({len(blocks)} blocks) and " if blocks else ""
    if names == [""]:
        if blocks:
            return f"sharded with fully_shard {per_block}the root"
        return "sharded with fully_shard as one unit (the model has no ModuleList of blocks)"
    shown = ", ".join(f"`{name}`" for name in names)
    sharded = {id(p) for root in roots for p in root.parameters()}
    whole = [name for name, p in module.named_parameters() if id(p) not in sharded]
    sentence = (
        f"sharded with fully_shard {per_block}the modules that training_step calls ({shown}), each a root:"
        " the LightningModule's own forward never runs"
    )
    if whole:
        sentence += (
            f"; {len(whole)} parameter{'s' if len(whole) != 1 else ''} outside them ({', '.join(whole[:3])}"
            f"{', ...' if len(whole) > 3 else ''}) {'stay' if len(whole) != 1 else 'stays'} whole on every rank"
        )
    return sentence


def _inside(path: str, root: str) -> bool:
    """Whether the module at ``path`` is ``root`` or inside it (``""`` is the whole model)."""
    return not root or path == root or path.startswith(root + ".")


def has_configure_model(module: nn.Module) -> bool:
    """Whether a LightningModule has its own ``configure_model``, Lightning's test in ``ModelParallelStrategy``."""
    return is_overridden("configure_model", module)


def top_level_calls(module: nn.Module, run: Any) -> list[str]:
    """The modules whose forward ``run()`` calls outside any other module's: the roots FSDP2 would need.

    A LightningModule's ``training_step`` usually calls ``self.model(x)``, not ``self(x)``. FSDP2 gathers a
    root's own parameters in the root's forward pre-hook, so what the step calls, not the LightningModule,
    must be the root. This runs the step once, without gradients, and records the forwards entered while
    no other module's forward was running.

    Args:
        module: the (fake) model; hooks are added to every submodule and removed on leaving.
        run: a zero-argument callable that runs the step on ``module``.

    Returns:
        The paths of those modules in the order first called (``""`` for ``module`` itself), each once.
    """
    paths = {id(m): name for name, m in module.named_modules()}
    depth = [0]
    called: list[str] = []

    def enter(mod: nn.Module, *_: Any) -> None:
        if depth[0] == 0 and id(mod) in paths and paths[id(mod)] not in called:
            called.append(paths[id(mod)])
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return called


def rank_classes(module: nn.Module, parallel: Parallel, optimizers: Sequence[Any] = ()) -> list[list[int]]:
    """The ranks grouped by what they hold: ranks of one group hold shards of the same sizes, so the same memory.

    DDP's ranks all hold the whole model, unless a ``ZeroRedundancyOptimizer`` gives each rank its own
    parameters' state: then each rank is its own group. FSDP2 splits each parameter along its first
    dimension as ``torch.chunk`` does (ceil(d / N) rows a rank, the last ranks fewer or none); its padded
    shard storage is the same on every rank, its gradients and optimizer state are not. A sharded model's classes
    are read from its DTensors' placements (tensor parallelism's split, then FSDP2's): ranks whose every
    parameter has the same local shape are one class.

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
    params = list(module.parameters())
    sharded = any(is_dtensor(p) for p in params)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank in range(n):
        if sharded:
            key: tuple[Any, ...] = tuple(_local_shape(p, rank, parallel) for p in params)
        else:  # a model not sharded yet: as fully_shard would split it, on the first dimension
            key = tuple(_rows_on(rank, p.shape[0] if p.dim() else 1, n) for p in params)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def _local_shape(param: Any, rank: int, parallel: Parallel) -> tuple[int, ...]:
    """The shape of ``param``'s shard on ``rank``: a DTensor's placements applied as ``torch.chunk`` does.

    The tensor-parallel placement splits first, then FSDP2's ``Shard(0)`` (a ``_StridedShard`` where both shard
    the same dimension) splits what it left, so the placements are applied from the last mesh dimension to the
    first. Rank ``r`` sits at ``(r // tensor_parallel, r % tensor_parallel)`` of the row-major mesh.
    """
    if not is_dtensor(param):
        return tuple(param.shape)  # not sharded: whole on every rank
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ("data_parallel",) * mesh.ndim
    coordinate = {"data_parallel": rank // parallel.tensor_parallel, "tensor_parallel": rank % parallel.tensor_parallel}
    shape = list(param.shape)
    for index in reversed(range(mesh.ndim)):
        dim = getattr(param.placements[index], "dim", None)  # Shard and _StridedShard have one; Replicate none
        if dim is not None:
            shape[dim] = _rows_on(coordinate.get(names[index], 0), shape[dim], mesh.size(index))
    return tuple(shape)


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
    The functional collectives' waits return their tensor, as for real (see :func:`collective_waits`).

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

    return collective_waits(rewritten)


def collective_waits(rewrite: Any) -> Any:
    """The dry run's ``rewrite`` with the functional collectives' ``wait_tensor`` returning the tensor it waits on.

    DTensor's collectives (tensor parallelism's all-gathers, reduce-scatters and all-reduces) end in
    ``wait_tensor``, which for real returns its input; the fake kernel makes a copy, which no real rank holds.

    Args:
        rewrite: the rewrite it already has, or None.

    Returns:
        The rewrite to install.
    """
    wait = wait_tensor_operator()

    def rewritten(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        if func is wait:
            return args[0]
        return out if rewrite is None else rewrite(func, args, kwargs, out)

    return rewritten
