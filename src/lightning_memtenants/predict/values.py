"""The tensor values a dry run knows: constants and the batch's integers stay real, so the step branches as in training.

Fake tensors carry no values, so code that reads one (``mask.all()``, ``torch.equal``, ``.item()``)
cannot run on them. Much of that code reads tensors made only from constants (a generated causal
mask, ``torch.linspace`` in a constructor) or from the batch's integer tensors (token ids, an
attention mask), whose values a dry run does have. :class:`KnownValues` computes those for real,
a few elements each, so that the model takes the path a real run takes; everything that touches a
parameter or an activation stays fake. In a training step two more kinds of values are made real: small
random draws (LayerDrop's ``torch.rand([]) < p``), drawn from a fork of the generator, and a mixture of
experts' choice of experts (``topk``/``argmax``/``max`` indices over fake logits), which follows the routing
the dry run assumes (:mod:`lightning_memtenants.predict.routing`). What is left, a branch on a value no one
knows or a size that follows one, becomes one sentence naming the line (:func:`unknown_value_error`).
"""

from __future__ import annotations

import os
import traceback
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_memtenants._private import FakeTensor, real_as_fake, tensor_factories, unset_fake
from lightning_memtenants.core.storage import TWIN
from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.predict.routing import Routing, routed_indices

