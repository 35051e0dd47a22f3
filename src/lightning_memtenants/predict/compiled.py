"""A fake model's ``torch.compile``'d parts, predicted as compiled: AOT autograd and inductor's partitioner, no Dynamo.

Inductor saves for backward what its partitioner (``min_cut_rematerialization_partition``) keeps, and recomputes
cheap pointwise work instead of saving it; run eagerly, the same code saves far more. A dry run therefore traces
each compiled callable of its fake copy with AOT autograd itself, under the dry run's fake tensors. For a CPU target
inductor's own ``compile_fx`` then compiles the graphs, its kernels left uncompiled, and its generated wrapper runs
on the fake tensors (``_private_inductor``): the buffers are inductor's, allocated and freed in its order. For a GPU
target, whose Triton kernels need Triton to plan, the graphs run value by value by a rule: a pointwise value that
inductor fuses into its readers is computed unseen by the tracker, every other value is a buffer freed after its
last use, the saved tensors included. The trace runs with ``torch.compiler.is_compiling()`` true, as
Dynamo holds it, so library code (Hugging Face's masks) takes its compiled path. Dynamo never sees the user's code:
no cache entry is added to their functions, no recompile counted, and the user's model compiles the same graphs
afterwards. Where Dynamo would break its graph (``torch._dynamo.graph_break()``, ``print``, ``Tensor.item()``, or
code AOT autograd cannot trace), the callable runs eagerly and each of its submodules with parameters is traced as
a graph of its own, as Dynamo's graphs between the breaks hold them.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from lightning_memtenants._private import (
    AOT_BACKENDS,
    activation_memory_budget,
    aot_inductor,
    checkpoints_tagged,
    compile_session,
    compile_settings,
    compiled_by_lightning,
    compiled_in_place,
    compiled_original,
    dynamo_breaks_raise,
    fake_like,
    fake_mode_of,
    flatten,
    unflatten,
    without_modes,
)
from lightning_memtenants._private_inductor import plan, set_aside

EAGER_NOTE = "the model's torch.compile'd parts are predicted as they run eagerly"
# The arguments a trace bakes in as they are: values that no call changes.
CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
TORCH_DIR = os.path.dirname(torch.__file__)
TORCH_FRAMES = "Module.compile() of a module of torch's own: Dynamo skips its frames and compiles nothing"
# The steps Lightning compiles along with ``forward``: they log, and Dynamo breaks its graph there; run eagerly.
LIGHTNING_STEPS = ("training_step", "validation_step", "test_step", "predict_step")
LIGHTNING_FIT = (
    "compiled by Lightning's fit of torch.compile(module): run eagerly, its forward compiled; Dynamo compiles the"
    " step's own code too, up to its first self.log, where its graph breaks"
)


class CompiledCall:
    """Stands, on the fake copy, for one compiled callable: traced once per input signature, then run as traced.

    Args:
        fn: the original callable, bound to the fake copy's module where it was a method.
        root: the fake model, whose parameters and buffers AOT autograd lifts into inputs (so their gradients flow).
        name: where it was found, for the notes.
        backend: the backend whose AOT autograd recipe traces it: one of ``_private.AOT_BACKENDS``.
        notes: where a callable AOT autograd refuses is named.
        options: inductor's options to plan with (:func:`~lightning_memtenants._private_inductor.plan`); None to
            run inductor's graphs by the fusion rule (a GPU target, whose Triton kernels need Triton to plan).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        root: nn.Module,
        name: str,
        backend: str,
        notes: list[str],
        options: dict[str, Any] | None = None,
    ) -> None:
        self.fn, self.root, self.name, self.backend, self.notes = fn, root, name, backend, notes
        self.options = options
        self.traced: dict[Any, tuple[Any, _Traced]] = {}
        self.refused = False

    tracing = False  # while one traces, a compiled callable it calls is traced into it, as Dynamo inlines

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if CompiledCall.tracing:
            return self.fn(*args, **kwargs)
        if self.refused:
            return self._eagerly(args, kwargs)
        leaves, spec = flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        key = (
            spec,
            repr([leaf for leaf in leaves if not isinstance(leaf, Tensor)]),
            tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in (leaves[i] for i in positions)),
            torch.is_grad_enabled(),
            torch.get_default_dtype(),
        )
        entry = self.traced.get(key)
        if entry is None:
            entry = self._trace(leaves, positions, spec)
            if entry is None:
                return self._eagerly(args, kwargs)
            self.traced[key] = entry
        run, traced = entry
        outputs = list(run(*[leaves[i] for i in positions]))
        out = list(traced.out_leaves)
        for position, value in zip(traced.out_positions, outputs, strict=True):
            out[position] = value
        return unflatten(out, traced.out_spec)

    def _eagerly(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The callable run eagerly, as between Dynamo's graphs: a value it reads out (``item()``) is a symbol that
        no graph binds, which a later trace under the same shape environment would find pending.
        """
        tensors = [leaf for leaf in flatten((args, kwargs))[0] if isinstance(leaf, Tensor)]
        env = getattr(next((m for m in map(fake_mode_of, tensors) if m is not None), None), "shape_env", None)
        with env.ignore_fresh_unbacked_symbols() if env is not None else contextlib.nullcontext():
            return self.fn(*args, **kwargs)

    def _trace(self, leaves: list[Any], positions: list[int], spec: Any) -> tuple[Any, _Traced] | None:
        traced = _Traced(self.fn, self.root, leaves, positions, spec)
        graphs: list[Any] = []
        try:
            kept = [leaf for leaf in leaves if not isinstance(leaf, (Tensor, *CONSTANTS))]
            if kept:  # a cache object, say: traced, it would keep the trace's tensors; Dynamo replays its changes
                raise ValueError(f"it is passed a {type(kept[0]).__name__}, which tracing alone would change")
            CompiledCall.tracing = True
            with (
                without_modes(),
                compile_session(),
                checkpoints_tagged(),  # a checkpointed region is tagged for recomputation, as Dynamo's op tags it
            ):  # AOT autograd traces under its own modes; the tracker sees the run
                tensors = [*(leaves[i] for i in positions), *self.root.parameters()]
                mode = next(m for m in map(fake_mode_of, tensors) if m is not None)
                inputs = [fake_like(leaves[i], mode) for i in positions]
                if self.backend == "inductor" and self.options is not None:
                    run, graphs = plan(traced, inputs, self.options)
                else:
                    run = aot_inductor(traced, inputs, self.backend, _runner(graphs, self.backend))
            traced.leaves = []  # the first call's tensors: kept, they would outlive their step
            if any(_sized_by_values(graph) for graph in graphs):
                raise ValueError("a size that depends on a tensor's values")
        except Exception as error:  # a graph break: Dynamo would split it, AOT autograd alone cannot
            CompiledCall.tracing = False
            self.refused = True
            reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
            owner = getattr(self.fn, "__self__", None)
            inner = self._descend(owner) if isinstance(owner, nn.Module) else []
            where = (
                f"; its submodules {', '.join(inner)} are traced each on its own, as Dynamo's graphs between breaks"
                " hold them (a graph that holds several, or code outside them, may be partitioned otherwise)"
                if inner
                else ""
            )
            if "/" in self.name:  # a submodule traced after its parent refused: one note names them all
                self.notes.append(f"{self.name} ({type(error).__name__})")
                return None
            self.notes.append(
                f"{EAGER_NOTE}: {self.name} could not be traced without Dynamo ({type(error).__name__}: {reason}),"
                f" as at a graph break{where}; a real compiled run may save less"
            )
            return None
        CompiledCall.tracing = False
        return run, traced

    def _descend(self, module: nn.Module, prefix: str = "") -> list[str]:
        """Trace the submodules with parameters of a module that refused, each on its own; their names."""
        names = []
        for name, child in module.named_children():
            if not any(True for _ in child.parameters()):
                continue
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or "forward" in vars(child):  # or wrapped already
                names += [f"{name}.{inner}" for inner in self._descend(child, f"{prefix}{name}.")]
                continue
            forward = types.MethodType(type(child).forward, child)
            label = f"{self.name}/{prefix}{name}"
            child.__dict__["forward"] = CompiledCall(forward, self.root, label, self.backend, self.notes, self.options)
            names.append(name)
            if isinstance(child, nn.Sequential):  # called whole, one graph; indexed (``blocks[0](x)``), its blocks
                names += [f"{name}.{inner}" for inner in self._descend(child, f"{prefix}{name}.")]
        return names


class _Traced(nn.Module):
    """The callable as AOT autograd wants it: tensors in, a tuple of tensors out, the model's parameters its own."""

    def __init__(self, fn: Callable[..., Any], root: nn.Module, leaves: list[Any], positions: list[int], spec: Any):
        super().__init__()
        self.root = root
        self.fn, self.leaves, self.positions, self.spec = fn, leaves, positions, spec
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_positions: list[int] = []

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = unflatten(leaves, self.spec)
        with dynamo_breaks_raise(GraphBreak):  # the user's code only: inductor's passes may read a constant
            out = self.fn(*args, **kwargs)
        out_leaves, self.out_spec = flatten(out)
        self.out_positions = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, Tensor)]
        self.out_leaves = [None if isinstance(leaf, Tensor) else leaf for leaf in out_leaves]
        return tuple(out_leaves[i] for i in self.out_positions)


