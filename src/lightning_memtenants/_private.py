"""Every private torch API this package uses, in one place, each with the reason no public one serves.

Nothing else in the package imports a private torch name, so a torch release that moves one breaks
this file alone; each reader here degrades to "not measured" or a conservative answer where it can.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

# Fake tensors (recognised so that they are never counted as memory; a mode for dry runs) and the dispatch-mode base
# class (its documented home): torch has no public path to these.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    "SAVED_PREFIX",
    "FakeTensor",
    "FakeTensorMode",
    "SavedTensor",
    "ShapeEnv",
    "TorchDispatchMode",
    "batches_that_stepped",
    "cast_source",
    "checkpoints_tagged",
    "compile_session",
    "compiled_by_lightning",
    "compiled_in_place",
    "convert_in_place",
    "ddp_bucket_sizes",
    "ddp_call_without_rebuild",
    "ddp_without_rank_checks",
    "default_foreach",
    "dtensor_caches_cleared",
    "dump_snapshot",
    "fake_process_group",
    "fsdp_comm_streams",
    "global_modes",
    "hidden_from_function_modes",
    "inductor_allocator_slots",
    "inner_tensors",
    "is_mock_optimizer",
    "is_traceable_wrapper_subclass",
    "lightning_optimizers",
    "local_tensor",
    "mode_stack",
    "real_as_fake",
    "real_device_meshes",
    "record_history",
    "reduce_scatter_operator",
    "scaler_tensors",
    "set_device_mesh",
    "show_in_progress_bar",
    "tensor_factories",
    "unset_fake",
    "wait_tensor_operator",
]

# A node's saved tensors are its ``_raw_saved_*`` attributes: ``SavedTensor`` objects whose ``data`` reads what is
# stored without unpacking it (the public ``_saved_*`` attributes unpack, running the user's hooks).
SAVED_PREFIX = "_raw_saved_"
SavedTensor = torch._C._autograd.SavedTensor


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor, else the tensor itself.

    ``DTensor.to_local()`` is an autograd operator, dispatched through every mode on the stack (the user's
    included); the census must show the user's modes no operator, so it reads the attribute the shard is kept in.

    Args:
        tensor: any tensor.

    Returns:
        The local shard, or ``tensor`` where it has none.
    """
    return getattr(tensor, "_local_tensor", tensor)


def fsdp_params(module: torch.nn.Module) -> list[Any]:
    """FSDP2's records of the parameters it shards under ``module`` (``FSDPParam``, private), each unit's in order.

    FSDP2 swaps a unit's registered parameters between its sharded DTensors and the gathered tensors with
    ``_parameters[name] = ...`` (no registration hook fires), and leaves a root gathered from its forward to its
    backward; the census reads both from these records (``_get_fsdp_state()._fsdp_param_group.fsdp_params``).

    Args:
        module: any module.

    Returns:
        The records; none where FSDP2 shards nothing under ``module``.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    found: list[Any] = []
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
            found.extend(getattr(group, "fsdp_params", ()))
    return found


def fsdp_pairs(params: Sequence[Any]) -> list[tuple[Tensor, Tensor | None]]:
    """Each FSDP2 record's sharded parameter (a DTensor) and its gathered tensor (``_unsharded_param``, private:
    None before the first all-gather; its storage is freed, not dropped, when the unit reshards).

    Args:
        params: records from :func:`fsdp_params`.

    Returns:
        ``(sharded, gathered)`` pairs in the same order.
    """
    return [(param.sharded_param, getattr(param, "_unsharded_param", None)) for param in params]


# FSDP2's streams, by the attribute of its shared communication context (``FSDPCommContext``) that holds each.
FSDP_STREAMS = ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream")


def fsdp_comm_streams(module: torch.nn.Module) -> dict[str, Any]:
    """The streams FSDP2 runs its collectives' copies on under ``module``, by attribute name, to name them in notes.

    FSDP2 makes them in its communication context (``_get_fsdp_state()._comm_ctx``, private) at its lazy init; no
    public API names them.

    Args:
        module: any module.

    Returns:
        ``{attribute: stream}`` for each of :data:`FSDP_STREAMS` that FSDP2 made; empty where it shards nothing or
        has not run yet.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return {}
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            context = getattr(unit._get_fsdp_state(), "_comm_ctx", None)
            found = {name: getattr(context, name) for name in FSDP_STREAMS if hasattr(context, name)}
            if found:
                return found
    return {}


def inner_tensors(tensor: Tensor) -> Iterator[Tensor]:
    """The tensors a traceable wrapper subclass holds (``__tensor_flatten__``: no public reader exists).

    Args:
        tensor: any tensor; wrappers nested in wrappers are opened too.

    Yields:
        The plain tensors inside, or ``tensor`` itself where it is not a wrapper subclass.
    """
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        for attr in attrs:
            inner = getattr(tensor, attr)
            if isinstance(inner, Tensor):
                yield from inner_tensors(inner)
    else:
        yield tensor


def cast_source(tensor: Tensor) -> Any:
    """The leaf a tensor was cast from by ``_to_copy`` (autocast's weight copies), or None.

    Reads the view's ``_base`` and the autograd node: the only record of where a cast came from.

    Args:
        tensor: a tensor saved for backward.

    Returns:
        The leaf tensor (a weight) it is a cast copy of, or None where it is not one.
    """
    base = tensor._base if tensor._is_view() else tensor
    fn = base.grad_fn if base is not None else None
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return None
    return getattr(fn.next_functions[0][0], "variable", None)


