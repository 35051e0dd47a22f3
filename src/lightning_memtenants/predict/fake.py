"""Fake-tensor plumbing shared by every dry run: the mode, the model and batch copied as fakes, the precision.

Fake tensors carry shapes, dtypes and storages but no data, so the user's own code runs on them
at no memory cost; nothing of the caller's model is changed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import random
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_memtenants._private import (
    FakeTensor,
    ShapeEnv,
    convert_in_place,
    converting_in_place,
    global_modes,
    unset_fake,
)
from lightning_memtenants.checks import brief, one_of
from lightning_memtenants.core.storage import batch_tensors
from lightning_memtenants.predict.kernels import KernelFakeMode
from lightning_memtenants.predict.values import (
    BUILD_ELEMENTS,
    KnownValues,
    branching_line,
    is_known,
    is_unknown_value,
    unknown_value_error,
)

ModelArg = nn.Module | Callable[[], nn.Module]

PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    # precision: (parameter dtype, autocast dtype)
    "32-true": (None, None),
    "64-true": (torch.float64, None),
    "16-true": (torch.float16, None),
    "bf16-true": (torch.bfloat16, None),
    "16-mixed": (None, torch.float16),
    "bf16-mixed": (None, torch.bfloat16),
}


def check_precision(precision: str, name: str = "precision") -> str:
    """``precision`` as one of Lightning's precision names that a prediction knows, checked here only.

    Every entry point that takes a precision (``dry_run``, ``activation_check``) calls this, so the
    accepted names and the message are the same everywhere.

    Args:
        precision: a Lightning precision name, e.g. ``"32-true"`` or ``"bf16-mixed"``.
        name: the argument it came from, for the error message.

    Returns:
        ``precision``, a key of :data:`PRECISIONS`.

    Raises:
        ValueError: naming ``name`` and the precisions accepted.
    """
    return one_of(precision, sorted(PRECISIONS), name)


@contextlib.contextmanager
def fake_session() -> Iterator[Any]:
    """A fake-tensor mode for the user's code, quiet about what only a run without a Trainer would say.

    Lightning warns that ``self.log`` has no Trainer; torch logs a traceback at ERROR level for an operator
    whose shapes do not fit (the error itself still reaches the caller) and warns about data pointers of
    fake tensors. None of that is the user's business in a prediction.

    Yields:
        The ``FakeTensorMode``, active for the block, with a shape environment.
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    # A shape environment lets ``loss.item()`` in user code return a symbol instead of failing.
    # torch's mode, but for the operators whose meta kernels refuse what the real ones run (``aten._grouped_mm``)
    mode = KernelFakeMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    try:
        with mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")
            warnings.filterwarnings("ignore", message=".*not attached to a .Trainer.*")
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            yield mode
    finally:
        logger.setLevel(level)


def fake_module(
    model: ModelArg, mode: Any, dtype: torch.dtype | None = None, notes: list[str] | None = None
) -> nn.Module:
    """A copy of ``model`` whose every tensor is fake; tied tensors stay tied; other objects are shared.

    The user's model is never touched: a prediction steps its copy, which costs no memory. The copy is
    :func:`copy_module`'s: parameters, buffers and the tensors kept in attributes (``example_input_array``, a
    list of outputs) are fakes, containers are copied, anything else (a numpy table, a Dataset) is shared.

    Args:
        model: the module to copy, or a zero-argument callable that builds one (under the fake mode).
        mode: the active ``FakeTensorMode`` (from :func:`fake_session`).
        dtype: the true-precision parameter dtype to cast floating tensors to, or ``None``.
        notes: where to say what was assumed (a constructor built a second time, see :func:`build`).

    Returns:
        The fake copy; a Trainer or Fabric attached to ``model`` is not copied.

    Raises:
        ValueError: if the callable builds something other than an ``nn.Module``.
    """
    built: nn.Module | None = None
    if not isinstance(model, nn.Module):
        built = build(model, mode, notes)
        if all(isinstance(t, FakeTensor) for t in (*built.parameters(), *built.buffers())):
            model = None
            _mend(built)
        else:  # built with constants computed for real: their tensors are made fake below
            model, built = built, None
    if model is not None:

        def fake(tensor: Tensor) -> Tensor:
            if isinstance(tensor, FakeTensor):
                return tensor
            plain = tensor.detach()
            if plain.is_meta:  # a model built on the meta device has shapes and no memory: its fakes are CPU tensors
                return torch.empty_strided(plain.shape, plain.stride(), dtype=plain.dtype)
            return mode.from_tensor(plain)

        built = copy_module(model, fake)
    assert built is not None
    if dtype is not None:
        _cast(built, dtype)
    convert_in_place(built)  # ``module.to(dtype)`` in a forward converts the copy as it does a real module
    return built