# The most elements a real tensor may have for an operator on it to run for real: masks and index tensors,
# not activations. A larger one is handed to the fake mode, as every tensor was before.
KNOWN_ELEMENTS = 1 << 22
# In a constructor, only the constants that schedules are made of (``torch.linspace`` over the depth):
# a parameter's tensor, made by the same factories, must stay fake.
BUILD_ELEMENTS = 1 << 10
# The most elements of a random draw made for real in a step (LayerDrop's ``torch.rand([])``, a per-layer draw).
RANDOM_ELEMENTS = 1 << 10

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
        random: whether random numbers are drawn for real too (a batch callable's, or the step's small draws such
            as LayerDrop's ``torch.rand([])``, each under ``torch.random.fork_rng``); by default they stay fake, as
            drawing them would move the user's generator.
        routing: the routing assumed where a router chooses experts from unknown values (:mod:`.routing`): the
            indices of ``topk``, ``argmax`` and ``max`` over a fake floating tensor become a real choice that
            follows it, so that the tokens per expert, and every shape after them, are known; ``None`` leaves them
            fake.
        random_limit: the most elements of a random draw made for real (``limit`` by default; a step's are
            :data:`RANDOM_ELEMENTS`, a scalar such as LayerDrop's, not noise, which costs its elements in time).
    """

    def __init__(
        self,
        mode: Any,
        tracker: LiveTensorTracker | None = None,
        limit: int = KNOWN_ELEMENTS,
        device: str | None = None,
        random: bool = False,
        routing: Routing | None = None,
        random_limit: int | None = None,
    ) -> None:
        super().__init__()
        self.random = random
        self.random_limit = limit if random_limit is None else random_limit
        # the routing assumed for a router's choice (``topk``/``argmax``/``max`` indices over unknown values), or None
        self.routing = routing
        self.router_calls = 0
        # whether a routed choice reached the model's tensors or a size, and whether a random draw was taken for real
        self.routed = False
        self.drew = False
        self.mode = mode
        self.tracker = tracker
        self.limit = limit
        self.device = device
        # ``torch.empty`` and its kin make no values to branch on: their tensors stay fake (FSDP2's buffers are made so)
        self.factories = frozenset(f for f in tensor_factories() if "empty" not in getattr(f, "__name__", ""))
        # storage id -> a weak reference to it, for the known storages an operator with an unknown input wrote into
        self._written_storages: dict[int, weakref.ref] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INDEXING and len(args) > 1:
            args = (args[0], _integers(args[1]), *args[2:])
        like = self._constant_like(func, args, kwargs)
        if like is not None:  # ``torch.ones_like(x)``: a constant, whose shape alone is x's
            args = (like, *args[1:])
        known, fake = [], False
        for tensor in _tensors((*args, *kwargs.values())):
            if is_known(tensor, self.limit):
                known.append(tensor)
                fake = fake or self._stale(tensor)  # written by an operator on the fake mode: its copy is what holds
            else:
                fake = True
        drawn = _random(func)
        if drawn and any(t.numel() > self.random_limit for t in known):
            fake = True  # a large draw stays fake: its values decide no path
        if like is not None and not fake:
            known = []  # the stand-in is no input: the constant is the operator's new tensor
        made = known or like is not None or self._small_constant(func, args, kwargs, drawn)
        if not fake and (self.random or not drawn) and made:
            if not known and self.device is not None and kwargs.get("device") is None:
                kwargs = {**kwargs, "device": self.device}
            if self.tracker is None:
                with unset_fake():
                    out = func(*args, **kwargs)
            else:
                out = self._counted(func, args, kwargs, known)
            if drawn:
                self.drew = True
            if self.routing is not None and any(getattr(t, _ROUTED, False) for t in known):
                self.routed = self.routed or getattr(func, "__name__", "") in _SIZES
                for tensor in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
                    setattr(tensor, _ROUTED, True)  # what is computed from a routed choice follows the routing too
            return out
        if known and self.tracker is not None:
            if self.routing is not None and any(getattr(t, _ROUTED, False) for t in known):
                self.routed = True  # the choice reaches the model's own tensors (the tokens an expert takes)
            tracker = self.tracker
            tracker.unseen = True
            try:
                copies = [real_as_fake(self.mode, tensor) for tensor in known]
            finally:
                tracker.unseen = False
            twins = {}
            for tensor, copy in zip(known, copies, strict=True):
                if getattr(tensor, _TWIN, None) is None:  # the batch's (counted as the batch) or a routed choice
                    tracker.host(copy)
                else:
                    twins[id(tensor)] = copy
            if twins and _recorded(func, args, kwargs):
                # autograd saves what the operator is given: the twin, the memory counted, not the real tensor
                swapped = dict(zip(kwargs, _swapped(tuple(kwargs.values()), twins), strict=True))
                out = func(*_swapped(args, twins), **swapped)
                self._written(func, args, kwargs)
                return self._checked(func, args, kwargs, out)
        out = func(*args, **kwargs)
        if known:
            self._written(func, args, kwargs)
        return self._checked(func, args, kwargs, out)

    def _checked(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """``out`` of an operator run on the fake mode, its sizes checked, a router's choice made real."""
        if self.tracker is None:
            return out
        _known_sizes(out)
        if self.routing is not None and getattr(func, "__name__", "") in _CHOICES:
            return self._route(func, args, kwargs, out)
        return out

    def _constant_like(self, func: Any, args: Any, kwargs: Any) -> Tensor | None:
        """For an integer or boolean ``ones_like``, ``zeros_like`` or ``full_like`` of a fake tensor, a real stand-in
        for that tensor.

        Their values are the constant's, whatever the tensor's: only its shape, strides and device are read. An integer
        or boolean constant is a mask, a length or an index, whose values decide paths and sizes (Wav2Vec2ForCTC's CTC
        lengths are ``torch.ones_like(input_values, dtype=torch.long).sum(-1)``): it is known, where it has at most
        ``limit`` elements, on the CPU. The stand-in (uninitialised, of the same strides, never counted) is what
        ``func`` runs on, and its output is counted as :meth:`_counted` counts every known tensor, as the real run holds
        it. A floating one (an optimizer's ``zeros_like(p)``), a larger one, or one of a wrapper (a DTensor) stays
        fake: made for real it would cost the dry run the memory it predicts.

        Returns:
            The stand-in, or ``None`` where the call is not such a constant.
        """
        if self.mode is None or func not in _LIKE or not args or type(args[0]) is not FakeTensor:
            return None
        source = args[0]
        dtype = kwargs.get("dtype") or source.dtype
        if dtype.is_floating_point or dtype.is_complex or kwargs.get("requires_grad"):
            return None  # arithmetic (an optimizer's zeros_like(p)), whose values decide nothing: it stays fake
        if any(isinstance(t, Tensor) for t in (*args[1:], *kwargs.values())):
            return None
        device = kwargs.get("device")
        if source.device.type != "cpu" or (device is not None and torch.device(device).type != "cpu"):
            return None
        if source.layout is not torch.strided or kwargs.get("layout") not in (None, torch.strided):
            return None
        sizes = (*source.shape, *source.stride())
        if not all(type(n) is int for n in sizes) or source.numel() > self.limit:
            return None
        tracker = self.tracker
        if tracker is not None:
            tracker.unseen = True
        try:
            with unset_fake():
                return torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device="cpu")
        finally:
            if tracker is not None:
                tracker.unseen = False

    def _stale(self, tensor: Tensor) -> bool:
        """Whether an operator with an unknown input wrote into ``tensor``'s storage: its values are unknown now."""
        if not self._written_storages:
            return False
        ref = self._written_storages.get(id(tensor.untyped_storage()))
        return ref is not None and ref() is tensor.untyped_storage()

    def _written(self, func: Any, args: Any, kwargs: Any) -> None:
        """Mark the known tensors that ``func``, which ran on the fake mode, wrote into (in place, or ``out=``): their
        fake copies now hold what it wrote, and their real values are no longer the tensor's, so they count as unknown
        from now on (the fake copy, the same memory, is what later operators see)."""
        name = getattr(func, "__name__", "")
        written = [kwargs["out"]] if kwargs.get("out") is not None else []
        if args and (name in _IN_PLACE or (name.endswith("_") and not name.endswith("__"))):
            written.append(args[0])
        for tensor in _tensors(written):
            if not isinstance(tensor, FakeTensor) and tensor.layout is torch.strided:
                storage = tensor.untyped_storage()
                self._written_storages[id(storage)] = weakref.ref(storage)

    def _counted(self, func: Any, args: Any, kwargs: Any, known: list[Tensor]) -> Any:
        """``func`` computed for real, each new storage it makes counted as its fake twin (:data:`_TWIN`).

        The real storage is unseen by the tracker; its twin, the fake copy the fake mode will convert it to where it
        meets a fake tensor, is what is counted, from now on. The twin is held by every real tensor on the storage,
        and by whatever holds the fake copy (autograd, which saves ``nn.LSTM``'s default zero state): so the memory
        lives as long as either, as the one real storage does in a real run, counted once in the allocated bytes and,
        where autograd saves it, as an activation.
        """
        tracker = self.tracker
        assert tracker is not None
        tracker.unseen = True
        try:
            with unset_fake():
                out = func(*args, **kwargs)
            # each input's storage, and its twin (none for the batch's tensors, already counted as the batch)
            twins = {id(t.untyped_storage()): getattr(t, _TWIN, None) for t in known if t.layout is torch.strided}
            # a model of another device keeps ``torch.tensor(...)``'s Python data on the host (its ``host_ops``)
            lifted = bool(tracker.host_ops) and getattr(func, "__name__", "") in _LIFTED
            made: list[tuple[Tensor, Tensor | None]] = []
            for tensor in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
                # a twin is the storage's: a copy's own (``copy.deepcopy`` copies the attribute) is made anew
                if isinstance(tensor, FakeTensor) or tensor.device.type != "cpu" or tensor.layout is not torch.strided:
                    continue
                key = id(tensor.untyped_storage())
                if key in twins:  # a view of an input: the input's twin, or none (the batch's memory)
                    if twins[key] is not None:
                        setattr(tensor, _TWIN, twins[key])
                    continue
                if lifted:  # host memory, in no figure: its fake copies too, as the batch's
                    twins[key] = None
                    made.append((tensor, None))
                    continue
                twin = real_as_fake(self.mode, tensor)
                setattr(tensor, _TWIN, twin)
                twins[key] = twin
                made.append((tensor, twin))
        finally:
            tracker.unseen = False
        for tensor, twin in made:
            tracker.host(tensor)  # the real storage is never counted, whoever shows it to the tracker (a resume's root)
            if twin is not None:
                tracker.add(twin)
        return out

    def _route(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """``out`` of a router's ``topk``/``argmax``/``max``, its fake indices replaced by a real routed choice.

        The real choice is not counted (its storage is marked as the tracker's host memory): the fake indices the
        operator returned are the memory, kept alive as long as the real choice is (and as autograd keeps them).
        """
        name = func.__name__
        source = args[0] if args else kwargs.get("input")
        indices = out if isinstance(out, Tensor) else (out[1] if isinstance(out, tuple) and len(out) == 2 else None)
        if not (isinstance(source, FakeTensor) and source.is_floating_point() and isinstance(indices, Tensor)):
            return out
        if indices.dtype != torch.int64 or not all(type(d) is int for d in (*source.shape, *indices.shape)):
            return out
        if name == "topk":
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            top_k, keep = (args[1] if len(args) > 1 else kwargs.get("k")), True
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            top_k, keep = 1, bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if not isinstance(dim, int) or not isinstance(top_k, int) or source.dim() == 0 or indices.numel() > self.limit:
            return out
        dim %= source.dim()
        experts = source.size(dim)
        rows = source.numel() // experts if experts else 0
        if experts == 0 or rows * top_k != indices.numel() or top_k > experts:
            return out
        if not self.routing.chooses_among(self.router_calls, experts):  # type: ignore[union-attr]
            return out
        counts = self.routing.counts_for(self.router_calls, rows, top_k, experts)  # type: ignore[union-attr]
        self.router_calls += 1
        tracker = self.tracker
        assert tracker is not None
        tracker.unseen = True
        try:
            with unset_fake():
                others = [source.size(d) for d in range(source.dim()) if d != dim]
                choice = routed_indices(counts, rows, top_k).reshape(*others, top_k).movedim(-1, dim)
                choice = (choice if keep else choice.squeeze(dim)).contiguous()
        finally:
            tracker.unseen = False
        if tuple(choice.shape) != tuple(indices.shape):
            return out
        tracker.host(choice)
        setattr(choice, _ROUTED, True)
        setattr(choice, _STANDS_FOR, indices)  # the fake indices live as long as the choice: they are its memory
        return choice if isinstance(out, Tensor) else type(out)((out[0], choice))

    def _small_constant(self, func: Any, args: Any, kwargs: Any, drawn: bool = False) -> bool:
        """Whether ``func`` makes a tensor from its arguments alone, on the CPU, of few elements (seen on meta); a
        random draw of at most ``random_limit``."""
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
        limit = min(self.limit, self.random_limit) if drawn else self.limit
        return isinstance(shape, Tensor) and shape.numel() <= limit


# The attribute that marks a real tensor computed from a routed choice, and the one that keeps its fake indices alive.
_ROUTED = "_memtenants_routed"
_STANDS_FOR = "_memtenants_stands_for"
# The fake copy that stands for a real tensor's storage in the count (:meth:`KnownValues._counted`), on every real
# tensor on that storage (the census counts it in the real tensor's stead).
_TWIN = TWIN
# The operators whose indices are a router's choice, and those whose output sizes follow the values they read.
_CHOICES = frozenset({"topk", "argmax", "max"})
_SIZES = frozenset(
    {"nonzero", "argwhere", "where", "masked_select", "unique", "unique_consecutive", "bincount", "repeat_interleave",
     "tolist", "histc", "split", "tensor_split", "__bool__", "__iter__"}
)  # fmt: skip


_INDEXING = frozenset({"__getitem__", "__setitem__"})
# The constants made in the shape of a tensor, whatever its values; and the operators that write into their first
# argument without a trailing underscore.
_LIKE = (torch.ones_like, torch.zeros_like, torch.full_like)
# The functions that make a tensor of Python data (``aten.lift_fresh``, a model of a GPU's host operators).
_LIFTED = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})
_IN_PLACE = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)  # fmt: skip


