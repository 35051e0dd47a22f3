"""A live-tensor tracker: exact current and peak bytes on CPU and fake devices.

Every storage an operator creates is registered through a ``TorchDispatchMode``; a weak
reference with a callback takes it off again when it is freed. Storages that already existed are
the roots the caller names (the callback names the training's: parameters, buffers, gradients,
optimizer state, the batch) and, with ``scan=True``, every tensor a one-time ``gc`` scan finds. It
costs a Python call per operator, so the callback runs it on logging steps unless asked otherwise.

A Ctrl+C is never lost in the tracker. Python swallows any exception raised inside a weak
reference's callback (it prints "Exception ignored in"), and a signal that arrives while a C operator
runs is raised at the first Python instruction after it: often the entry of the callback of a storage
that operator freed. So the callback runs no Python code: it is a ``functools.partial`` of
``dict.__setitem__`` that notes the storage as dead. The dead storages are taken off at the next
safe point of ours (the next operator, a read); a ``BaseException`` raised in that bookkeeping (by a
timeline recorder, an allocator model) is kept as pending and raised once the operator's own outputs
are counted, or by :func:`raise_pending`, which the callback's hooks call.

The tracker shares the process with the user's own modes and patches, so it composes:
its mode asks ``torch.compile`` to leave it out of compilation (``ignore_compile_internals``)
rather than making Dynamo skip the frame, it leaves the mode stack as it found it even when
the user's mode sits above it, and its ``UntypedStorage.resize_`` wrapper calls whatever was
installed before and puts it back. Compiled CPU code allocates its buffers outside the dispatcher, through
inductor's ``empty_strided_cpu``; while a tracker runs, a wrapper over it (in ``torch._C._dynamo.guards`` and in
every generated module's globals) counts them, and what was there is put back when the last tracker pauses.
A tracker on a real device never counts fake or meta tensors
as memory; ``count_fake`` counts fake tensors as the memory they stand for (a prediction).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from itertools import compress
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_memtenants._private import (
    FakeTensor,
    TorchDispatchMode,
    inductor_allocator_slots,
    inner_tensors,
    is_traceable_wrapper_subclass,
    mode_stack,
)
from lightning_memtenants.core.storage import storages_of, tensors_in


def _storages(tensor: Tensor) -> Iterator[torch.UntypedStorage]:
    for inner in inner_tensors(tensor):
        yield from storages_of(inner)


def _is_fake(tensor: Tensor) -> bool:
    """A fake or meta tensor: shapes without memory (inductor leaves fakes alive after compiling)."""
    return isinstance(tensor, FakeTensor) or tensor.is_meta


def _live_tensors(count_fake: bool = False) -> list[Tensor]:
    """Every tensor the garbage collector knows of; the type filter runs in C, not per object."""
    objects = gc.get_objects()
    types = {
        tp
        for tp in set(map(type, objects))
        if issubclass(tp, Tensor) and (count_fake or not issubclass(tp, FakeTensor))
    }
    return list(compress(objects, map(types.__contains__, map(type, objects))))


# Per tensor class, whether it is a traceable wrapper subclass (a DTensor, say) whose storages are its inner tensors':
# a property of the class, asked once per class rather than once per operator.
_WRAPPERS: dict[type, bool] = {Tensor: False}
_STRIDED = torch.strided


def _is_plain_tensor(value: object) -> bool:
    return type(value) is Tensor


# What an operator returns that holds no tensor. Most operators a fake step dispatches are ``prim.device``: the
# autograd engine asks every fake tensor's device through the dispatcher, and it returns a ``torch.device``.
_HOLDS_NO_TENSOR = frozenset({torch.device, torch.dtype, torch.layout, int, float, bool, type(None)})

_following: list[LiveTensorTracker] = []
# A BaseException that is not an Exception (a KeyboardInterrupt, a SystemExit), raised inside the bookkeeping of freed
# storages, kept for the next safe point of ours (``raise_pending``): never swallowed, never raised mid-bookkeeping.
_pending: list[BaseException] = []


def raise_pending() -> None:
    """Raise the ``BaseException`` (a ``KeyboardInterrupt``, say) that the trackers' bookkeeping of freed storages
    caught and kept, if any; the callback's hooks call it first, and each operator a tracker sees calls it after its
    outputs are counted.

    Raises:
        BaseException: the first one kept since the last call (the others are dropped: one interrupt is enough).
    """
    if _pending:
        error = _pending[0]
        _pending.clear()
        raise error


def _keep_pending(error: BaseException) -> None:
    if not _pending:
        _pending.append(error)


# The wrapper we installed over ``UntypedStorage.resize_``: (wrapper, previous was in the class's dict, previous).
_installed: list[tuple[Any, bool, Any]] = []


def _resize_wrapper(previous: Any) -> Any:
    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        """``UntypedStorage.resize_`` while a tracker runs: FSDP2 frees and re-allocates its gathered parameters
        this way, outside the dispatcher, so the trackers re-read the storage's size. It calls the method that
        was installed before it (the user's patch, MemTracker's), so both run."""
        out = previous(storage, size)
        for tracker in _following:
            tracker.resized(storage)
        return out

    return resize_


def _follow_resizes(tracker: LiveTensorTracker, on: bool) -> None:
    if on and tracker not in _following:
        if not _following:
            _follow_compiled(True)
        if not _installed:
            own = "resize_" in torch.UntypedStorage.__dict__
            previous = torch.UntypedStorage.resize_
            wrapper = _resize_wrapper(previous)
            _installed.append((wrapper, own, previous))
            torch.UntypedStorage.resize_ = wrapper  # type: ignore[method-assign]
        _following.append(tracker)
    elif not on and tracker in _following:
        _following.remove(tracker)
        if not _following:
            _follow_compiled(False)
        if not _following and _installed:
            wrapper, own, previous = _installed.pop()
            if torch.UntypedStorage.__dict__.get("resize_") is wrapper:
                if own:
                    torch.UntypedStorage.resize_ = previous  # type: ignore[method-assign]
                else:
                    del torch.UntypedStorage.resize_
            # else someone patched over ours since: it stays in their chain, calling only the method before it


# The wrappers we put over inductor's CPU allocators while any tracker runs: id(wrapped) -> (wrapped, wrapper), and
# id(wrapper) -> (wrapper, wrapped). One wrapper per function wrapped, however many generated modules bind it.
_wrapping: dict[int, tuple[Any, Any]] = {}
_wrapped: dict[int, tuple[Any, Any]] = {}


def _allocator_wrapper(previous: Any) -> Any:
    def allocate(*args: Any, **kwargs: Any) -> Any:
        """An allocation of inductor's compiled CPU code while a tracker runs: it bypasses the dispatcher, so the
        trackers count the buffer here. It calls the function that was there before (the user's patch, inductor's
        own), and a buffer counted twice through a chain of such wrappers is counted once."""
        out = previous(*args, **kwargs)
        for tracker in _following:
            tracker.allocated(out)
        if _pending:
            raise_pending()
        return out

    return allocate


def _follow_compiled(on: bool) -> None:
    """Put our wrapper over each of inductor's CPU allocators (``inductor_allocator_slots``), or put back what was.

    A generated module loaded while ours is in ``torch._C._dynamo.guards`` binds ours; it gets the original back with
    the others. A slot someone patched over ours since is left as it is: ours stays in their chain and counts only
    while a tracker runs.
    """
    for namespace, name in inductor_allocator_slots():
        current = namespace[name]
        if on:
            if id(current) in _wrapped:
                continue
            entry = _wrapping.get(id(current))
            if entry is None:
                entry = _wrapping[id(current)] = (current, _allocator_wrapper(current))
                _wrapped[id(entry[1])] = (entry[1], current)
            namespace[name] = entry[1]
        else:
            ours = _wrapped.get(id(current))
            if ours is not None and ours[0] is current:
                namespace[name] = ours[1]
    if not on:
        _wrapping.clear()
        _wrapped.clear()


def _exit_mode(mode: TorchDispatchMode) -> None:
    """Leave ``mode``, also when another mode was entered above it and is still active.

    ``TorchDispatchMode.__exit__`` pops the top of the stack, whatever it is; so the modes above
    ours are lifted off, ours leaves, and they go back in their order, untouched.
    """
    above: list[TorchDispatchMode] = []
    while mode_stack.top() not in (mode, None):
        above.append(mode_stack.pop())
    try:
        if mode_stack.top() is mode:
            below = _saved_flags(mode)
            mode.__exit__(None, None, None)
            if above and below is not None:
                _forget_in_flags(below, list(reversed(above)))
    finally:
        for other in reversed(above):
            mode_stack.push(other)


def _saved_flags(mode: TorchDispatchMode) -> tuple[bool, bool, bool] | None:
    """The "a mode is active" flags ``mode`` saved on entering: what they were below it."""
    deques = [getattr(mode, name, None) for name in mode_stack.FLAG_DEQUES]
    if not all(deques):
        return None
    return deques[0][-1], deques[1][-1], deques[2][-1]  # type: ignore[index]


def _forget_in_flags(below: tuple[bool, bool, bool], above: list[TorchDispatchMode]) -> None:
    """Rewrite what the modes entered above ours saved, and the flags now, as if ours had never been entered.

    Each mode saves torch's "a mode is active" flags on entering and puts them back on leaving; the
    modes above ours saved values that include ours, which they would otherwise restore after we left.
    """
    active, non_infra, without_ignore = below
    for other in above:  # in the order they were entered
        saved = [getattr(other, name, None) for name in mode_stack.FLAG_DEQUES]
        if all(saved):
            saved[0][-1], saved[1][-1], saved[2][-1] = active, non_infra, without_ignore  # type: ignore[index]
        active = True
        non_infra = non_infra or not other.is_infra_mode()
        without_ignore = without_ignore or not other.ignore_compile_internals()
    mode_stack.set_flags(active, non_infra, without_ignore)


# The trackers of a model of another device that follow the user's saved-tensor hooks (see ``_offload_hooks``), and the
# ``saved_tensors_hooks.__enter__`` we installed while any does: (ours, previous was in the class's dict, previous).
_offloading: list[LiveTensorTracker] = []
_hooks_installed: list[tuple[Any, bool, Any]] = []


def _enter_wrapper(previous: Any) -> Any:
    def __enter__(self: Any) -> Any:
        """``saved_tensors_hooks.__enter__`` while a tracker models another device: the hooks pushed are the user's,
        wrapped so that what their pack places on the CPU is host memory (``_offload_hooks``); checkpointing's own
        hooks are pushed as they are."""
        if not _offloading or getattr(self.pack_hook, "__module__", "") == "torch.utils.checkpoint":
            return previous(self)
        pack, unpack = self.pack_hook, self.unpack_hook
        self.pack_hook, self.unpack_hook = _offload_hooks(pack, unpack)
        try:
            return previous(self)
        finally:
            self.pack_hook, self.unpack_hook = pack, unpack

    return __enter__


def _follow_offloads(tracker: LiveTensorTracker, on: bool) -> None:
    hooks = torch.autograd.graph.saved_tensors_hooks
    if on and tracker not in _offloading:
        if not _hooks_installed:
            own = "__enter__" in hooks.__dict__
            previous = hooks.__enter__
            wrapper = _enter_wrapper(previous)
            _hooks_installed.append((wrapper, own, previous))
            hooks.__enter__ = wrapper  # type: ignore[method-assign]
        _offloading.append(tracker)
    elif not on and tracker in _offloading:
        _offloading.remove(tracker)
        if not _offloading and _hooks_installed:
            wrapper, own, previous = _hooks_installed.pop()
            if hooks.__dict__.get("__enter__") is wrapper:
                if own:
                    hooks.__enter__ = previous  # type: ignore[method-assign]
                else:
                    del hooks.__enter__


def _offload_hooks(pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> tuple[Any, Any]:
    """A user's saved-tensor hooks, as a model of another device runs them (``save_on_cpu``, an offload of one's own).

    In a dry run for a GPU the fake tensors stand for CUDA ones but live on the CPU, where ``tensor.cpu()`` is the
    tensor itself: the offload would keep the device tensor alive. Inside the pack, what a call places on the CPU
    (``.cpu()``, ``.to("cpu")``, ``.pin_memory()``, a factory given ``pin_memory`` or ``device="cpu"``) is made a
    copy of its own, host memory (:meth:`LiveTensorTracker.is_offloaded`): in no figure of the device. The unpack's
    tensor, where it is such a copy, is copied back: the device memory backward allocates for it.
    """

    def offloading_pack(tensor: Any) -> Any:
        tracker = _offloading[-1] if _offloading else None
        if tracker is None:
            return pack(tensor)
        with _HostCopies(tracker):
            return pack(tensor)

    def offloading_unpack(packed: Any) -> Any:
        out = unpack(packed)
        tracker = _offloading[-1] if _offloading else None
        if (
            tracker is not None
            and isinstance(out, Tensor)
            and out.layout is _STRIDED
            and tracker.is_offloaded(out.untyped_storage())
        ):
            with torch.no_grad():
                out = out.clone()
        return out

    offloading_pack.__wrapped__ = pack  # type: ignore[attr-defined]
    offloading_unpack.__wrapped__ = unpack  # type: ignore[attr-defined]
    return offloading_pack, offloading_unpack


_HOST_METHODS = frozenset({Tensor.cpu, Tensor.pin_memory})
_FACTORIES = frozenset(
    {torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_like, torch.zeros_like, torch.ones_like}
)


def _names_cpu(value: Any) -> bool:
    return (isinstance(value, str) and value.split(":")[0] == "cpu") or (
        isinstance(value, torch.device) and value.type == "cpu"
    )


class _HostCopies(TorchFunctionMode):
    """Inside a pack hook of a model of another device: what a call places on the CPU is host memory."""

    def __init__(self, tracker: LiveTensorTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_METHODS or func is Tensor.to:
            if func is Tensor.to and not any(map(_names_cpu, (*args[1:], kwargs.get("device")))):
                return func(*args, **kwargs)
            with self.tracker.offloading():
                out = func(*args, **kwargs)
                if (
                    isinstance(out, Tensor)
                    and out.layout is _STRIDED
                    and not self.tracker.is_offloaded(out.untyped_storage())
                ):
                    with torch.no_grad():  # the CPU is the device modelled: ``.cpu()`` gave the tensor itself back
                        out = out.clone()
                return out
        if func in _FACTORIES and (kwargs.get("pin_memory") is not None or _names_cpu(kwargs.get("device"))):
            with self.tracker.offloading():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _Mode(TorchDispatchMode):
    """Registers what every operator returns; compiled code runs under it untraced, so Dynamo compiles as usual."""

    def __init__(self, tracker: LiveTensorTracker) -> None:
        super().__init__()
        self.tracker = tracker

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A mode that does not say this makes Dynamo skip (and remember skipping) every frame it
        # meets, which would silently turn the user's torch.compile off.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        kind = type(out)
        if kind in _HOLDS_NO_TENSOR:  # a query (the device a fake tensor reports, a size): nothing to count
            return out
        tracker = self.tracker
        if tracker._dead:  # storages freed since the last operator: off before this one's outputs are counted
            tracker._drain()
        try:
            if tracker.plain and tracker.error is None:
                # a real CPU run's operator: no rewrite, recorder, limit or allocator model; what is new is counted
                # here, in as few Python steps as possible, as this runs for every operator of a tracked step
                try:
                    if kind is Tensor:
                        if out.is_cpu and out.layout is _STRIDED:
                            tracker.seen(out.untyped_storage())
                        return out
                    if kind is tuple and all(map(_is_plain_tensor, out)):
                        for tensor in out:
                            if tensor.is_cpu and tensor.layout is _STRIDED:
                                tracker.seen(tensor.untyped_storage())
                        return out
                except Exception as error:  # the user's operator has run; a bookkeeping failure must not fail it
                    tracker.error = error
                    return out
            if tracker.recorder is not None and not tracker.unseen:
                tracker.recorder.begin_op(func)
            if tracker.rewrite is not None:
                out = tracker.rewrite(func, args, kwargs, out)
            if tracker.error is not None or tracker.unseen:
                return out
            before = tracker._current
            try:
                if tracker._hosting:  # inside a pack hook's move to the CPU, in a model of another device
                    for tensor in tensors_in(out):
                        tracker.host(tensor, offloaded=True)
                elif tracker.host_ops and func.__name__ in tracker.host_ops and isinstance(out, Tensor):
                    tracker.host(out)
                elif isinstance(out, Tensor):
                    tracker.add(out)
                elif isinstance(out, (tuple, list)) and all(isinstance(o, Tensor) for o in out):
                    for tensor in out:
                        tracker.add(tensor)
                else:
                    tracker.register(tensors_in(out))
            except Exception as error:  # the user's operator has run; a bookkeeping failure must not fail it
                tracker.error = error
                return out
            if tracker.limit_bytes is not None:
                tracker.check_limit(before)
            return out
        finally:
            if _pending:  # an interrupt kept by the bookkeeping: raised once the operator's outputs are counted
                raise_pending()


class LiveTensorTracker:
    """Follows every live storage on one device type; gives current bytes and window peaks.

    With ``limit_bytes`` it is a simulated small GPU: an operator that pushes live bytes past
    the limit raises ``torch.OutOfMemoryError("CUDA out of memory. ...")``, which Lightning's
    ``is_oom_error`` recognises, so OOM handling can be tested on a CPU.

    Args:
        device_type: the device type whose storages are counted (``"cpu"``, ``"meta"``, ...); ``None``
            counts every device.
        scan: on the first start, find the tensors that already exist with a ``gc`` scan.
        limit_bytes: the simulated device's size in bytes; ``None`` sets no limit.
        host_ops: names of operators whose outputs stand for host memory in a model of another device;
            their storages are never counted. Such a model also follows the user's saved-tensor hooks
            (``follow_offloads``): what their pack moves to the CPU (``save_on_cpu``) is host memory there.
        allocator: a model of a caching allocator (``malloc(key, nbytes) -> block bytes``, ``free(key)``)
            whose block sizes are counted instead of the tensors' own bytes; the difference is
            ``rounding_bytes``.
        count_fake: count fake and meta tensors as the memory they stand for (a prediction does; a real
            run never does).

    Attributes:
        current_bytes: the bytes of the storages alive now.
        peak_bytes: the highest ``current_bytes`` since the last start.
        rounding_bytes: what the allocator model adds above the tensors' own bytes.
        error: the first failure inside an operator; from then on the tracker only passes operators through.
        follow_offloads: while started, wrap the saved-tensor hooks entered (``saved_tensors_hooks.__enter__``)
            so that what a pack places on the CPU is a host copy of its own, in no figure (:meth:`is_offloaded`);
            ``bool(host_ops)`` by default, set before the first start.
        rewrite: ``None``, or ``rewrite(func, args, kwargs, out) -> out``, called on each operator's outputs that
            can hold tensors while the tracker runs, before they are counted and returned: what a dispatch mode
            entered just below the tracker would do (a dry run's corrections of the fake kernels), without the
            cost of a second mode on every operator.

    Raises:
        ValueError: if ``count_fake`` is not a bool.

    Example::

        with LiveTensorTracker() as tracker:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
        tracker.peak_bytes  # the true peak of the step, to the byte
    """

    def __init__(
        self,
        device_type: str | None = "cpu",
        *,
        scan: bool = True,
        limit_bytes: int | None = None,
        host_ops: frozenset[str] = frozenset(),
        allocator: Any = None,
        count_fake: bool = False,
    ) -> None:
        if not isinstance(count_fake, bool):
            raise ValueError(f"count_fake must be True or False, got {count_fake!r}")
        self.device_type = device_type
        # a prediction counts fake tensors as the memory they stand for; a real run never does
        self.count_fake = count_fake
        # a model of a caching allocator (``malloc(key, nbytes) -> block bytes``, ``free(key)``)
        self.allocator = allocator
        # operators whose outputs stand for host memory in a model of another device, never counted
        self.host_ops = host_ops
        self._host: dict[int, weakref.ref] = {}
        # of those host storages, the ones a saved-tensor hook moved off the device modelled (``save_on_cpu``)
        self._offloaded: dict[int, weakref.ref] = {}
        self._hosting = False
        # a model of another device (``host_ops``) follows the user's saved-tensor hooks: what they move to the CPU is
        # host memory there, in no figure (``is_offloaded``)
        self.follow_offloads = bool(host_ops)
        self.scan = scan
        self.limit_bytes = limit_bytes
        # what the allocator model adds above the tensors' own bytes (its blocks' rounding)
        self._rounding = 0
        self._armed = True
        self._current = 0
        self.peak_bytes = 0
        self._window_peak = 0
        # storage key -> (a weak reference to the storage, its counted bytes)
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        # storage key -> its weak reference, for the storages freed since the last ``_drain``: each weak reference's
        # callback is ``functools.partial(self._dead.__setitem__, key)``, C code that no Ctrl+C can interrupt
        self._dead: dict[int, weakref.ref] = {}
        self._note_dead = self._dead.__setitem__
        self._pad: dict[int, int] = {}
        self._mode: _Mode | None = None
        self._scanned = False
        # the first failure inside an operator: from then on the tracker only passes operators through
        self.error: Exception | None = None
        # tensors the first scan found alive whose storage could not be read, left out of the figures
        self.unreadable = 0
        # while True, operators are not counted: a dry run's own bookkeeping (a real tensor's fake copy)
        self.unseen = False
        # ``rewrite(func, args, kwargs, out) -> out``, called on the outputs of every operator that can hold tensors
        # before they are counted and returned, while the tracker runs (a dry run's corrections of fake kernels)
        self._rewrite: Callable[[Any, Any, Any, Any], Any] | None = None
        # a ``TimelineRecorder`` told of every allocation, free and operator, on the steps it records; else None
        self._recorder: Any = None
        self._plain()
        # the devices whose storages are counted, and those that are not, as operators have shown them
        self._counted_devices: set[torch.device] = set()
        self._other_devices: set[torch.device] = set()

    @property
    def current_bytes(self) -> int:
        """The bytes of the storages alive now."""
        if self._dead:
            self._drain()
        return self._current

    @property
    def rounding_bytes(self) -> int:
        """What the allocator model adds above the tensors' own bytes (its blocks' rounding)."""
        if self._dead:
            self._drain()
        return self._rounding

    @property
    def _live(self) -> dict[int, tuple[weakref.ref, int]]:
        """Every storage counted now: key -> (a weak reference to it, its counted bytes); the timeline reads it."""
        if self._dead:
            self._drain()
        return self._storages

    @property
    def rewrite(self) -> Callable[[Any, Any, Any, Any], Any] | None:
        """``None``, or ``rewrite(func, args, kwargs, out) -> out`` (see the class's attributes)."""
        return self._rewrite

    @rewrite.setter
    def rewrite(self, rewrite: Callable[[Any, Any, Any, Any], Any] | None) -> None:
        self._rewrite = rewrite
        self._plain()

    @property
    def recorder(self) -> Any:
        """The ``TimelineRecorder`` told of every allocation, free and operator, or None."""
        return self._recorder

    @recorder.setter
    def recorder(self, recorder: Any) -> None:
        self._recorder = recorder
        self._plain()

    def _plain(self) -> None:
        """Whether an operator's plain CPU tensors can be counted on the short path (``_Mode``): nothing else to do."""
        self.plain = (
            self.device_type == "cpu"
            and not self.count_fake
            and self._rewrite is None
            and self._recorder is None
            and self.limit_bytes is None
            and self.allocator is None
            and not self.host_ops
            and not self.follow_offloads
            and not self.unseen
        )

    def seen(self, storage: torch.UntypedStorage) -> None:
        """Count a storage an operator returned, if it is new or its size changed (the short path of ``_add_storage``).

        The operator's dispatch has taken off the storages freed before it (``_drain``).

        Args:
            storage: a CPU storage, on a tracker with no allocator model, host marks or recorder.
        """
        key = id(storage)
        known = self._storages.get(key)
        nbytes = storage.nbytes()
        if known is None:
            self._storages[key] = (weakref.ref(storage, functools.partial(self._note_dead, key)), nbytes)
        elif known[1] != nbytes:
            self._storages[key] = (known[0], nbytes)
            nbytes -= known[1]
        else:
            return
        self._grow(nbytes)

    def allocated(self, tensor: Tensor) -> None:
        """Count a buffer that compiled code allocated outside the dispatcher (inductor's ``empty_strided_cpu``).

        It is counted as an operator's output is, and a freed one leaves through its storage's weak reference, as
        every other does. A failure is kept in ``error``, as the allocation itself has happened.

        Args:
            tensor: the buffer, just allocated.

        Raises:
            torch.OutOfMemoryError: if it takes live bytes past ``limit_bytes``.
        """
        if self.error is not None or self.unseen:
            return
        before = self._current
        try:
            self.add(tensor)
        except Exception as error:
            self.error = error
            return
        if self.limit_bytes is not None:
            self.check_limit(before)

    @property
    def active(self) -> bool:
        """Whether the tracker follows new allocations now (started and not paused)."""
        return self._mode is not None

    def start(self, roots: Iterable[Tensor] = ()) -> None:
        """Begin following allocations; the first start also scans for tensors that already exist.

        Sizes of the storages already known are re-read, and the peak starts again at the current bytes.

        Args:
            roots: tensors that already exist and that a scan may not find (gradients held only by C++).
        """
        if self.scan and not self._scanned:
            self._scanned = True
            for tensor in _live_tensors(self.count_fake):
                try:
                    self.add(tensor)
                except (RuntimeError, NotImplementedError, ValueError):
                    # a tensor of someone else's whose storage cannot be read (a subclass without one, a layout
                    # that has none): it is left out and counted, rather than failing the whole measurement
                    self.unreadable += 1
        self.register(roots)
        for ref, _ in list(self._live.values()):
            storage = ref()
            if storage is not None:
                self._add_storage(storage)  # sizes may have changed while paused (storage resizes)
        self.peak_bytes = self._window_peak = self._current
        self._plain()
        if self._mode is None:
            self._mode = _Mode(self)
            self._mode.__enter__()
            _follow_resizes(self, True)
            if self.follow_offloads:
                _follow_offloads(self, True)

    def pause(self) -> None:
        """Stop seeing new allocations; frees of known storages are still followed."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _follow_resizes(self, False)
            _follow_offloads(self, False)
            _exit_mode(mode)

    def stop(self) -> None:
        """Stop and forget everything; a later start scans again."""
        self.pause()
        self._storages.clear()
        self._dead.clear()
        self._pad.clear()
        self._scanned = False
        self.unreadable = 0
        self.error = None
        self._current = self.peak_bytes = self._window_peak = self._rounding = 0

    def __enter__(self) -> LiveTensorTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()

    def read(self) -> tuple[int, int]:
        """Current bytes and the peak since the previous read (or start); opens a new window.

        Returns:
            ``(current_bytes, window_peak_bytes)``.
        """
        if self._dead:
            self._drain()
        peak, self._window_peak = self._window_peak, self._current
        return self._current, peak

    def register(self, tensors: Iterable[Tensor]) -> None:
        """Count the storages behind ``tensors`` that are not counted yet.

        Args:
            tensors: any tensors; each is counted as :meth:`add` counts it.
        """
        for tensor in tensors:
            self.add(tensor)

    def adopt(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Count storages found by other means that the dispatcher never showed (made in C++ or compiled code).

        Args:
            storages: the storages; those on other devices are skipped unless ``count_fake``.
        """
        for storage in storages:
            if self.device_type is None or storage.device.type == self.device_type or self.count_fake:
                self._add_storage(storage)

    def add(self, tensor: Tensor) -> None:
        """Count the storage behind one tensor (or the storages inside a wrapper subclass).

        Args:
            tensor: the tensor; one on another device is skipped, and so is a fake or meta tensor of a
                subclass (a ``FakeTensor``, a meta ``Parameter``) unless ``count_fake`` or the tracker
                follows the meta device itself.

        Raises:
            ValueError: if the tensor's layout cannot be counted (see ``storages_of``).
        """
        if self.device_type is not None:
            device = tensor.device
            if device not in self._counted_devices:
                if device in self._other_devices:
                    return
                counted = device.type == self.device_type
                (self._counted_devices if counted else self._other_devices).add(device)
                if not counted:
                    return
        kind = type(tensor)
        if kind is not Tensor and not self.count_fake and self.device_type != "meta" and _is_fake(tensor):
            return
        wrapper = _WRAPPERS.get(kind)
        if wrapper is None:
            wrapper = _WRAPPERS[kind] = is_traceable_wrapper_subclass(tensor)
        if not wrapper and tensor.layout is torch.strided:
            self._add_storage(tensor.untyped_storage())
        else:
            for storage in _storages(tensor):
                self._add_storage(storage)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Take a storage's new size: a resize to 0 frees its bytes, a resize back allocates them.

        A failure here is kept in ``error`` rather than raised, as the resize itself has happened.

        Args:
            storage: the storage that ``UntypedStorage.resize_`` just resized.
        """
        # a fake tensor's storage is on the meta device: a dry run counts it, as ``adopt`` does
        counted = storage.device.type == self.device_type or self.device_type is None or self.count_fake
        if self.error is None and counted:
            try:
                self._add_storage(storage)
            except Exception as error:
                self.error = error

    def transient(self, nbytes: int) -> None:
        """Count memory an operator allocates and frees again inside itself, which no tensor it returns shows.

        A backend's scratch buffer (gloo's copy of a reduce-scatter's input, say) reaches the peaks and the
        timeline, not the current bytes.

        Args:
            nbytes: the scratch buffer's bytes.
        """
        if self.error is not None or nbytes <= 0:
            return
        if self._dead:
            self._drain()
        self._grow(nbytes)
        self._current -= nbytes
        if self.recorder is not None:
            key = object()
            self.recorder.alloc(id(key), nbytes)
            self.recorder.free(id(key))

    def host(self, tensor: Tensor, offloaded: bool = False) -> None:
        """Mark the storage behind ``tensor`` as host memory: never counted, whatever op returns it later.

        Args:
            tensor: a strided tensor; the mark lasts as long as its storage lives.
            offloaded: whether a saved-tensor hook moved it there (``save_on_cpu``): :meth:`is_offloaded` too.
        """
        storage = tensor.untyped_storage()
        key = id(storage)
        # the callback is C code (``host.pop(key, ref)``), which no Ctrl+C can interrupt (see the module's docstring)
        for marks in (self._host, self._offloaded) if offloaded else (self._host,):
            marks[key] = weakref.ref(storage, functools.partial(marks.pop, key))

    def is_offloaded(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is host memory a saved-tensor hook moved off the device modelled (its pack's copy).

        Args:
            storage: a storage.

        Returns:
            True for a storage marked so that is still alive.
        """
        ref = self._offloaded.get(id(storage))
        return ref is not None and ref() is storage

    @contextlib.contextmanager
    def offloading(self) -> Iterator[None]:
        """While inside, every storage an operator returns is host memory moved off the device (a pack's copy)."""
        before, self._hosting = self._hosting, True
        try:
            yield
        finally:
            self._hosting = before

    def is_host(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` was marked host memory (:meth:`host`), and so is in no figure.

        Args:
            storage: a storage.

        Returns:
            True for a marked storage that is still alive.
        """
        ref = self._host.get(id(storage))
        return ref is not None and ref() is storage

    def _add_storage(self, storage: torch.UntypedStorage) -> None:
        if self._dead:
            self._drain()
        key = id(storage)
        if self._host and key in self._host and self._host[key]() is storage:
            return
        known = self._storages.get(key)
        nbytes = int(storage.nbytes())
        if known is not None and known[1] - self._pad.get(key, 0) == nbytes:
            return  # seen again as it was (a collective's output handed back): its block stays on its own stream
        if self.allocator is not None:
            if known is not None:
                self.allocator.free(key)
            exact, nbytes = nbytes, self.allocator.malloc(key, nbytes)
            self._rounding += (nbytes - exact) - (self._pad.get(key, 0) if known is not None else 0)
            self._pad[key] = nbytes - exact
        if known is None:
            self._storages[key] = (weakref.ref(storage, functools.partial(self._note_dead, key)), nbytes)
            self._grow(nbytes)
        elif known[1] != nbytes:
            self._storages[key] = (known[0], nbytes)
            self._grow(nbytes - known[1])
        else:
            return
        if self.recorder is not None:
            self.recorder.alloc(key, nbytes)

    def check_limit(self, before: int) -> None:
        """Raise a CUDA-style OOM when an operator took live bytes past ``limit_bytes``.

        After an OOM the limit rests until live bytes are back under it, as the failed step's
        tensors are released: the error handling that follows an OOM is not itself failed.

        Args:
            before: the live bytes before the operator ran.

        Raises:
            torch.OutOfMemoryError: if the operator took live bytes past ``limit_bytes`` (and above ``before``).
        """
        limit = self.limit_bytes
        if limit is None:
            return
        if not self._armed:
            self._armed = self._current <= limit
        elif self._current > max(limit, before):
            self._armed = False
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {self._current - before} bytes"
                f" (simulated device of {limit} bytes, {before} bytes in use)"
            )

    def _grow(self, nbytes: int) -> None:
        self._current += nbytes
        if self._current > self._window_peak:
            self._window_peak = self._current
            if self._current > self.peak_bytes:
                self.peak_bytes = self._current

    def settle(self) -> None:
        """Take off the storages freed since the last operator, now: what a reader of an allocator model's own figures
        (a simulated device's counters) calls first, since the tracker's figures do so themselves."""
        if self._dead:
            self._drain()

    def _drain(self) -> None:
        """Take off the storages freed since the last call, in the order they were freed.

        Each storage leaves the tracker's own figures before the allocator model and the recorder hear of it, and
        is forgotten as dead only after both did, so whatever one of them raises leaves the figures whole. An
        ``Exception`` there is kept in ``error`` (the figures go on, the failing part is what the caller checks), and
        any other ``BaseException`` (a ``KeyboardInterrupt`` landing in a recorder, say) is kept for
        :func:`raise_pending`: it is never raised mid-bookkeeping, and never swallowed.
        """
        dead, live = self._dead, self._storages
        while dead:  # a free the bookkeeping itself causes is noted meanwhile, and taken off in the next round
            for key, ref in list(dead.items()):
                entry = live.get(key)
                if entry is not None and entry[0] is ref:
                    del live[key]
                    self._current -= entry[1]
                    self._rounding -= self._pad.pop(key, 0)
                    try:
                        if self.allocator is not None:
                            self.allocator.free(key)
                        if self._recorder is not None:
                            self._recorder.free(key)
                    except Exception as error:
                        if self.error is None:
                            self.error = error
                    except BaseException as error:  # kept, and raised at the next safe point
                        _keep_pending(error)
                if dead.get(key) is ref:
                    del dead[key]