# The containers a copy of a module copies (so that what a dry run appends to them never reaches the caller's):
# the builtin ones and their subclasses (nn.Module keeps its hooks in OrderedDicts), and dataclass instances.
CONTAINERS = (list, tuple, dict, set, frozenset)
# Objects deepcopy copies without a memo entry anyway, immutable, left out of the memo.
_ATOMIC = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    range,
    types.FunctionType,
    types.BuiltinFunctionType,
)


def copy_module(model: nn.Module, stand_in: Callable[[Tensor], Tensor]) -> nn.Module:
    """A copy of ``model`` that copies no memory: every tensor is a stand-in, every other object is shared.

    The one copier of a user's module, behind :func:`fake_module` (fake tensors) and the callback's meta copy.
    What is copied: the module tree (as modules), and the containers reachable from its attributes (lists, tuples,
    dicts, sets, their subclasses, and dataclass instances), so that the copy's step appends to its own lists,
    never to the caller's. Every tensor reachable through those (parameters, buffers, a plain tensor attribute
    such as ``example_input_array`` or a positional encoding, the tensors in a list of step outputs) becomes
    ``stand_in(tensor)``, once per tensor, so tied tensors stay tied; a parameter stays a parameter and a leaf
    that requires grad still does. Every other object (a numpy table, a Dataset, a tokenizer) is the caller's own,
    shared by reference, not copied. The Trainer or Fabric attached to a module is left out (``None``).

    Args:
        model: the module to copy; it is never changed.
        stand_in: what each tensor becomes: a fake or a meta tensor of its shape, with no grad (the copy sets it).

    Returns:
        The copy.

    Raises:
        ValueError: if ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {brief(model)}")
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack: list[Any] = [model]
    while stack:
        value = stack.pop()
        if isinstance(value, _ATOMIC) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, Tensor):
            memo[id(value)] = _stand_in(value, stand_in)
        elif isinstance(value, nn.Module):
            for name in ("_trainer", "_fabric"):
                attached = value.__dict__.get(name)
                if attached is not None:
                    memo[id(attached)] = None
                    seen.add(id(attached))
            stack.extend(value.__dict__.values())
        elif isinstance(value, CONTAINERS) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            if isinstance(value, dict):
                stack.extend(value.keys())
                stack.extend(value.values())
            elif isinstance(value, CONTAINERS):
                stack.extend(value)
            else:
                stack.extend(getattr(value, f.name, None) for f in dataclasses.fields(value))
            stack.extend(getattr(value, "__dict__", {}).values())  # a subclass's own attributes
        elif isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module):
            stack.append(value.__self__)  # a hook bound to a module of the tree is bound to its copy
        elif isinstance(value, functools.partial):
            stack.extend((value.func, *value.args, *value.keywords.values()))
            stack.extend(value.__dict__.values())
        else:
            memo[id(value)] = value  # shared: deepcopy finds it in the memo and copies nothing of it
    return copy.deepcopy(model, memo)


def _stand_in(tensor: Tensor, stand_in: Callable[[Tensor], Tensor]) -> Tensor:
    made = stand_in(tensor)
    if isinstance(tensor, nn.Parameter):
        return made if isinstance(made, nn.Parameter) else nn.Parameter(made, requires_grad=tensor.requires_grad)
    if tensor.requires_grad and tensor.is_leaf and not made.requires_grad and made.is_floating_point():
        made.requires_grad_(True)
    return made


_P = ParamSpec("_P")
_R = TypeVar("_R")


class GlobalState:
    """What a dry run must leave as it found it: the random generators, the modes and hooks, the global flags.

    Read by :meth:`take`; :meth:`restore` puts every item back. The items: Python's ``random``, numpy's global
    generator (where numpy is imported), torch's CPU generator and CUDA's (where CUDA is initialised), the
    dispatch and function mode stacks, the default saved-tensor hooks, the default dtype, grad mode, autocast's
    state per device type and its cache, and ``torch.use_deterministic_algorithms``.
    """

    AUTOCAST_DEVICES = ("cpu", "cuda")

    def __init__(self) -> None:
        self.random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.dispatch, self.function = global_modes.dispatch(), global_modes.function()
        self.flags, self.hooks = global_modes.flags(), global_modes.saved_tensors_hooks()
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.autocast = {
            device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in self.AUTOCAST_DEVICES
        }
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )

    @classmethod
    def take(cls) -> GlobalState:
        """The state now.

        Returns:
            A snapshot, to :meth:`restore` later.
        """
        return cls()

    def restore(self) -> None:
        """Put every item back as it was taken; the generators always, the rest where it changed."""
        global_modes.restore(self.dispatch, self.function, self.flags, self.hooks)
        random.setstate(self.random)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and numpy is not None:
            numpy.random.set_state(self.numpy)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
        for device, (enabled, dtype) in self.autocast.items():
            if torch.is_autocast_enabled(device) != enabled:
                torch.set_autocast_enabled(device, enabled)
            if torch.get_autocast_dtype(device) != dtype:
                torch.set_autocast_dtype(device, dtype)
        if torch.is_autocast_cache_enabled() != self.autocast_cache:
            torch.set_autocast_cache_enabled(self.autocast_cache)
        deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        if deterministic != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])


@contextlib.contextmanager
def preserved_globals() -> Iterator[None]:
    """Leave the process's global state as the block found it, whatever the block did or raised.

    Every dry-run entry point runs inside it: torch's fake collectives draw work ids from Python's ``random``,
    a batch callable draws from torch's generator, and a step that fails half-way may leave a mode behind.
    See :class:`GlobalState` for the items.

    Yields:
        Nothing; the state is put back on leaving.
    """
    state = GlobalState.take()
    try:
        yield
    finally:
        state.restore()


def preserving_globals(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` run inside :func:`preserved_globals`, for the dry runs' entry points.

    Args:
        function: the entry point.

    Returns:
        The wrapped function, with the same name, signature and docstring.
    """

    @functools.wraps(function)
    def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with preserved_globals():
            return function(*args, **kwargs)

    return wrapped