def compiled_in_place(module: Any) -> bool:
    """Whether ``torch.compile`` wrapped this module (an ``OptimizedModule``, whose class lives in a private module),
    or ``Module.compile()`` compiled it in place (its compiled call is in ``_compiled_call_impl``).

    Args:
        module: any object; one that is not a module is never compiled.

    Returns:
        True where the module is or holds a compiled call.
    """
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


# Inductor's generated Python wrappers allocate their CPU buffers with these functions of ``torch._C._dynamo.guards``,
# outside the dispatcher; each generated module binds them as globals (left) as it loads. No public hook sees them.
_INDUCTOR_CPU_ALLOCATORS = (
    ("empty_strided_cpu", "_empty_strided_cpu"),
    ("empty_strided_cpu_pinned", "_empty_strided_cpu_pinned"),
)


def inductor_allocator_slots() -> list[tuple[dict[str, Any], str]]:
    """Where inductor's compiled CPU code finds the functions that allocate its buffers: ``(namespace, name)`` pairs.

    ``torch._C._dynamo.guards`` holds them, and a generated wrapper module copies them into its globals as it loads
    (``PyCodeCache`` keeps every one loaded); its ``call`` looks them up there on each run. Inductor is not imported
    here: before it is, no generated module exists.

    Returns:
        The guards module's slots, then each loaded generated module's, where the name is bound.
    """
    import sys

    module = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    guards = vars(module) if module is not None else {}
    slots = [(guards, name) for _, name in _INDUCTOR_CPU_ALLOCATORS if name in guards]
    codecache = sys.modules.get("torch._inductor.codecache")
    cache = getattr(codecache, "PyCodeCache", None)
    if cache is None:
        return slots
    loaded = {id(module): module for module in getattr(cache, "modules", ())}
    loaded.update((id(module), module) for module in getattr(cache, "modules_no_attr", {}).values())
    for module in loaded.values():
        namespace = vars(module)
        slots.extend((namespace, name) for name, _ in _INDUCTOR_CPU_ALLOCATORS if name in namespace)
    return slots


def default_foreach(params: list[Tensor]) -> bool:
    """torch's own choice of ``foreach`` for an optimizer left to choose; its documented rule where the helper moved.

    Args:
        params: the optimizer's parameters.

    Returns:
        True where torch would run the ``foreach`` implementation.
    """
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        return bool(_default_to_fused_or_foreach(params, False, use_fused=False)[1])
    except Exception:  # a private helper: if it moves, fall back to its documented rule (foreach on CUDA)
        return all(p.device.type == "cuda" for p in params)


def scaler_tensors(scaler: Any) -> Iterator[Tensor]:
    """The tensors a ``GradScaler`` holds: scale, growth tracker and the per-optimizer found-inf flags.

    ``GradScaler`` has no public reader of its state tensors other than ``state_dict``, which copies them to floats.

    Args:
        scaler: a ``torch.amp.GradScaler``.

    Yields:
        Each state tensor it holds now (the found-inf flags exist only from ``unscale_`` to ``update``).
    """
    for name in ("_scale", "_growth_tracker"):
        value = getattr(scaler, name, None)
        if isinstance(value, Tensor):
            yield value
    for state in getattr(scaler, "_per_optimizer_states", {}).values():
        yield from state.get("found_inf_per_device", {}).values()


def ddp_bucket_sizes(model: Any) -> list[int]:
    """Bytes of each of DDP's gradient buckets, from DDP's own logging data (no public reader of bucket sizes).

    Args:
        model: a ``DistributedDataParallel`` wrapper.

    Returns:
        The size of each bucket in bytes; empty where DDP has not logged them.
    """
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return [int(size) for size in sizes.split(",") if size.strip()]


def record_history(on: bool) -> None:
    """Start or stop the CUDA allocator's history, as the documented memory_viz recipe does.

    Args:
        on: True starts recording (the last 100,000 events), False stops it.
    """
    if on:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    else:
        torch.cuda.memory._record_memory_history(None)


class hidden_saved_tensors_hooks:
    """Hide the caller's default saved-tensor hooks for a block, and put every one back, in order, after it.

    A dry run inside a user's fit must not call the user's pack hooks on its fake tensors: torch keeps the
    hooks on a stack and offers no public way to step outside it, so the stack is emptied and refilled.
    """

    def __enter__(self) -> None:
        self.hidden: list[tuple[Any, Any]] = []
        while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
            self.hidden.append(top)
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def __exit__(self, *exc: object) -> None:
        for pack, unpack in reversed(self.hidden):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def dump_snapshot(path: str) -> None:
    """Write the allocator's history for pytorch.org/memory_viz (the documented recipe's call).

    Args:
        path: the pickle file to write.
    """
    torch.cuda.memory._dump_snapshot(path)


