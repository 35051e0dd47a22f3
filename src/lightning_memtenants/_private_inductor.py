"""Inductor's own compiler on a fake model, its kernels left uncompiled: the buffers its generated code would allocate.

Inductor lowers each graph AOT autograd gives it, fuses, plans its buffers (which to allocate, which to reuse,
where to ``del`` them) and writes a Python wrapper that allocates with ``empty_strided_cpu`` and calls the kernels.
Here the whole of ``compile_fx`` runs (decompositions, joint-graph passes, the partitioner, post-grad passes, the
scheduler, the wrapper's memory planning), on the dry run's fake tensors. Only the last step differs: the kernels'
source is never compiled (each kernel is a no-op), and the wrapper is loaded from its text, not from inductor's
code cache, with its allocator making fake tensors the dry run's tracker counts. Running it allocates and frees
what a real compiled run would, in its order, so the temporaries and the peak inside compiled code are inductor's.

Nothing is left behind for the user's own compiles: the FX-graph, AOT-autograd and autotuning caches are off, no
module enters ``PyCodeCache``, and Dynamo's counters, inductor's metrics and the compile-time records are put back.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memtenants._private import dynamo_counters_kept

# Options set aside: kernels chosen by timing them (a fake tensor cannot be timed), CUDA graphs, the C++ wrapper.
TUNING = (
    "max_autotune",
    "max_autotune_pointwise",
    "max_autotune_gemm",
    "coordinate_descent_tuning",
    "triton.cudagraphs",
    "cpp_wrapper",
)
# What keeps a compile for later: off, so that nothing a prediction compiles is found by the user's compiles.
NO_CACHES = {
    "fx_graph_cache": False,
    "fx_graph_remote_cache": False,
    "autotune_local_cache": False,
    "autotune_remote_cache": False,
    "bundled_autotune_remote_cache": False,
    "cpp_wrapper": False,
}
LOADER = "async_compile = AsyncCompile()"


class _Uncompiled:
    """Stands for inductor's ``AsyncCompile`` in a planned wrapper: every kernel it would compile is a no-op."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: _skip

    def wait(self, scope: dict[str, Any]) -> None:
        """The kernels are ready: none was compiled."""


def _skip(*args: Any, **kwargs: Any) -> None:
    """A kernel, not run: its output buffers were allocated by the wrapper, and their values are fake."""


def _reinterpret(tensor: Tensor, size: Any, stride: Any, offset: int = 0) -> Tensor:
    """Inductor's ``reinterpret_tensor`` through the dispatcher, so that a fake tensor stays fake."""
    return tensor.as_strided(size, stride, tensor.storage_offset() + offset)


def _allocate(size: Any, stride: Any, dtype: torch.dtype) -> Tensor:
    """Inductor's ``empty_strided_cpu`` through the dispatcher: a fake tensor the dry run's tracker counts."""
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _no_check(*args: Any, **kwargs: Any) -> None:
    """A check the wrapper makes of its inputs' strides or alignment: a fake tensor has no address to check."""


def _load(graph: Any, wrapper_code: Any) -> types.ModuleType:
    """The wrapper inductor wrote, loaded from its text as a plan: kernels no-ops, buffers fake, no code cache."""
    code = wrapper_code.value
    if code.count(LOADER) != 1:
        raise ValueError("inductor's wrapper does not load its kernels as this version expects")
    namespace: dict[str, Any] = {"__name__": "memtenants_inductor_plan", "__uncompiled__": _Uncompiled()}
    exec(compile(code.replace(LOADER, "async_compile = __uncompiled__"), "<inductor plan>", "exec"), namespace)
    namespace.update(
        empty_strided_cpu=_allocate,
        empty_strided_cpu_pinned=_allocate,
        reinterpret_tensor=_reinterpret,
        assert_size_stride=_no_check,
        assert_alignment=_no_check,
    )
    module = types.ModuleType("memtenants_inductor_plan")
    module.__dict__.update(namespace)
    module.__file__ = "<inductor plan>"
    graph.cache_key, graph.cache_path, graph.cache_linemap = "memtenants-plan", "", []
    return module


@contextlib.contextmanager
def _kept_as_they_were() -> Iterator[None]:
    """Dynamo's counters, inductor's metrics and the compile-time records: as they were before the plan."""
    from torch._dynamo import utils
    from torch._inductor import metrics

    times = {name: list(values) for name, values in utils.compilation_time_metrics.items()}
    kept = {
        name: (value.copy() if isinstance(value, (list, dict)) else value)
        for name, value in vars(metrics).items()
        if not name.startswith("_") and isinstance(value, (int, float, list, dict)) and not isinstance(value, bool)
    }
    try:
        with dynamo_counters_kept():
            yield
    finally:
        utils.compilation_time_metrics.clear()
        utils.compilation_time_metrics.update(times)
        for name, value in kept.items():
            setattr(metrics, name, value)


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Inductor as it compiles, but its wrapper loaded as a plan, its kernels uncompiled, no cache read or written.

    The backward is lowered with the forward (``force_non_lazy_backward_lowering``), while the plan is in place.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    original, owner = GraphLowering._compile_to_module_lines, threading.get_ident()

    def load(graph: Any, wrapper_code: Any) -> Any:  # another thread's compile goes on as usual
        return _load(graph, wrapper_code) if threading.get_ident() == owner else original(graph, wrapper_code)

    GraphLowering._compile_to_module_lines = load  # type: ignore[method-assign]
    try:
        with (
            _kept_as_they_were(),
            config.patch(NO_CACHES),
            functorch_config.patch(
                force_non_lazy_backward_lowering=True, enable_autograd_cache=False, enable_remote_autograd_cache=False
            ),
        ):
            yield
    finally:
        GraphLowering._compile_to_module_lines = original  # type: ignore[method-assign]


def set_aside(options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The user's inductor options a plan can honour, and the names of those it sets aside (:data:`TUNING`).

    Args:
        options: ``torch.compile``'s ``options``, ``mode`` turned into them.

    Returns:
        The options kept, and the names set aside where they were on.
    """
    kept = {name: value for name, value in options.items() if name not in TUNING}
    return kept, sorted(name for name in options if name in TUNING and options[name])


def plan(module: nn.Module, inputs: list[Tensor], options: dict[str, Any]) -> tuple[Any, list[torch.fx.GraphModule]]:
    """Compile ``module`` with inductor's ``compile_fx``, as planned: a callable that allocates as inductor's code does.

    Args:
        module: returns a tuple of tensors; its parameters and buffers are lifted into inputs by AOT autograd.
        inputs: fake tensors, in the fake mode the graphs are traced under.
        options: inductor's options for this compile (from :func:`set_aside`).

    Returns:
        The compiled callable (AOT autograd's, its forward and backward inductor's wrappers), and the graphs
        inductor lowered: the forward, then the backward.
    """
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    graphs: list[torch.fx.GraphModule] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        graphs.append(gm)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    with planning():
        run = compile_fx(module, inputs, inner_compile=inner, config_patches=options)  # type: ignore[arg-type]
    return run, graphs