def build(make: Callable[[], nn.Module], mode: Any, notes: list[str] | None = None) -> nn.Module:
    """The user's model built under fake tensors; a constructor that reads tensor values is built on the meta device.

    On the meta device torch's initializers do nothing (``trunc_normal_`` no longer samples until a
    value check passes), and the few small tensors made only from constants (``torch.linspace`` over
    the depth, as timm's drop-path schedule is) are computed for real on the CPU, so that ``.item()``
    and ``if`` on them work. :func:`fake_module` then makes every tensor fake; what the constructor drew
    from the random generator is put back. A constructor that converts its module (``Model().to(torch.bfloat16)``,
    ``.half()``) converts its fake tensors in place (:func:`converting_in_place`), as a real module's ``.data``.

    Args:
        make: a zero-argument callable that returns an ``nn.Module``.
        mode: the active ``FakeTensorMode``.
        notes: where to say that the constructor was built on the meta device, and why.

    Returns:
        The module; built on the meta device, its tensors are meta or small real ones.

    Raises:
        ValueError: if ``make`` builds something other than an ``nn.Module``.
        PredictionError: naming the line, if the constructor reads a value that is not a constant.
    """
    try:
        with converting_in_place():
            built = make()
    except Exception as error:
        if not is_unknown_value(error):
            raise
        try:
            constants = KnownValues(mode, limit=BUILD_ELEMENTS, device="cpu")
            with unset_fake(), torch.random.fork_rng(devices=[]), torch.device("meta"), constants:
                built = make()
        except Exception as again:
            if is_unknown_value(again):
                raise unknown_value_error(again, "the model's constructor") from None
            raise
        if notes is not None:
            notes.append(
                f"the model's constructor reads tensor values ({branching_line(error)}): it was built on the meta"
                f" device, with its constant tensors of up to {BUILD_ELEMENTS:,} elements computed for real"
            )
    if not isinstance(built, nn.Module):
        raise ValueError(f"model() must build an nn.Module, got {type(built).__name__}")
    return built


def _own_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """A module's own parameters and buffers by name, a tied one under each of its names."""
    parameters = module.named_parameters(recurse=False, remove_duplicate=False)
    return [*parameters, *module.named_buffers(recurse=False, remove_duplicate=False)]


