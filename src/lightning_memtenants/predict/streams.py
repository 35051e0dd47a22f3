"""The stream of every allocation, followed by a dry run for a GPU, so the caching allocator's pools are per stream.

On a GPU the caching allocator keeps a pool per stream: a block freed by a tensor made on one stream is reused only
by allocations on that stream (after ``record_stream``, only once the other streams' events have completed). A dry
run runs on the CPU, where FSDP2 already switches streams: its device handle is ``torch.cpu``, whose ``Stream``
stubs and ``torch.cpu.stream(...)`` contexts keep ``torch.cpu.current_stream()`` up to date for its all-gather
copy-in and its reduce-scatter. The step's own ``torch.cuda`` streams, events and ``synchronize`` are routed to the
same stubs for the dry run only (:func:`cuda_streams_routed`), so :func:`current_stream` names the stream of every
allocation, and ``torch.cuda`` and ``torch.Tensor`` are as they were on leaving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memtenants._private import fsdp_comm_streams
from lightning_memtenants.core.storage import TWIN, storage_key
from lightning_memtenants.units import mib

# FSDP2's streams, named as a reader knows them, by the attribute of its communication context that holds each.
FSDP_STREAM_NAMES = {
    "all_gather_copy_in_stream": "FSDP all-gather copy-in",
    "all_gather_stream": "FSDP all-gather",
    "reduce_scatter_stream": "FSDP reduce-scatter",
    "all_reduce_stream": "FSDP all-reduce",
}
DEFAULT_STREAM = "default"


def current_stream() -> Hashable:
    """The stream the step runs on now, during a dry run: ``torch.cpu.current_stream()``.

    Returns:
        The stream object; the allocator model keys its pools by it.
    """
    return torch.cpu.current_stream()


@dataclass
class RoutedStreams:
    """What :func:`cuda_streams_routed` hands the dry run: the default stream, and what settles the frees.

    Args:
        default: the stream current on entering.
        settle: called before a synchronize reaches the allocator model, so that the frees the live-tensor tracker
            still holds back reach it first, as a real free does at once (the dry run sets it to its tracker's).
    """

    default: Hashable
    settle: Callable[[], None] = field(default=lambda: None)


@contextlib.contextmanager
def cuda_streams_routed(allocator: Any) -> Iterator[RoutedStreams]:
    """``torch.cuda``'s streams and events, and ``Tensor.record_stream``, on the CPU's stubs for a dry run.

    A step that writes ``with torch.cuda.stream(torch.cuda.Stream()):`` runs under a dry run for a GPU, and its
    allocations inside the block are on that stream. ``torch.cuda.synchronize()``, ``Stream.synchronize()`` and
    ``Event.synchronize()`` complete the allocator model's events (its deferred frees); ``record_stream`` tells it
    of a block used on another stream. The CPU's ``Stream`` stub (the default stream, FSDP2's) gains the
    ``synchronize`` and ``query`` it lacks for the same time; its ``record_event`` stays the stub's (FSDP2 runs as it
    does on the CPU), so only a stream the step made returns an event from it. On leaving, every attribute is the
    original again and the current stream is the one found on entering, whatever the block did or raised.

    Args:
        allocator: the allocator model (``synchronize(stream=None)``, ``record_stream(key, stream)``).

    Yields:
        The default stream (the one current on entering) and the settle hook.
    """
    default = torch.cpu.current_stream()
    routes = RoutedStreams(default)

    def synchronize(stream: Any = None) -> None:
        routes.settle()
        allocator.synchronize(stream)

    class Stream(torch.cpu.Stream):  # type: ignore[misc]
        """``torch.cuda.Stream`` in a dry run: a CPU stub that the allocator model keys a pool by."""

        def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
            super().__init__(priority)
            self.priority = priority

        def record_event(self, event: Any = None) -> Any:
            event = Event() if event is None else event
            event.record(self)
            return event

    class Event(torch.cpu.Event):  # type: ignore[misc]
        """``torch.cuda.Event`` in a dry run: it remembers the stream it was recorded on."""

        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
            self.stream: Any = None

        def record(self, stream: Any = None) -> None:
            self.stream = torch.cpu.current_stream() if stream is None else stream

        def synchronize(self) -> None:
            synchronize(self.stream)

        def elapsed_time(self, end_event: Any) -> float:
            return 0.0

    def query(stream: Any) -> bool:
        return True

    def set_stream(stream: Any) -> None:
        torch.cpu.StreamContext(stream).__enter__()  # the stub's context sets the current stream and keeps it

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        counted = getattr(tensor, TWIN, tensor)  # a known tensor computed for real is counted as its fake twin
        allocator.record_stream(storage_key(counted), stream)

    routed = {
        "Stream": Stream,
        "Event": Event,
        "StreamContext": torch.cpu.StreamContext,
        "stream": torch.cpu.stream,
        "current_stream": lambda device=None: torch.cpu.current_stream(),
        "default_stream": lambda device=None: default,
        "set_stream": set_stream,
        "synchronize": lambda device=None: synchronize(),
    }
    stub = {"synchronize": synchronize, "query": query}
    patched = [(torch.cuda, name, value) for name, value in routed.items()]
    patched += [(torch.cpu.Stream, name, value) for name, value in stub.items()]
    patched.append((torch.Tensor, "record_stream", record_stream))
    missing = object()
    # read from the owner's own dict, so that an inherited attribute is deleted again on leaving, not copied down
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name, _ in patched]
    try:
        for owner, name, value in patched:
            setattr(owner, name, value)
        yield routes
    finally:
        for owner, name, value in saved:
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        if torch.cpu.current_stream() is not default:
            set_stream(default)


def stream_names(model: nn.Module, default: Hashable, streams: list[Hashable]) -> dict[Hashable, str]:
    """A name for each stream: ``default``, FSDP2's by their role, and the step's own in order of first use.

    Args:
        model: the model the step ran (FSDP2's streams are found in its communication context).
        default: the default stream.
        streams: the streams to name, in the order the allocator model first used them.

    Returns:
        Each stream's name; ``None`` (an allocator model of one pool) is the default stream.
    """
    names: dict[Hashable, str] = {default: DEFAULT_STREAM, None: DEFAULT_STREAM}
    for attribute, stream in fsdp_comm_streams(model).items():
        names.setdefault(stream, FSDP_STREAM_NAMES[attribute])
    side = 0
    for stream in streams:
        if stream not in names:
            side += 1
            names[stream] = f"side stream {side}"
    return names


def reserved_by_stream_bytes(allocator: Any, model: nn.Module, default: Hashable) -> dict[str, int]:
    """The allocator model's reserved bytes by stream, each stream named (:func:`stream_names`).

    Args:
        allocator: the allocator model after the step (``reserved_by_stream()``).
        model: the model the step ran.
        default: the default stream.

    Returns:
        Bytes per stream name, the default stream first, then in the order the allocator model lists them.
    """
    by_stream = allocator.reserved_by_stream()
    names = stream_names(model, default, list(by_stream))
    out: dict[str, int] = {}
    for stream, nbytes in sorted(by_stream.items(), key=lambda item: names[item[0]] != DEFAULT_STREAM):
        out[names[stream]] = out.get(names[stream], 0) + int(nbytes)
    return out


def streams_note(reserved: dict[str, int]) -> str:
    """The notes' sentence on the streams the step allocated on and what each one's pool reserved.

    Args:
        reserved: bytes per stream name (:func:`reserved_by_stream_bytes`).

    Returns:
        For example ``"streams: default 42.00 MiB, FSDP all-gather copy-in 20.00 MiB reserved at the step's end;
        the caching allocator keeps a pool per stream"``.
    """
    pools = ", ".join(f"{name} {mib(nbytes)} MiB" for name, nbytes in reserved.items())
    return (
        f"streams: {pools} reserved at the step's end; the caching allocator keeps a pool per stream, and a block"
        " freed on one is not reused by another"
    )