class mode_stack:
    """The dispatch-mode stack, for leaving our mode from under a user's mode (``__exit__`` pops the top).

    torch offers no public way to remove a mode that is not on top, nor to fix the "a mode is active" flags
    the modes above it saved; both are needed so that measuring leaves the user's modes as they were.
    """

    FLAG_DEQUES = (
        "old_dispatch_mode_flags",
        "old_non_infra_dispatch_mode_flags",
        "old_without_ignore_compile_internals_dispatch_mode_flags",
    )

    @staticmethod
    def top() -> Any:
        """The mode on top of the stack, or None where the stack is empty."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        return _get_current_dispatch_mode()

    @staticmethod
    def pop() -> Any:
        """Take the top mode off the stack (without leaving it) and return it."""
        from torch.utils._python_dispatch import _pop_mode

        return _pop_mode()

    @staticmethod
    def push(mode: Any) -> None:
        """Put ``mode`` back on top of the stack (without entering it again).

        Args:
            mode: a dispatch mode taken off the stack by :meth:`pop`.
        """
        from torch.utils._python_dispatch import _push_mode

        _push_mode(mode)

    @staticmethod
    def set_flags(active: bool, non_infra: bool, without_ignore: bool) -> None:
        """Set torch's "a mode is active" flags, as a mode's ``__exit__`` restores them.

        Args:
            active: whether any dispatch mode is active.
            non_infra: whether a mode that is not an infra mode is active.
            without_ignore: whether a mode that does not ask Dynamo to ignore it is active.
        """
        import torch.utils._python_dispatch as dispatch

        dispatch._is_in_torch_dispatch_mode = active
        dispatch._is_in_non_infra_torch_dispatch_mode = non_infra
        dispatch._is_in_any_mode_without_ignore_compile_internals = without_ignore
        dispatch.set_is_in_mode_without_ignore_compile_internals(without_ignore)


class global_modes:
    """Every stack of modes and hooks that torch keeps per thread, read whole and put back whole.

    A dry run must leave the caller's process as it found it; torch reads its dispatch-mode stack (user modes and
    the infra modes, ``FakeTensorMode`` among them), its function-mode stack and its stack of default saved-tensor
    hooks one entry at a time through private calls only, and offers no public way to put a stack back.
    """

    @staticmethod
    def dispatch() -> list[Any]:
        """The dispatch modes, bottom first (infra modes included, as torch's logical stack holds them)."""
        return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]

    @staticmethod
    def function() -> list[Any]:
        """The ``TorchFunctionMode`` stack (``torch.device`` as a context is one), bottom first."""
        return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]

    @staticmethod
    def flags() -> tuple[bool, bool, bool]:
        """torch's "a dispatch mode is active" flags, which each mode's ``__exit__`` sets back."""
        import torch.utils._python_dispatch as dispatch

        return (
            bool(dispatch._is_in_torch_dispatch_mode),
            bool(dispatch._is_in_non_infra_torch_dispatch_mode),
            bool(dispatch._is_in_any_mode_without_ignore_compile_internals),
        )

    @staticmethod
    def saved_tensors_hooks() -> list[tuple[Any, Any]]:
        """The default saved-tensor hooks, bottom first: the stack is emptied to be read, and refilled."""
        hooks: list[tuple[Any, Any]] = []
        while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
            hooks.append(top)
            torch._C._autograd._pop_saved_tensors_default_hooks()
        hooks.reverse()
        for pack, unpack in hooks:
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        return hooks

    @staticmethod
    def restore(
        dispatch: list[Any],
        function: list[Any],
        flags: tuple[bool, bool, bool],
        hooks: list[tuple[Any, Any]],
    ) -> None:
        """Put every stack back as read; a stack already as it was is not touched.

        Args:
            dispatch: what :meth:`dispatch` read.
            function: what :meth:`function` read.
            flags: what :meth:`flags` read.
            hooks: what :meth:`saved_tensors_hooks` read.
        """
        if not _same(global_modes.dispatch(), dispatch):
            while torch._C._len_torch_dispatch_stack():
                torch._C._pop_torch_dispatch_stack(None)
            for mode in dispatch:
                torch._C._push_on_torch_dispatch_stack(mode)
        if not _same(global_modes.function(), function):
            while torch._C._len_torch_function_stack():
                torch._C._pop_torch_function_stack()
            for mode in function:
                torch._C._push_on_torch_function_stack(mode)
        if global_modes.flags() != flags:
            mode_stack.set_flags(*flags)
        now = global_modes.saved_tensors_hooks()
        if len(now) != len(hooks) or any(a is not b or c is not d for (a, c), (b, d) in zip(now, hooks, strict=True)):
            for _ in now:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            for pack, unpack in hooks:
                torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def _same(now: list[Any], then: list[Any]) -> bool:
    """Whether two readings of a stack hold the very same modes, in the same order."""
    return len(now) == len(then) and all(a is b for a, b in zip(now, then, strict=True))