def _mend(module: nn.Module) -> None:
    """Give a fresh fake to each tensor whose views do not share its storage, so that a view counts as its base.

    ``copy.deepcopy`` of a fake tensor (``nn.Transformer`` clones its layers so) sets a new storage that the
    fake mode does not carry into views: the census would count a saved ``weight.t()`` as an activation.
    """
    done: dict[int, Tensor] = {}
    for sub in module.modules():
        for name, tensor in _own_tensors(sub):
            if id(tensor) not in done:
                plain = tensor.detach()
                if plain.untyped_storage()._cdata == tensor.untyped_storage()._cdata:
                    done[id(tensor)] = tensor
                    continue
                fresh = torch.empty_strided(plain.shape, plain.stride(), dtype=plain.dtype)
                done[id(tensor)] = (
                    nn.Parameter(fresh, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fresh
                )
            if done[id(tensor)] is not tensor:
                setattr(sub, name, done[id(tensor)])


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` for fake tensors, which cannot be swapped in place; ties are kept."""
    done: dict[int, Tensor] = {}
    for sub in module.modules():
        for name, tensor in _own_tensors(sub):
            if id(tensor) not in done:
                cast = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()
                if isinstance(tensor, nn.Parameter):
                    cast = nn.Parameter(cast, requires_grad=tensor.requires_grad)
                done[id(tensor)] = cast
            setattr(sub, name, done[id(tensor)])  # a buffer stays a buffer, persistent or not


def fake_batch(batch: Any, module: nn.Module, dtype: torch.dtype | None, notes: list[str] | None = None) -> Any:
    """The batch as a dry run takes it: shapes become empty fake tensors, floating tensors fake copies, a callable
    is called. Integer and boolean tensors stay real copies (:func:`is_known`): their values, token ids and
    attention masks, can decide the path the model takes, as in training.

    Args:
        batch: tensors (real or meta), ``torch.Size`` shapes, any nesting of them, or a callable
            building the batch (given ``module`` if it takes one argument).
        module: the fake model, for a batch callable of one argument.
        dtype: the true-precision parameter dtype, to which floating inputs are cast as Lightning does.
        notes: where to say which integer or boolean tensors have no values (given as shapes, or made by the
            batch callable with more than :data:`KNOWN_ELEMENTS` elements).

    Returns:
        The batch with every tensor fake.

    Raises:
        ValueError: if a shape has a negative size, or the batch holds no tensor.
    """
    given = batch
    if callable(batch) and not isinstance(batch, (Tensor, torch.Size)):
        # token ids and labels drawn at random are real (the user's generator is put back), so they have values
        with torch.random.fork_rng(devices=[]), KnownValues(None, random=True):
            batch = batch(module) if _arity(batch) == 1 else batch()

    def shape(size: torch.Size) -> Tensor:
        if any(dim < 0 for dim in size):
            raise ValueError(f"batch sizes must be 0 or more, got {size!r}")
        return torch.empty(size, dtype=dtype or torch.float32)

    def tensor(t: Tensor) -> Tensor:
        if not t.is_meta and not t.is_floating_point() and not t.is_complex() and is_known(t):
            with unset_fake():  # token ids, masks, labels: their values decide the model's path, as in training
                return t.detach().clone()
        fake = torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t.detach().clone()
        if dtype is not None and fake.is_floating_point():
            fake = fake.to(dtype)  # Lightning's true-precision plugins cast floating inputs too
        return fake

    batch = apply_to_collection(batch, torch.Size, shape)
    batch = apply_to_collection(batch, Tensor, tensor)
    unknown = [t for t in batch_tensors(batch) if not t.is_floating_point() and not is_known(t)]
    if unknown and notes is not None:
        shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in unknown[:3])
        notes.append(
            f"the batch's integer or boolean tensor(s) {shapes} have no values (given as shapes, or too large to"
            " make for real): code that branches on them takes the path for unknown values, as in tracing"
            " (transformers then builds an explicit attention mask, as for a padded batch); pass real tensors"
            " for the real path"
        )
    if not batch_tensors(batch):
        made = " (what the batch callable returned)" if given is not batch else ""
        raise ValueError(f"batch must contain at least one tensor or torch.Size, got {brief(batch)}{made}")
    return batch


def _arity(make: Callable[..., Any]) -> int:
    """How many arguments a batch callable takes: none, or one (the model); anything else is refused."""
    try:
        parameters = inspect.signature(make).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        return 0
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 1:
        names = ", ".join(p.name for p in required)
        raise ValueError(f"batch must be a callable of no argument or of one (the model), got one of ({names})")
    return 1 if positional else 0


def forward_context(
    param_dtype: torch.dtype | None, autocast_dtype: torch.dtype | None, *, cache: bool = True
) -> Callable[[], Any]:
    """The forward's precision context; Lightning's mixed-precision plugin runs autocast without its cache.

    Args:
        param_dtype: the true-precision dtype, made the default dtype during the forward, or ``None``.
        autocast_dtype: the mixed-precision dtype to autocast to, or ``None``.
        cache: whether autocast keeps its cache of cast weights (a plain loop's does; Lightning's does not).

    Returns:
        A callable that opens the context, once per forward.
    """

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        if autocast_dtype is not None:
            with torch.autocast("cpu", dtype=autocast_dtype, cache_enabled=cache):
                yield
        elif param_dtype is not None:
            default = torch.get_default_dtype()
            torch.set_default_dtype(param_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    return context


def eager() -> Any:
    """Run compiled code as plain PyTorch: Dynamo cannot compile for fake tensors the step did not make.

    Returns:
        ``torch.compiler.set_stance("force_eager")``, or a context that does nothing on a torch without it.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