def _recorded(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether autograd may record ``func``'s call (or the calls inside it), saving their inputs: an input requires
    grad, under grad mode."""
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in _tensors((*args, *kwargs.values())))


def _swapped(values: tuple[Any, ...], twins: dict[int, Tensor]) -> tuple[Any, ...]:
    """``values`` with each known tensor that has a twin replaced by its fake copy, in lists and tuples too."""

    def swap(value: Any) -> Any:
        if isinstance(value, Tensor):
            return twins.get(id(value), value)
        if isinstance(value, (list, tuple)) and any(id(v) in twins for v in value if isinstance(v, Tensor)):
            return type(value)(twins.get(id(v), v) if isinstance(v, Tensor) else v for v in value)
        return value

    return tuple(swap(value) for value in values)


def _integers(index: Any) -> Any:
    """An index with its known 0-d integer tensors as Python integers, which is how torch's indexing takes them
    (``applySlicing`` treats a 0-d integer tensor as an integer: a view, ``select``); a fake copy of one would
    be read with ``.item()`` instead, a value the fake mode does not have."""

    def plain(value: Any) -> Any:
        integer = isinstance(value, Tensor) and not value.is_floating_point() and value.dtype != torch.bool
        if integer and value.dim() == 0 and is_known(value):
            with unset_fake():
                return int(value)
        return value

    if isinstance(index, tuple):
        return tuple(plain(v) for v in index)
    return plain(index)


def _known_sizes(out: Any) -> None:
    """Raise torch's data-dependent error, here, for an operator whose output sizes depend on unknown values.

    Such a size (``torch.where(mask)`` of a fake mask) cannot be counted; raised at the operator, the error's
    traceback names the user's line (:func:`branching_line`) rather than the monitor's measurement.
    """
    for tensor in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
        for size in tensor.shape:
            if type(size) is not int:
                int(size)  # an unbacked size raises GuardOnDataDependentSymNode; a backed one is a plain guard


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
        f"{what} cannot be predicted: {branching_line(error)} needs the value of a tensor computed from the"
        " model's parameters or a floating-point input, which a dry run does not have (it keeps real only"
        " constants, the batch's integer and boolean tensors, small random draws and a router's choice of experts,"
        " which it assumes: see routing)"
    )


def unknown_value_in(error: BaseException, tracker: LiveTensorTracker | None = None) -> BaseException | None:
    """The data-dependent error behind ``error``, wherever the step's failure put it, or ``None``.

    A value read in the user's code is ``error`` itself. One met while the tracker counted an operator's outputs
    (a size no one knows) is kept in ``tracker.error`` and reaches the caller as the monitor's "measuring memory
    source failed"; one hidden behind a later failure (the monitor closing) is in the exception's context.

    Args:
        error: what the step raised.
        tracker: the dry run's tracker, whose first failure is read too.

    Returns:
        The error for :func:`unknown_value_error`, or ``None`` where the failure is something else.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if is_unknown_value(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    kept = tracker.error if tracker is not None else None
    return kept if kept is not None and is_unknown_value(kept) else None