def unset_fake() -> Any:
    """A context in which the active ``FakeTensorMode`` is off, every other mode still on (``unset_fake_temporarily``).

    A dry run computes tensors made only of constants for real, under the user's and our own dispatch modes;
    torch offers no public way to step out of the fake mode alone.

    Returns:
        The context manager.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def tensor_factories() -> frozenset[Any]:
    """The torch functions that make a tensor from their arguments alone (``torch.ones``, ``torch.randint``...).

    It is the list ``torch.device`` as a context uses to set the device of new tensors (``_device_constructors``);
    a dry run makes the small ones for real, where their values decide the model's path.

    Returns:
        The functions.
    """
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors())


def real_as_fake(mode: Any, tensor: Tensor) -> Tensor:
    """The fake tensor that ``mode`` stands a real ``tensor`` for when an operator mixes the two (its converter).

    The conversion is remembered per real tensor, so this is the very fake the operator will see.

    Args:
        mode: the active ``FakeTensorMode``.
        tensor: a real tensor.

    Returns:
        Its fake counterpart.
    """
    return mode.fake_tensor_converter.from_real_tensor(mode, tensor)


# -- Lightning ---------------------------------------------------------------------------------


def hidden_from_function_modes() -> Any:
    """A context in which torch function modes and subclass overrides are off (``torch._C.DisableTorchFunction``).

    The census reads sizes, storages and gradients through tensor methods (``numel``, ``untyped_storage``, ``.grad``),
    which a user's ``TorchFunctionMode`` around ``fit`` would otherwise see; torch has no public way to call them
    unseen.

    Returns:
        The context manager.
    """
    return torch._C.DisableTorchFunction()


def show_in_progress_bar(trainer: Any, name: str, value: float) -> bool:
    """Put ``value`` in the progress bar's metrics under ``name``, as a Python float.

    ``LightningModule.log(..., prog_bar=True)`` would make a tensor of it and ``.item()`` it at every refresh:
    operators a user's dispatch mode would see. Lightning's bars read ``trainer.progress_bar_metrics``, the logger
    connector's ``_progress_bar_metrics`` dict, which has no public setter.

    Args:
        trainer: the Trainer.
        name: the metric's name.
        value: its value.

    Returns:
        True where the value was set; False where this Lightning keeps no such dict.
    """
    metrics = getattr(getattr(trainer, "_logger_connector", None), "_progress_bar_metrics", None)
    if not isinstance(metrics, dict):
        return False
    metrics[name] = float(value)
    return True


def batches_that_stepped(trainer: Any) -> int:
    """The optimizer steps Lightning has taken, the step its own logging uses (``_batches_that_stepped``).

    ``trainer.global_step`` counts every optimizer's steps and is not what ``self.log`` lands on.

    Args:
        trainer: the Lightning ``Trainer``.

    Returns:
        The step count, ``trainer.global_step`` where the private counter has moved.
    """
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Lightning's stand-in for "no optimizer" (``_MockOptimizer``), which never steps.

    Args:
        optimizer: an entry of ``trainer.optimizers``.

    Returns:
        True for the stand-in.
    """
    return type(optimizer).__name__ == "_MockOptimizer"


def lightning_optimizers(module: Any) -> list[Any]:
    """The optimizers of a LightningModule's ``configure_optimizers``, in any of the shapes it may return.

    Lightning's own reader of those shapes (``_configure_optimizers``) is private; writing another would differ.

    Args:
        module: a LightningModule.

    Returns:
        The optimizers, without their schedulers.
    """
    from lightning.pytorch.core.optimizer import _configure_optimizers

    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    return list(optimizers)


def result_collection() -> Any:
    """A new, empty store of what ``self.log`` logs in a training loop (Lightning's ``_ResultCollection``).

    A dry run keeps what a Trainer keeps of each logged value (its detached clone, an epoch-level mean's running sum
    and count, the metric's defaults) with Lightning's own code, which has no public entry.

    Returns:
        The collection, for ``training_step``'s logs.
    """
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    return _ResultCollection(training=True)


def logging_levels(hook: str, on_step: bool | None, on_epoch: bool | None) -> tuple[bool, bool]:
    """``self.log``'s ``on_step`` and ``on_epoch`` in ``hook``, defaults filled in and checked, as Lightning does.

    Lightning's table of each hook's defaults (``_FxValidator``) is private.

    Args:
        hook: the hook's name (``"training_step"``).
        on_step: the caller's ``on_step``, or ``None`` for the hook's default.
        on_epoch: the caller's ``on_epoch``, or ``None`` for the hook's default.

    Returns:
        ``(on_step, on_epoch)``.
    """
    from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator

    return _FxValidator.check_logging_and_get_default_levels(hook, on_step=on_step, on_epoch=on_epoch)


def step_metrics(results: Any) -> dict[str, Tensor]:
    """The tensors a Trainer holds after each batch from its result collection: ``callback_metrics`` and
    ``logged_metrics`` (the logger connector's ``on_batch_end``), which keep them until the next batch's replace them.

    ``_ResultCollection.metrics(on_step=True)`` without the progress bar's, which it turns into Python numbers with
    ``.item()`` (no memory, and no value a fake tensor has); its readers of each metric are private.

    Args:
        results: the collection of :func:`result_collection`.

    Returns:
        ``"callback/<name>"`` and ``"log/<name>"`` keys, as the two dicts of the logger connector hold them.
    """
    metrics: dict[str, Tensor] = {}
    for _, metric in results.valid_items():
        value = results._get_cache(metric, True)
        if not isinstance(value, Tensor):
            continue
        name, forked = results._forked_name(metric, True)
        if metric.meta.logger:
            metrics[f"log/{forked}"] = value
        metrics[f"callback/{name}"] = value
        metrics[f"callback/{forked}"] = value
    return metrics