@dataclass
class CompiledParts:
    """What :func:`predict_compiled` did: its notes, and those of the callables AOT autograd refused in the step.

    Attributes:
        notes: what the compiled parts are predicted with, known before the step.
        refused: one note per compiled callable that ran eagerly because it could not be traced (filled by the step).
    """

    notes: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def refusals(self) -> list[str]:
        """The notes of the refusals: one per compiled callable, one for all the submodules traced after them.

        Returns:
            The notes, in the order the step met them.
        """
        inner = [note for note in self.refused if not note.startswith(EAGER_NOTE)]
        notes = [note for note in self.refused if note not in inner]
        if inner:
            shown = ", ".join(inner[:6]) + (f" and {len(inner) - 6} more" if len(inner) > 6 else "")
            notes.append(f"submodules that could not be traced on their own either ran eagerly: {shown}")
        return notes


def _runner(graphs: list[Any], backend: str) -> Callable[[Any], Callable[..., Any]]:
    """How each traced graph runs: inductor's with the pointwise values it fuses unseen, the others as FX code."""

    def run_graph(gm: torch.fx.GraphModule) -> Callable[..., Any]:
        graphs.append(gm)
        if backend != "inductor":
            return gm.forward
        return _Fused(gm, _fused_away(gm))

    return run_graph


