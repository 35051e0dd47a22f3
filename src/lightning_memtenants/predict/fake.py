"""Fake-tensor plumbing shared by every dry run: the mode, the model and batch copied as fakes, the precision.

Fake tensors carry shapes, dtypes and storages but no data, so the user's own code runs on them
at no memory cost; nothing of the caller's model is changed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_memtenants._private import FakeTensor, FakeTensorMode, ShapeEnv, unset_fake
from lightning_memtenants.checks import brief, one_of
from lightning_memtenants.core.storage import batch_tensors
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
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
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
    """A copy of ``model`` whose parameters and buffers are fake; tied tensors stay tied.

    The user's model is never touched: a prediction steps its copy, which costs no memory.

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
        memo: dict[int, Any] = {}
        for tensor in (*model.parameters(), *model.buffers()):
            if id(tensor) not in memo:
                # a model built on the meta device has shapes and no memory: its fakes are CPU tensors like the rest
                plain = tensor.detach()
                fake = torch.empty_strided(plain.shape, plain.stride(), dtype=plain.dtype) if plain.is_meta else None
                if isinstance(tensor, FakeTensor):
                    memo[id(tensor)] = tensor
                    continue
                fake = mode.from_tensor(plain) if fake is None else fake
                if isinstance(tensor, nn.Parameter):
                    fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                memo[id(tensor)] = fake
        for module in model.modules():
            for name in ("_trainer", "_fabric"):
                attached = module.__dict__.get(name)
                if attached is not None:
                    memo[id(attached)] = None
        built = copy.deepcopy(model, memo)
    assert built is not None
    if dtype is not None:
        _cast(built, dtype)
    return built


def build(make: Callable[[], nn.Module], mode: Any, notes: list[str] | None = None) -> nn.Module:
    """The user's model built under fake tensors; a constructor that reads tensor values is built on the meta device.

    On the meta device torch's initializers do nothing (``trunc_normal_`` no longer samples until a
    value check passes), and the few small tensors made only from constants (``torch.linspace`` over
    the depth, as timm's drop-path schedule is) are computed for real on the CPU, so that ``.item()``
    and ``if`` on them work. :func:`fake_module` then makes every tensor fake; what the constructor drew
    from the random generator is put back.

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