def compiled_by_lightning(module: Any) -> bool:
    """Whether Lightning compiled this LightningModule (``_compiler_ctx``, its record of ``torch.compile``).

    Args:
        module: any object; one that Lightning did not compile has no record.

    Returns:
        True where Lightning holds a record of compiling it.
    """
    return getattr(module, "_compiler_ctx", None) is not None


def fake_process_group(rank: int, world_size: int) -> None:
    """Make this process ``rank`` of ``world_size`` over PyTorch's fake process group (collectives move no data).

    The fake group and its store live in ``torch.testing._internal``: torch ships them for its own tests of
    FSDP and DTensor, and no public API answers a collective without peers.

    Args:
        rank: the rank this process plays.
        world_size: the ranks.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Hand a LightningModule its device mesh as Lightning's ``ModelParallelStrategy`` does (``_device_mesh``).

    Args:
        module: the LightningModule whose ``configure_model`` reads ``self.device_mesh``.
        mesh: the device mesh.
    """
    module._device_mesh = mesh


def ddp_without_rank_checks(build: Any) -> Any:
    """``build()`` with DDP's check of the ranks' parameter shapes skipped: fake tensors have no data to send.

    DDP calls its private ``_verify_param_shape_across_processes`` from its constructor; every rank of a dry run
    builds the same model, so there is nothing to check.

    Args:
        build: a function that builds the ``DistributedDataParallel`` module.

    Returns:
        What ``build`` returns.
    """
    from torch.nn.parallel import distributed

    verify = distributed._verify_param_shape_across_processes
    distributed._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        return build()
    finally:
        distributed._verify_param_shape_across_processes = verify


