"""The tensor values a dry run knows: constants and the batch's integers stay real, so the step branches as in training.

Fake tensors carry no values, so code that reads one (``mask.all()``, ``torch.equal``, ``.item()``)
cannot run on them. Much of that code reads tensors made only from constants (a generated causal
mask, ``torch.linspace`` in a constructor) or from the batch's integer tensors (token ids, an
attention mask), whose values a dry run does have. :class:`KnownValues` computes those for real,
a few elements each, so that the model takes the path a real run takes; everything that touches a
parameter or an activation stays fake. What is left, a branch on a value no one knows, becomes one
sentence naming the line (:func:`unknown_value_error`).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_memtenants._private import FakeTensor, real_as_fake, tensor_factories, unset_fake
from lightning_memtenants.core.tracker import LiveTensorTracker

# The most elements a real tensor may have for an operator on it to run for real: masks and index tensors,
# not activations. A larger one is handed to the fake mode, as every tensor was before.
KNOWN_ELEMENTS = 1 << 22
# In a constructor, only the constants that schedules are made of (``torch.linspace`` over the depth):
# a parameter's tensor, made by the same factories, must stay fake.
BUILD_ELEMENTS = 1 << 10

_TORCH = os.path.dirname(torch.__file__)
_PACKAGE = os.path.dirname(os.path.dirname(__file__))
# torch's own machinery between the user's line and the failed guard; torch.nn and the like are code that branches
_MACHINERY = tuple(
    os.path.join(_TORCH, name)
    for name in (
        "fx",
        "_subclasses",
        "_ops.py",
        "utils",
        "_prims",
        "_prims_common",
        "_refs",
        "_decomp",
        "_meta_registrations.py",
        "_library",
        "_higher_order_ops",
        "overrides.py",
        "_tensor.py",
        "_dynamo",
        "_compile.py",
        "_logging",
        "_guards.py",
        "__init__.py",
    )
)


def _tensors(values: Iterable[Any]) -> Iterable[Tensor]:
    for value in values:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))


def is_known(tensor: Tensor, limit: int = KNOWN_ELEMENTS) -> bool:
    """Whether ``tensor`` is a real CPU tensor small enough to compute with for real in a dry run.

    Args:
        tensor: any tensor.
        limit: the most elements it may have.

    Returns:
        True for a real (not fake, not meta) CPU tensor of at most ``limit`` elements that autograd does not follow.
    """
    return (
        not isinstance(tensor, FakeTensor)
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and tensor.numel() <= limit
    )


class KnownValues(TorchFunctionMode):
    """Run for real every torch function whose tensors are all known (:func:`is_known`), or that makes a small
    constant tensor; hand everything else to the fake mode below.

    A real tensor that meets a fake one is converted by the fake mode, and that converted copy is
    memory the real run does not have: it is made unseen by ``tracker`` and marked never to be counted.

    Args:
        mode: the active ``FakeTensorMode``.
        tracker: the dry run's :class:`LiveTensorTracker`, or ``None`` where nothing is counted (a constructor).
        limit: the most elements of a tensor computed for real.
        device: the device a small constant is made on where its call names none (``"cpu"`` under a
            ``torch.device("meta")`` context, which would make it meta); ``None`` leaves the call as it is.
        random: whether random numbers are drawn for real too (a batch callable's, under ``torch.random.fork_rng``);
            by default they stay fake, as drawing them would move the user's generator.
    """

    def __init__(
        self,
        mode: Any,
        tracker: LiveTensorTracker | None = None,
        limit: int = KNOWN_ELEMENTS,
        device: str | None = None,
        random: bool = False,
    ) -> None:
        super().__init__()
        self.random = random
        self.mode = mode
        self.tracker = tracker
        self.limit = limit
        self.device = device
        # ``torch.empty`` and its kin make no values to branch on: their tensors stay fake (FSDP2's buffers are made so)
        self.factories = frozenset(f for f in tensor_factories() if "empty" not in getattr(f, "__name__", ""))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        known, fake = [], False
        for tensor in _tensors((*args, *kwargs.values())):
            if is_known(tensor, self.limit):
                known.append(tensor)
            else:
                fake = True
        if not fake and (self.random or not _random(func)) and (known or self._small_constant(func, args, kwargs)):
            if not known and self.device is not None and kwargs.get("device") is None:
                kwargs = {**kwargs, "device": self.device}
            with unset_fake():
                return func(*args, **kwargs)
        if known and self.tracker is not None:
            tracker = self.tracker
            tracker.unseen = True
            try:
                copies = [real_as_fake(self.mode, tensor) for tensor in known]
            finally:
                tracker.unseen = False
            for copy in copies:
                tracker.host(copy)
        return func(*args, **kwargs)

    def _small_constant(self, func: Any, args: Any, kwargs: Any) -> bool:
        """Whether ``func`` makes a tensor from its arguments alone, on the CPU, of few elements (seen on meta)."""
        if func not in self.factories:
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        try:
            with unset_fake():
                shape = func(*args, **{**kwargs, "device": "meta"})
        except Exception:
            return False
        return isinstance(shape, Tensor) and shape.numel() <= self.limit


def _random(func: Any) -> bool:
    """Whether ``func`` draws random numbers: computed for real it would move the user's generator."""
    name = getattr(func, "__name__", "")
    return any(word in name for word in _RANDOM)


_RANDOM = ("rand", "uniform", "normal", "bernoulli", "exponential", "geometric", "cauchy", "dropout", "multinomial")


class PredictionError(ValueError):
    """A step or a model that a dry run cannot run: it branches on a tensor value that fake tensors do not have."""


def is_unknown_value(error: BaseException) -> bool:
    """Whether ``error`` is torch saying that code needed a fake tensor's value (a guard on a data-dependent value).

    Args:
        error: any exception.

    Returns:
        True for torch's data-dependent errors, raised where Python branches on, or reads, a value.
    """
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & {"GuardOnDataDependentSymNode", "DataDependentOutputException"}:
        return True
    text = str(error)
    # a meta tensor's .item(), and .numpy() of a fake one, are reads of a value too
    reads = ("on meta tensors", ".numpy() is not supported for tensor subclasses")
    return isinstance(error, (RuntimeError, NotImplementedError)) and any(r in text for r in reads)


def branching_line(error: BaseException) -> str:
    """The line of code that needed the value: the innermost frame outside torch's machinery and this package.

    Args:
        error: the exception, with its traceback.

    Returns:
        ``"path:line (function): code"``, or ``"an unknown line"`` where the traceback holds none.
    """
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE) or path.startswith(_MACHINERY) or frame.filename.startswith("<"):
            continue
        shown = os.path.relpath(path, _TORCH) if path.startswith(_TORCH) else path
        shown = f"torch/{shown}" if path.startswith(_TORCH) else shown
        code = f": {frame.line.strip()}" if frame.line else ""
        return f"{shown}:{frame.lineno} ({frame.name}){code}"
    return "an unknown line"


def unknown_value_error(error: BaseException, what: str) -> PredictionError:
    """The one sentence for a model that needs a value the dry run does not have.

    Args:
        error: torch's data-dependent error.
        what: what was being run, e.g. ``"the training step"`` or ``"the model's constructor"``.

    Returns:
        The error to raise (``from None``), naming the line.
    """
    return PredictionError(
        f"{what} cannot be predicted: {branching_line(error)} reads the value of a tensor computed from the"
        " model's parameters or a floating-point input, which a dry run does not have (it keeps real only"
        " constants and the batch's integer and boolean tensors)"
    )