def _is(node: torch.fx.Node, tag: Any) -> bool:
    return node.op == "call_function" and tag in getattr(node.target, "tags", ())


def _fused_away(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The pointwise values inductor computes inside the kernels that read them and never allocates.

    A pointwise value read only by pointwise operators or reductions, and not an output of the graph, fuses
    into its readers; one read by a matrix multiplication, a view or any other extern kernel is a buffer.
    """
    outputs = {arg for node in gm.graph.nodes if node.op == "output" for arg in node.all_input_nodes}
    return {
        node
        for node in gm.graph.nodes
        if _is(node, torch.Tag.pointwise)
        and node not in outputs
        and node.users
        and all(_is(user, torch.Tag.pointwise) or _is(user, torch.Tag.reduction) for user in node.users)
    }


class _Fused(torch.fx.Interpreter):
    """Runs a graph as inductor's code does: each value, input or not, freed after its last use; the fused unseen.

    Called with AOT autograd's list of inputs, which it empties (``boxed``), as inductor's code does: the
    backward frees each saved tensor once read.
    """

    boxed = True

    def __init__(self, gm: torch.fx.GraphModule, fused: set[torch.fx.Node]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.fused = fused
        self.placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]

    def __call__(self, args: list[Any]) -> Any:
        env = dict(zip(self.placeholders, args, strict=True))
        args.clear()
        try:
            return self.run(initial_env=env)
        finally:  # hold nothing between runs
            self.env = {}
            self.args_iter = iter(())

    def run_node(self, n: torch.fx.Node) -> Any:
        if n in self.fused:
            with without_modes():  # a fake tensor computes under its own fake mode; the tracker sees no buffer
                return super().run_node(n)
        return super().run_node(n)


class GraphBreak(Exception):
    """Code where Dynamo breaks its graph, met in a trace: Dynamo splits the graph there, AOT autograd cannot."""


def _sized_by_values(graph: Any) -> bool:
    """Whether a traced graph holds a tensor whose size is symbolic: its values decide it (``nonzero``, a mask).

    The dry run computes such values for real where they come from constants, eagerly; traced, they are fake.
    """
    return any(free_unbacked_symbols(node.meta.get("val")) for node in graph.graph.nodes)


def predict_compiled(fake: nn.Module, original: nn.Module | None, gpu: bool = False) -> CompiledParts:
    """Make each ``torch.compile``'d callable of the fake copy run as inductor would compile it; say what was done.

    Every compiled callable kept in a module's attributes is found: an ``OptimizedModule``'s ``forward``, a
    ``Module.compile()``'s ``_compiled_call_impl``, the ``forward`` Lightning compiles, a compiled helper
    (``self.loss = torch.compile(self._loss)``). The copy shares the user's compiled wrapper, which calls the
    user's own module; each is replaced on the copy by a :class:`CompiledCall` of the original callable, bound to
    the copy's module. A backend other than inductor and the ``aot_eager`` family (a callable of the user's) runs
    eagerly, as do Lightning's compiled steps (they log) and compiled functions outside the model.

    Args:
        fake: the fake copy of the model (from :func:`~lightning_memtenants.predict.fake.fake_module`).
        original: the user's model it was copied from, or None where the copy was built from a callable.
        gpu: whether the prediction is for a GPU: inductor's graphs then run by the fusion rule, as planning
            Triton's kernels needs Triton; on the CPU they run as inductor's own wrapper allocates.

    Returns:
        The notes for the prediction (none where nothing is compiled), and the list the step's refusals go to.
    """
    copies: dict[int, nn.Module] = {}
    originals: dict[int, nn.Module] = {}
    if original is not None:
        pairs = list(
            zip(
                (m for _, m in original.named_modules(remove_duplicate=False)),
                (m for _, m in fake.named_modules(remove_duplicate=False)),
                strict=False,
            )
        )
        copies = {id(mine): copy for mine, copy in pairs}
        originals = {id(copy): mine for mine, copy in pairs}
    parts = CompiledParts()
    notes = parts.notes
    compiled: list[str] = []
    eager: list[str] = []
    options_seen: list[tuple[str, dict[str, Any], bool]] = []
    aside: set[str] = set()
    for path, module in fake.named_modules():
        mine = originals.get(id(module))
        # a pickled or copied module drops its Module.compile() call: the user's module still holds it
        kept = {k: v for k, v in vars(mine).items() if vars(module).get(k) is None} if mine is not None else {}
        for attribute, value in [*vars(module).items(), *kept.items()]:
            fn = compiled_original(value)
            if fn is None:
                continue
            name = f"{type(module).__name__}{'.' + path if path else ''}.{attribute}"
            settings = compile_settings(value) or ("custom", {}, False)
            backend = settings[0] if settings[0] in AOT_BACKENDS else None
            fn = _rebound(fn, copies)
            if backend is None or (attribute in LIGHTNING_STEPS and compiled_by_lightning(module)):
                module.__dict__[attribute] = fn
                if backend is None or attribute == "training_step":
                    eager.append(f"{name} ({settings[0]})")
                continue
            options = None
            if backend == "inductor" and not gpu:
                options, unused = set_aside(settings[1])
                aside.update(unused)
            if attribute == "_compiled_call_impl" and _torch_code(module):
                module.__dict__[attribute] = fn  # Dynamo skips torch's own frames, compiles the first of the user's
                frames = _user_frames(module)
                for inner, child in frames:
                    forward = types.MethodType(type(child).forward, child)
                    label = f"{name}/{inner}"
                    child.__dict__["forward"] = CompiledCall(forward, fake, label, backend, parts.refused, options)
                    compiled.append(label)
                if frames:
                    options_seen.append(settings)
                else:
                    eager.append(f"{name} ({settings[0]}, {TORCH_FRAMES})")
                continue
            call = CompiledCall(fn, fake, name, backend, parts.refused, options)
            module.__dict__[attribute] = call
            lightning = _lightning_inside(module) if attribute == "forward" else None
            if lightning is not None:  # Lightning's fit compiles what torch.compile wrapped, forward and steps
                forward = types.MethodType(type(lightning).forward, lightning)
                lightning.__dict__["forward"] = CompiledCall(forward, fake, name, backend, parts.refused, options)
                eager.append(f"{type(lightning).__name__}.training_step ({settings[0]}, {LIGHTNING_FIT})")
            compiled.append(name)
            options_seen.append(settings)
    if compiled:
        notes.insert(0, _compiled_note(compiled, options_seen, gpu, sorted(aside)))
    if eager or (not compiled and any(compiled_in_place(m) or compiled_by_lightning(m) for m in fake.modules())):
        what = f" ({', '.join(eager)})" if eager else ""
        notes.append(f"{EAGER_NOTE}{what}; inductor's kernels may save and allocate other tensors")
    return parts


def _torch_code(module: nn.Module) -> bool:
    """Whether the module's ``forward`` is torch's own code (``nn.Linear``, ``nn.Sequential``), whose frame Dynamo
    skips when it is where a compile starts (``Module.compile()`` compiles the module's call)."""
    code = getattr(type(module).forward, "__code__", None)
    return code is not None and code.co_filename.startswith(TORCH_DIR)


def _user_frames(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The outermost submodules whose ``forward`` is not torch's own: the frames Dynamo compiles, each on its own,
    under a ``Module.compile()`` of a module of torch's."""
    found = []
    for name, child in module.named_children():
        if _torch_code(child):
            found += _user_frames(child, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", child))
    return found


def _lightning_inside(module: nn.Module) -> nn.Module | None:
    """The LightningModule an ``OptimizedModule`` wraps, which Lightning's fit compiles itself; None for another."""
    inner = getattr(module, "_orig_mod", None) if type(module).__name__ == "OptimizedModule" else None
    steps = callable(getattr(inner, "training_step", None)) and callable(getattr(inner, "configure_optimizers", None))
    return inner if isinstance(inner, nn.Module) and steps else None


def _rebound(fn: Callable[..., Any], copies: dict[int, nn.Module]) -> Callable[..., Any]:
    """``fn`` bound to the copy of its module, where it is a method of the user's module; else ``fn`` itself."""
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, types.MethodType) and id(owner) in copies:
        return types.MethodType(fn.__func__, copies[id(owner)])
    return fn


def _compiled_note(
    names: list[str], settings: list[tuple[str, dict[str, Any], bool]], gpu: bool, aside: list[str]
) -> str:
    """What the compiled parts were predicted with: the partitioner, the memory budget, how the graphs allocate."""
    budget = activation_memory_budget()
    backends = sorted({backend for backend, _, _ in settings})
    note = (
        f"torch.compile'd {', '.join(names)} ({', '.join(backends)}) predicted as compiled: traced with AOT autograd"
        " (no Dynamo); what the forward saves for backward is inductor's partitioner's choice"
        f" (min_cut_rematerialization_partition, activation_memory_budget={budget:g})"
    )
    if "inductor" in backends and not gpu:
        note += (
            "; inside the compiled graphs, buffers are allocated and freed as inductor's own generated wrapper does"
            " (its scheduler's fusions and buffer reuse; the kernels themselves are not compiled)"
        )
    elif "inductor" in backends:
        note += (
            "; inside the compiled graphs, a pointwise value read only by pointwise operators or reductions is"
            " taken as fused (never allocated), and every other value, input or not, is freed after its last use:"
            " planning Triton's own buffers needs Triton"
        )
    if aside:
        note += (
            f"; set aside in the plan: {', '.join(aside)} (kernels chosen by timing them, CUDA graphs, a C++"
            " wrapper: buffers as without them)"
        )
    if any(backend.startswith("aot_eager") for backend in backends):
        note += "; the aot_eager backends trace as torch registers them (their own partitioner and decompositions)"
    if any(options.get("triton.cudagraphs") for _, options, _ in settings):
        note += "; mode='reduce-overhead' runs CUDA graphs, whose memory pool is not modelled"
    return note