class _FixedBuckets:
    """DDP's reducer, but its buckets are not rebuilt after the first step (the rebuild reads gradients' data)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def ddp_call_without_rebuild(ddp: Any, *args: Any) -> Any:
    """One forward through DDP with its reducer told not to rebuild its buckets (``_rebuild_buckets``, private).

    DDP reorders its buckets once, after the first step, from the order the gradients arrived in; on fake
    tensors the C++ rebuild fails for want of data, and without it the buckets keep their first layout.

    Args:
        ddp: the ``DistributedDataParallel`` module.
        *args: its forward's arguments.

    Returns:
        The forward's output.
    """
    reducer = ddp.reducer
    ddp.reducer = _FixedBuckets(reducer)
    try:
        return ddp(*args)
    finally:
        ddp.reducer = reducer


def reduce_scatter_operator() -> Any:
    """The dispatcher's reduce-scatter operator, ``c10d._reduce_scatter_base_``, which FSDP2 runs in its backward.

    Returns:
        The operator overload, as a dispatch mode sees it.
    """
    return torch.ops.c10d._reduce_scatter_base_.default


def wait_tensor_operator() -> Any:
    """The functional collectives' wait, ``_c10d_functional.wait_tensor`` (a private namespace), which DTensor runs.

    For real it returns the tensor it is given; its fake kernel makes a new one, which a dry run must not count.

    Returns:
        The operator overload, as a dispatch mode sees it.
    """
    return torch.ops._c10d_functional.wait_tensor.default


@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """Device meshes built under a fake mode compute their rank tables for real (``DeviceMesh.__init__`` wrapped).

    FSDP2 over a tensor-parallel parameter joins the two meshes (``DeviceMesh._concatenate``, private) while the
    user's ``configure_model`` runs, inside a dry run's ``FakeTensorMode``; the new mesh finds its rank with
    ``nonzero()`` on its rank table, which a fake tensor cannot answer. The table is a few integers, made of
    constants: computed for real, it is what a real run computes. Restored on leaving.

    Yields:
        Nothing; inside, ``DeviceMesh(...)`` runs with the fake mode off.
    """
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__

    def real_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = init  # type: ignore[method-assign]


def convert_in_place(module: torch.nn.Module) -> None:
    """Make ``module.to(dtype)`` on a dry run's fake copy convert its fake parameters in place, as on real ones.

    ``nn.Module._apply`` swaps a fake parameter for its conversion (``torch.utils.swap_tensors``), which fails
    once the dry run's optimizer and tracker hold it, so a forward that converts a module
    (``self.classifier = self.classifier.to(dtype)``, SwitchTransformers' router) fails where training runs; a
    real parameter takes the conversion's data (``param.data = ...``), or stays as it is. The private parts are
    ``Module._apply`` and the ``_parameters`` and ``_buffers`` dicts, which no public API converts one module's
    own tensors through. Each module of the copy gets its own ``_apply`` (an instance attribute): torch's, and on
    its swap failure the in-place conversion; the user's module and the class are left alone.

    Args:
        module: the fake copy (every module under it is set).
    """
    import types

    def apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
        return _apply_in_place(self, type(self)._apply, fn, recurse)

    for sub in module.modules():
        sub._apply = types.MethodType(apply, sub)  # type: ignore[method-assign]


@contextlib.contextmanager
def converting_in_place() -> Iterator[None]:
    """Inside, ``module.to(dtype)`` (``.half()``, ``.float()``) on fake parameters converts them in place.

    A parameter made under a fake mode stays in the mode's memo of converted tensors (a weak reference), and
    ``torch.utils.swap_tensors``, which ``Module._apply`` uses for every fake parameter, refuses a tensor with a
    weak reference: a model-building callable ending in ``.to(torch.bfloat16)`` fails under fake tensors. The
    class's ``_apply`` (private) is wrapped for the block as :func:`convert_in_place` wraps a copy's modules;
    restored on leaving.

    Yields:
        Nothing.
    """
    original = torch.nn.Module._apply

    def apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
        return _apply_in_place(self, original, fn, recurse)

    torch.nn.Module._apply = apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module._apply = original  # type: ignore[method-assign]


def _apply_in_place(self: torch.nn.Module, torch_apply: Any, fn: Any, recurse: bool) -> torch.nn.Module:
    """torch's ``_apply``, and on its swap failure the conversion of the module's own tensors in place."""
    try:
        return torch_apply(self, fn, recurse)
    except RuntimeError as error:
        if "Couldn't swap" not in str(error):
            raise
    for param in self._parameters.values():  # the children are done; the own parameters are unchanged
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        if applied is not param and (applied.dtype, applied.device) != (param.dtype, param.device):
            param.data = applied
            if param.grad is not None:
                param.grad.data = fn(param.grad)
    for name, buffer in self._buffers.items():
        if buffer is not None:
            self._buffers[name] = fn(buffer)
    return self


def dtensor_caches_cleared() -> None:
    """Empty DTensor's caches of sharding propagation, which key on meshes (``debug._clear_sharding_prop_cache``).

    ``DeviceMesh`` equality ignores its process groups, so a rank dry-run after another (a fresh fake group,
    the same mesh shape) would be handed the previous rank's cached outputs, whose meshes name groups destroyed
    since. The caches (Python's and the C++ fast path's) only save time: emptied, DTensor computes the same
    answers again. torch's own tests clear them through this private function.
    """
    from torch.distributed.tensor import debug

    debug._clear_sharding_prop_cache()


# -- torch.compile, predicted without Dynamo ------------------------------------------------------


def compile_settings(compiled: Any) -> tuple[str, dict[str, Any], bool] | None:
    """What ``torch.compile`` was asked for: the backend, inductor's options (``mode`` turned into them), fullgraph.

    Read from the ``OptimizeContext`` that an ``OptimizedModule`` holds (``dynamo_ctx``), or that a compiled
    function's wrapper closes over; the backend is the innermost of its callback's ``_torchdynamo_orig_backend``
    chain. torch keeps none of this in public attributes.

    Args:
        compiled: an ``OptimizedModule`` or a function ``torch.compile`` returned.

    Returns:
        ``(backend, options, fullgraph)``, with backend ``"inductor"``, ``"aot_eager"``... or a callable backend's
        ``__name__``; None where ``compiled`` holds no compile context.
    """
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None:
        cells = getattr(compiled, "__closure__", None) or ()
        contents = [cell.cell_contents for cell in cells if cell.cell_contents is not None]
        ctx = next((c for c in contents if hasattr(c, "callback") and hasattr(c, "fullgraph")), None)
    if ctx is None:
        return None
    from torch._dynamo.eval_frame import innermost_backend

    backend = innermost_backend(ctx.callback)
    name = getattr(backend, "compiler_name", None)
    options = dict(getattr(backend, "config", None) or {})
    return (name if isinstance(name, str) else "custom"), options, bool(getattr(ctx, "fullgraph", False))


def compiled_original(compiled: Any) -> Any:
    """The callable a compiled function wraps (``_torchdynamo_orig_callable``), or None for one that is not compiled.

    Args:
        compiled: any object.

    Returns:
        The original function or bound method.
    """
    return getattr(compiled, "_torchdynamo_orig_callable", None)


@contextlib.contextmanager
def compile_session() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true, as Dynamo holds it while compiling: library code takes its traced path.

    Hugging Face's mask code, say, skips a check on a tensor's values (a guard no fake tensor can answer) when it
    sees a compile; AOT autograd run alone must show it the same flag to trace the graph Dynamo would.
    """
    with torch.compiler._compile_session_context():
        yield


@contextlib.contextmanager
def checkpoints_tagged() -> Iterator[None]:
    """Activation checkpoints traced as Dynamo's ``tag_activation_checkpoint`` runs them: tagged, not replayed.

    Dynamo turns ``checkpoint(fn, x, use_reentrant=False)`` into that higher-order op, whose implementation calls
    ``checkpoint`` with a selective-checkpoint context that caches the region's outputs (no recomputation is traced)
    and tags each of its nodes ``recompute=PREFER_RECOMPUTE`` with the region's ``ac_graph_id``; the partitioner
    then recomputes the region in backward and saves the tensors at the regions' boundaries. Traced by AOT autograd
    alone, a plain checkpoint replays the region under its saved-tensor hooks in the traced backward, but the replay
    depends on no tangent, so the min-cut partitioner moves it back into the forward and saves what it would without
    a checkpoint: the checkpoint is undone. ``use_reentrant=True`` runs its autograd Function instead, whose output
    requires grad only where an input does (a batch does not), while the op runs it non-reentrant too. So, for this
    block only, the generator behind a non-reentrant ``checkpoint`` and the reentrant one's Function (no public hook
    reaches either) run as the op does.
    """
    from torch._higher_order_ops import wrap
    from torch.fx import traceback as fx_traceback
    from torch.utils import checkpoint as module

    original = module._checkpoint_without_reentrant_generator

    def as_the_op(
        fn: Any,
        preserve_rng_state: bool = True,
        context_fn: Any = module.noop_context_fn,
        determinism_check: str = module._DEFAULT_DETERMINISM_MODE,
        debug: bool = False,
        early_stop: bool = True,
        *args: Any,
        **kwargs: Any,
    ) -> Iterator[None]:
        if not module._is_compiling(fn, args, kwargs):
            yield from original(
                fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args, **kwargs
            )
            return
        region = next(wrap.uid)
        contexts = (
            context_fn
            if context_fn is not module.noop_context_fn
            else functools.partial(module.create_selective_checkpoint_contexts, wrap._always_prefer_recompute)
        )

        def tagged() -> tuple[Any, Any]:
            forward, recompute = contexts()
            forward.ac_graph_id = region
            return forward, recompute

        with fx_traceback.preserve_node_meta():  # the region's tags end with it, as the op's call scopes them
            yield from original(fn, False, tagged, determinism_check, False, False, *args, **kwargs)

    def reentrant(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        return module.checkpoint(function, *args, use_reentrant=False)  # the op runs both kinds non-reentrant

    function_class = module.CheckpointFunction
    module._checkpoint_without_reentrant_generator = as_the_op
    module.CheckpointFunction = types.SimpleNamespace(apply=reentrant)  # type: ignore[assignment]
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = original
        module.CheckpointFunction = function_class  # type: ignore[misc]


@contextlib.contextmanager
def without_modes() -> Iterator[None]:
    """Every mode and default saved-tensor hook off, and back as they were after: AOT autograd traces under its own.

    The dry run's dispatch modes (the tracker, the fake mode), its function modes and its saved-tensor hooks would
    see, or be traced into, the graphs; AOT autograd finds the fake mode from its inputs.
    """
    dispatch, function = global_modes.dispatch(), global_modes.function()
    flags, hooks = global_modes.flags(), global_modes.saved_tensors_hooks()
    global_modes.restore([], [], (False, False, False), [])
    try:
        yield
    finally:
        global_modes.restore(dispatch, function, flags, hooks)


def aot_inductor(module: torch.nn.Module, inputs: list[Tensor], backend: str, run_graph: Any) -> Any:
    """Trace ``module`` with AOT autograd as ``backend`` does, and run its graphs as ``run_graph`` says (no kernels).

    ``"inductor"`` as ``compile_fx`` does: inductor's decompositions (``select_decomp_table``), its joint-graph
    passes, then ``min_cut_rematerialization_partition`` with ``compiler="inductor"``, which reads
    ``torch._functorch.config.activation_memory_budget``; the ``aot_eager`` family as
    ``torch/_dynamo/backends/debugging.py`` registers it (``aot_eager``: the min-cut partitioner without
    decompositions; ``aot_eager_decomp_partition``: with inductor's; ``aot_eager_default_partitioner``:
    ``default_partition``). The forward and backward compilers compile nothing: each graph goes to ``run_graph``,
    which says how to run it. Dynamo's counters (the pattern matcher's among them) are left as they were.

    Args:
        module: a module whose ``forward`` returns a tuple of tensors; its parameters and buffers become inputs.
        inputs: the fake input tensors; AOT autograd traces under their fake mode.
        backend: one of :data:`AOT_BACKENDS`.
        run_graph: called with each ``GraphModule`` traced (the forward, then the backward); returns a callable
            that runs it on its inputs, or, where it has a true ``boxed`` attribute, on the list of its inputs,
            which it may empty (AOT autograd's boxed calling convention).

    Returns:
        A callable taking ``inputs``' runtime values and returning the outputs as a list.
    """
    import functools

    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V

    def nop(gm: Any, _: Any) -> Any:
        run = run_graph(gm)
        if getattr(run, "boxed", False):  # takes AOT autograd's list of inputs, and frees each as inductor's code does
            run._boxed_call = True
            return run
        return make_boxed_func(run)

    min_cut = functools.partial(min_cut_rematerialization_partition, compiler="inductor")

    def inductor_partition(gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # as compile_fx sets it: the random passes read it
            return min_cut(joint_graph_passes(gm), joint_inputs, **kwargs)

    recipes: dict[str, tuple[Any, Any]] = {
        "inductor": (inductor_partition, select_decomp_table()),
        "aot_eager": (min_cut_rematerialization_partition, None),
        "aot_eager_decomp_partition": (min_cut, select_decomp_table()),
        "aot_eager_default_partitioner": (default_partition, None),
    }
    partition, decompositions = recipes[backend]
    with dynamo_counters_kept():  # the pattern matcher counts: the user's counters stay as they were
        return aot_module_simplified(
            module,
            inputs,
            fw_compiler=nop,
            bw_compiler=nop,
            partition_fn=partition,
            decompositions=decompositions,
            keep_inference_input_mutations=backend != "aot_eager_decomp_partition",
        )


@contextlib.contextmanager
def dynamo_counters_kept() -> Iterator[None]:
    """Dynamo's counters (``torch._dynamo.utils.counters``) as they were before, whatever a trace inside counted."""
    from torch._dynamo.utils import counters

    before = {name: dict(counter) for name, counter in counters.items()}
    try:
        yield
    finally:
        counters.clear()
        for name, counter in before.items():
            counters[name].update(counter)


# The backends whose saved tensors AOT autograd decides, traced by :func:`aot_inductor` as each does.
AOT_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition", "aot_eager_default_partitioner")


def activation_memory_budget() -> float:
    """``torch._functorch.config.activation_memory_budget``: the share of activations inductor's partitioner keeps.

    Returns:
        The budget, 1.0 where the user left it (save what is cheapest to keep, recompute the rest).
    """
    from torch._functorch import config

    return float(config.activation_memory_budget)


@contextlib.contextmanager
def activation_memory_budget_set(budget: float) -> Iterator[None]:
    """``torch._functorch.config.activation_memory_budget`` set to ``budget`` inside, and back as it was after.

    Args:
        budget: the share of activations inductor's partitioner keeps, in [0, 1].

    Yields:
        Nothing; the budget holds until the block ends.
    """
    from torch._functorch import config

    with config.patch(activation_memory_budget=float(budget)):
        yield


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """A nest of tuples, lists and dicts as its leaves and its shape (``torch.utils._pytree``, what AOT autograd uses).

    Args:
        tree: the nest.

    Returns:
        The leaves, and the spec :func:`unflatten` rebuilds the nest from.
    """
    from torch.utils._pytree import tree_flatten

    return tree_flatten(tree)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """The nest :func:`flatten` read, with ``leaves`` in place of its own.

    Args:
        leaves: one value per leaf.
        spec: the spec :func:`flatten` returned.

    Returns:
        The nest.
    """
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(leaves, spec)


def fake_like(tensor: Tensor, mode: Any) -> Tensor:
    """A new fake tensor of ``mode`` with ``tensor``'s shape, strides, dtype, device and ``requires_grad``.

    AOT autograd's graphs keep the tensors they were traced with (in their nodes' ``meta["val"]``); traced with a
    stand-in, the dry run's own tensor is freed when its step is done with it; a real tensor (a constant the dry
    run computed for real) stands as a fake of static shape, not as one AOT autograd would make dynamic.

    Args:
        tensor: a fake or real tensor.
        mode: the dry run's ``FakeTensorMode``.

    Returns:
        The stand-in.
    """
    with mode:
        made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    return made.requires_grad_(tensor.requires_grad)


def fake_mode_of(tensor: Tensor) -> Any:
    """The ``FakeTensorMode`` a fake tensor belongs to (``FakeTensor.fake_mode``), or None for another tensor.

    Args:
        tensor: any tensor.

    Returns:
        Its mode, or None.
    """
    return tensor.fake_mode if isinstance(tensor, FakeTensor) else None


class _ReadOut(torch.overrides.TorchFunctionMode):
    """Raises ``error`` at ``Tensor.item()`` and ``tolist()``: Dynamo breaks there unless it captures scalars."""

    def __init__(self, error: Any) -> None:
        super().__init__()
        self.error = error

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (Tensor.item, Tensor.tolist) and not torch._dynamo.config.capture_scalar_outputs:
            raise self.error(f"Tensor.{func.__name__}()")
        return func(*args, **(kwargs or {}))


# The logging methods Dynamo breaks its graph at; Hugging Face adds ``warning_once`` to ``logging.Logger``.
LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log", "warning_once")


@contextlib.contextmanager
def dynamo_breaks_raise(error: Any) -> Iterator[None]:
    """Dynamo's commonest graph breaks raising ``error(what)`` inside, in this thread: ``torch._dynamo.graph_break()``
    (a no-op outside Dynamo), ``print`` and a ``logging.Logger`` method called from outside torch (unless Dynamo is
    told to reorder or ignore them; torch's own logging, as it traces, is not the user's code), ``Tensor.item()``
    and ``tolist()`` (unless Dynamo captures scalar outputs). A trace without Dynamo would go through each and join
    the graphs Dynamo compiles apart. Another thread's calls go on as they were.

    Args:
        error: the exception class to raise, called with what broke (``"print()"``, say).
    """
    import builtins
    import logging
    import os
    import sys
    import threading

    import torch._dynamo.decorators as decorators

    owner = threading.get_ident()
    reorderable = torch._dynamo.config.reorderable_logging_functions | torch._dynamo.config.ignore_logging_functions

    def breaking(what: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return original(*args, **kwargs)
            raise error(what)

        return call

    torch_dir = os.path.dirname(torch.__file__)

    def logged(name: str, original: Any) -> Any:  # torch's own logging, tracing, is not the user's code
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if threading.get_ident() != owner or caller.startswith(torch_dir) or caller == logging.__file__:
                return original(*args, **kwargs)
            raise error(f"logging.Logger.{name}() in {caller.split('site-packages' + os.sep)[-1]}")

        return call

    loggers = {name: vars(logging.Logger)[name] for name in LOGGER_METHODS if name in vars(logging.Logger)}
    kept = torch._dynamo.graph_break, decorators.graph_break, builtins.print
    torch._dynamo.graph_break = decorators.graph_break = breaking("torch._dynamo.graph_break()", kept[1])
    for name, method in loggers.items():
        if method not in reorderable:
            setattr(logging.Logger, name, logged(name, method))
    if print not in reorderable:
        builtins.print = breaking("print()", builtins.print)
    try:
        with _ReadOut(error):
            yield
    finally:
        torch._dynamo.graph_break, decorators.graph_break, builtins.print = kept
        for name, method in loggers.items():
            setattr(logging.Logger, name, method)
