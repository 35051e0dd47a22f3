"""A model of PyTorch's CUDA caching allocator, so that a prediction has ``memory_reserved`` beside what tensors take.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/core/AllocatorConfig.cpp`` (PyTorch 2.13),
restated in the docstrings below. In short:

- every request is rounded up to 512 bytes (or to a power-of-two division, with ``roundup_power2_divisions``);
  up to 1 MiB it is served from the small pool, above that from the large pool;
- a free block belongs to the stream it was allocated on and to its pool, and only a request on that stream and
  pool reuses it, the smallest block that fits first ("best fit"), split when the rest is worth keeping;
- when no free block fits, a new segment is reserved: 2 MiB for a small request, 20 MiB for a request under
  10 MiB, else the request rounded up to 2 MiB; with ``expandable_segments`` the stream's one segment per pool
  grows instead, by pages of 2 MiB (small pool) or 20 MiB (large pool);
- a block used on another stream (``Tensor.record_stream``) is not reused after its free until that stream has
  finished with it: here, until :meth:`CachingAllocatorModel.synchronize` says so;
- nothing is given back to the device except by ``empty_cache`` and by ``garbage_collection_threshold``'s
  collection.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from itertools import count

BLOCK_BYTES = 512
MiB = 1 << 20
# roundup_power2_divisions has one entry per power-of-two interval from 1 MiB (everything below 2 MiB) to 32 GiB
# (everything from 32 GiB up): c10's kRoundUpPowerOfTwoIntervals
_INTERVALS = 16
_BACKENDS = ("native", "cudaMallocAsync")
# keys torch accepts whose values change nothing this model counts (host-memory and locking options)
_IGNORED_BOOL_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_use_background_threads",
        "graph_capture_record_stream_reuse",
    }
)
_IGNORED_NUMBER_KEYS = frozenset(
    {
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
    }
)
_MODELLED_KEYS = (
    "expandable_segments",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "large_segment_size_mb",
    "per_process_memory_fraction",
    "backend",
)
_ACCEPTED = (
    "comma-separated key:value pairs as in PYTORCH_CUDA_ALLOC_CONF, with the keys "
    f"{', '.join(k for k in _MODELLED_KEYS if k != 'backend')}, backend:native, and torch's host-memory and locking"
    " keys (pinned_*, release_lock_on_cudamalloc, graph_capture_record_stream_reuse: accepted, no effect here)"
)


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class AllocatorSettings:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings that change what the caching allocator reserves.

    Build them with :meth:`parse` or :meth:`from_environ`, which check them as torch does; the defaults are
    torch's.

    Args:
        expandable_segments: one segment per stream and pool that grows by mapping pages, instead of a segment
            per ``cudaMalloc``.
        max_split_size_mb: blocks of this size or more are never split, and a request below it never takes one;
            ``None`` for unlimited, torch's default. torch requires at least 20.
        roundup_power2_divisions: request sizes are rounded up to one of this many equal steps between two powers
            of two (1,200 MiB with 4 divisions: to 1,280 MiB). One number for every size, or the per-size table
            ``((1, d), (2, d), (4, d), ..., (32768, d))``: interval lower bounds in MiB and their divisions, as
            :meth:`parse` writes ``[256:1,512:2,>:4]``. ``None`` (or 0 and 1) for 512-byte rounding only.
        garbage_collection_threshold: with a memory fraction below 1, the share of the allowed memory above which
            cached whole-segment blocks are released (oldest first) before more is reserved; 0 < t < 1.
        max_non_split_rounding_mb: how much larger than a request at or above ``max_split_size_mb`` a cached block
            may be and still serve it; ``None`` for torch's 20 MiB.
        large_segment_size_mb: the segment for a 1 to 10 MiB request (and the page of expandable segments' large
            pool); ``None`` for torch's 20 MiB.
        per_process_memory_fraction: the share of the device the process may use
            (``torch.cuda.set_per_process_memory_fraction``); only ``garbage_collection_threshold`` reads it here.
    """

    expandable_segments: bool = False
    max_split_size_mb: int | None = None
    roundup_power2_divisions: int | tuple[tuple[int, int], ...] | None = None
    garbage_collection_threshold: float | None = None
    max_non_split_rounding_mb: int | None = None
    large_segment_size_mb: int | None = None
    per_process_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        checks = {
            "expandable_segments": isinstance(self.expandable_segments, bool),
            "max_split_size_mb": self.max_split_size_mb is None
            or (_whole(self.max_split_size_mb) and self.max_split_size_mb >= 20),
            "max_non_split_rounding_mb": self.max_non_split_rounding_mb is None
            or (_whole(self.max_non_split_rounding_mb) and self.max_non_split_rounding_mb >= 20),
            "large_segment_size_mb": self.large_segment_size_mb is None
            or (_whole(self.large_segment_size_mb) and self.large_segment_size_mb > 0),
            "garbage_collection_threshold": self.garbage_collection_threshold is None
            or (_real(self.garbage_collection_threshold) and 0 < self.garbage_collection_threshold < 1),
            "per_process_memory_fraction": self.per_process_memory_fraction is None
            or (_real(self.per_process_memory_fraction) and 0 <= self.per_process_memory_fraction <= 1),
            "roundup_power2_divisions": _divisions_ok(self.roundup_power2_divisions),
        }
        wants = {
            "expandable_segments": "True or False",
            "max_split_size_mb": "None or a whole number of MiB, at least 20",
            "max_non_split_rounding_mb": "None or a whole number of MiB, at least 20",
            "large_segment_size_mb": "None or a positive whole number of MiB",
            "garbage_collection_threshold": "None or a number strictly between 0 and 1",
            "per_process_memory_fraction": "None or a number from 0 to 1",
            "roundup_power2_divisions": "None, a power of two, or ((interval_mb, divisions), ...) with power-of-two"
            " intervals and divisions a power of two or 0",
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"AllocatorSettings.{key} must be {wants[key]}, got {getattr(self, key)!r}")
        if isinstance(self.roundup_power2_divisions, tuple):  # one spelling per table, so equal settings compare equal
            table = _division_table(self.roundup_power2_divisions)
            full = table[0] if len(set(table)) == 1 else tuple((1 << i, d) for i, d in enumerate(table))
            object.__setattr__(self, "roundup_power2_divisions", full)

    @classmethod
    def parse(cls, text: str, name: str = "allocator") -> AllocatorSettings:
        """Settings from ``PYTORCH_CUDA_ALLOC_CONF``'s syntax, ``"key:value,key:value"``, checked as torch does.

        Whitespace is ignored and a later key overrides an earlier one, as in c10's ``ConfigTokenizer``.
        ``roundup_power2_divisions`` takes one power of two or a list ``[256:1,512:2,>:4]`` (interval in MiB:
        divisions; the first entry also covers the smaller sizes, ``>`` every interval after the last one named).

        Args:
            text: the configuration string; empty for the defaults.
            name: the argument ``text`` came from, for the error message.

        Returns:
            The settings.

        Raises:
            ValueError: naming ``name`` and what it accepts, for a malformed string, a key torch does not know, a
                value torch refuses, or ``backend:cudaMallocAsync`` (a different allocator, not modelled).
        """
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string of {_ACCEPTED}, got {text!r}")
        tokens = _tokenize(text)
        fields = {f for f in cls.__dataclass_fields__}
        values: dict[str, object] = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key in ":,[]" or i + 2 >= len(tokens) or tokens[i + 1] != ":" or tokens[i + 2] in ":,]":
                raise ValueError(f"{name}: expected 'key:value' at {key!r}; {name} must be {_ACCEPTED}, got {text!r}")
            i += 2
            if tokens[i] == "[":
                if "]" not in tokens[i:]:
                    raise ValueError(
                        f"{name}: {key}'s list has no closing ']'; {name} must be {_ACCEPTED}, got {text!r}"
                    )
                end = tokens.index("]", i)
                value: object = tokens[i + 1 : end]
                i = end
            else:
                value = tokens[i]
            parsed = _value(key, value, name, text)
            if key in fields:
                values[key] = parsed
            i += 1
            if i < len(tokens):
                if tokens[i] != ",":
                    raise ValueError(
                        f"{name}: expected ',' after {key}'s value; {name} must be {_ACCEPTED}, got {text!r}"
                    )
                i += 1
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> AllocatorSettings:
        """Settings from the environment, read as torch reads it.

        c10 (``AcceleratorAllocatorConfig::instance``) takes the first of ``PYTORCH_ALLOC_CONF``,
        ``PYTORCH_CUDA_ALLOC_CONF`` (deprecated, still read) and ``PYTORCH_HIP_ALLOC_CONF`` that is set, and
        ignores the others, even when the first is empty.

        Args:
            environ: the environment; ``None`` for ``os.environ``.

        Returns:
            The settings (torch's defaults when none of the variables is set).

        Raises:
            ValueError: naming the variable, if the one read is malformed.
        """
        environ = os.environ if environ is None else environ
        for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
            if variable in environ:
                return cls.parse(environ[variable], variable)
        return cls()

    def conf(self) -> str:
        """These settings in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax, only those that differ from torch's defaults.

        Returns:
            The string, empty for the defaults; :meth:`parse` reads it back to equal settings.
        """
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        for key in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb"):
            if getattr(self, key) is not None:
                parts.append(f"{key}:{getattr(self, key)}")
        divisions = self.roundup_power2_divisions
        if isinstance(divisions, int):
            parts.append(f"roundup_power2_divisions:{divisions}")
        elif divisions is not None:
            parts.append(f"roundup_power2_divisions:{_divisions_conf(_division_table(divisions))}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction:g}")
        return ",".join(parts)

    def describe(self) -> str:
        """One sentence for the report's notes: the allocator settings the prediction assumed.

        Returns:
            ``"the caching allocator's defaults"``, or the settings in ``PYTORCH_CUDA_ALLOC_CONF``'s syntax, with a
            word when ``garbage_collection_threshold`` has no effect (torch collects only under a memory fraction
            below 1).
        """
        conf = self.conf()
        if not conf:
            return "the caching allocator's defaults"
        sentence = f"the caching allocator with {conf}"
        if self.garbage_collection_threshold is not None and not self.gc_active:
            sentence += (
                " (garbage_collection_threshold has no effect without a per-process memory fraction below 1,"
                " as in torch)"
            )
        return sentence

    @property
    def gc_active(self) -> bool:
        """Whether ``garbage_collection_threshold`` can release anything: torch also needs a memory fraction < 1."""
        fraction = self.per_process_memory_fraction
        return self.garbage_collection_threshold is not None and fraction is not None and fraction < 1

    def divisions(self, size: int) -> int:
        """The ``roundup_power2_divisions`` that apply to a request of ``size`` bytes (0 for none).

        Args:
            size: the request, in bytes.

        Returns:
            The divisions of the power-of-two interval ``size`` lies in.
        """
        table = _division_table(self.roundup_power2_divisions)  # cached: sixteen entries per settings
        index = min(max(size.bit_length() - 1 - 20, 0), _INTERVALS - 1)
        return table[index]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _divisions_ok(value: object) -> bool:
    if value is None:
        return True
    if _whole(value):
        return value == 0 or _is_power_of_two(value)  # type: ignore[arg-type]
    if not isinstance(value, tuple) or not value:
        return False
    return all(
        isinstance(pair, tuple)
        and len(pair) == 2
        and _whole(pair[0])
        and _is_power_of_two(pair[0])
        and _whole(pair[1])
        and (pair[1] == 0 or _is_power_of_two(pair[1]))
        for pair in value
    )


@functools.lru_cache(maxsize=64)
def _division_table(value: int | tuple[tuple[int, int], ...] | None) -> tuple[int, ...]:
    if value is None:
        return (0,) * _INTERVALS
    if isinstance(value, int):
        return (value,) * _INTERVALS
    table = [0] * _INTERVALS
    for n, (interval_mb, divisions) in enumerate(value):
        index = min(interval_mb.bit_length() - 1, _INTERVALS - 1)
        if n == 0:
            table[:index] = [divisions] * index
        table[index] = divisions
    return tuple(table)


def _divisions_conf(table: tuple[int, ...]) -> str:
    """The shortest list torch reads back to ``table``: the first run, each value after it, ``>`` for the last run."""
    if len(set(table)) == 1:
        return str(table[0])
    first = 0
    while table[first + 1] == table[0]:
        first += 1
    last = _INTERVALS - 1
    while table[last - 1] == table[-1]:
        last -= 1
    entries = [f"{1 << first}:{table[0]}"]
    entries += [f"{1 << i}:{table[i]}" for i in range(first + 1, last)]
    entries.append(f">:{table[-1]}" if last > first + 1 and last < _INTERVALS - 1 else f"{1 << last}:{table[-1]}")
    if last == first + 1 and last < _INTERVALS - 1:
        entries[-1] = f">:{table[-1]}"
    return f"[{','.join(entries)}]"


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    buffer = ""
    for ch in text:
        if ch in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(ch)
        elif not ch.isspace():
            buffer += ch
    if buffer:
        tokens.append(buffer)
    return tokens


def _value(key: str, value: object, name: str, text: str) -> object:
    """One key's value, checked as c10 checks it (``parseArgs`` and the ``parse*`` functions)."""

    def bad(wants: str) -> ValueError:
        shown = f"[{''.join(value)}]" if isinstance(value, list) else value
        return ValueError(f"{name}: {key} must be {wants}, got {shown!r} in {text!r}")

    if key == "roundup_power2_divisions":
        return _parse_divisions(value, bad)
    if isinstance(value, list):
        raise bad("a single value, not a list")
    assert isinstance(value, str)
    if key == "expandable_segments" or key in _IGNORED_BOOL_KEYS:
        if value not in ("True", "False"):
            raise bad("True or False (as torch spells them)")
        return value == "True" if key == "expandable_segments" else None
    if key in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb") or key in (
        _IGNORED_NUMBER_KEYS
    ):
        if not value.isdigit():
            raise bad("a whole number")
        number = int(value)
        if key in ("max_split_size_mb", "max_non_split_rounding_mb") and number < 20:
            raise bad("at least 20 (MiB; torch's kLargeBuffer)")
        if key == "large_segment_size_mb" and number < 1:
            raise bad("a positive whole number of MiB")
        return number if key not in _IGNORED_NUMBER_KEYS else None
    if key in ("garbage_collection_threshold", "per_process_memory_fraction"):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if key == "garbage_collection_threshold" and not 0 < number < 1:
            raise bad("a number strictly between 0 and 1")
        if key == "per_process_memory_fraction" and not 0 <= number <= 1:
            raise bad("a number from 0 to 1")
        return number
    if key == "backend":
        if value == "cudaMallocAsync":
            raise ValueError(
                f"{name}: backend:cudaMallocAsync is CUDA's own stream-ordered allocator, which is not modelled;"
                f" {name} must use backend:native (the caching allocator), got {text!r}"
            )
        if value not in _BACKENDS:
            raise bad(f"one of {list(_BACKENDS)}")
        return None
    raise ValueError(f"{name}: unknown key {key!r} (torch refuses it too); {name} must be {_ACCEPTED}, got {text!r}")


def _parse_divisions(value: object, bad: Callable[[str], ValueError]) -> int | tuple[tuple[int, int], ...]:
    wants = "a power of two, or a list like [256:1,512:2,>:4] of power-of-two MiB intervals (or '>') and divisions"
    if isinstance(value, str):
        if not value.isdigit() or not _is_power_of_two(int(value)):
            raise bad(wants)
        return int(value)
    assert isinstance(value, list)
    table = [0] * _INTERVALS
    entries = [t for t in value if t != ","]
    if len(entries) % 3 or not entries or any(entries[k + 1] != ":" for k in range(0, len(entries), 3)):
        raise bad(wants)
    last_index, first = 0, True
    for k in range(0, len(entries), 3):
        interval, divisions = entries[k], entries[k + 2]
        if not divisions.isdigit() or not (int(divisions) == 0 or _is_power_of_two(int(divisions))):
            raise bad(wants + " (divisions a power of two or 0)")
        if interval == ">":
            table[last_index + 1 :] = [int(divisions)] * (_INTERVALS - last_index - 1)
            continue
        if not interval.isdigit() or not _is_power_of_two(int(interval)):
            raise bad(wants + " (intervals a power of two)")
        index = min(int(interval).bit_length() - 1, _INTERVALS - 1)
        if first:
            table[:index] = [int(divisions)] * index
            first = False
        table[index] = int(divisions)
        last_index = index
    return tuple((1 << i, d) for i, d in enumerate(table))  # __post_init__ makes a uniform table one number


def round_block(nbytes: int) -> int:
    """The CUDA caching allocator's block size for a request: at least 512 bytes, in 512-byte steps.

    Args:
        nbytes: the bytes a tensor's storage asks for.

    Returns:
        The bytes the block takes, which is what ``memory_allocated`` counts.
    """
    return BLOCK_BYTES if nbytes < BLOCK_BYTES else -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def round_size(nbytes: int, settings: AllocatorSettings | None = None) -> int:
    """The caching allocator's block size for a request, under ``roundup_power2_divisions`` too (``round_size``).

    With ``d`` divisions for the request's interval (``d > 1``) and a request above ``512 x d`` bytes, the size is
    rounded up to the next of ``d`` equal steps between the powers of two around it
    (``roundup_power2_next_division``); otherwise to 512 bytes, as :func:`round_block`.

    Args:
        nbytes: the bytes a tensor's storage asks for.
        settings: the allocator's settings; ``None`` for torch's defaults.

    Returns:
        The bytes the block takes.
    """
    if nbytes < BLOCK_BYTES:
        return BLOCK_BYTES
    divisions = settings.divisions(nbytes) if settings is not None else 0
    if divisions > 1 and nbytes > BLOCK_BYTES * divisions:
        if _is_power_of_two(nbytes):
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        return -(-nbytes // step) * step
    return round_block(nbytes)


class _Segment:
    """One ``cudaMalloc`` (or, expandable, one growing virtual range), to sum reserved bytes by."""

    __slots__ = ("base", "expandable", "head", "mapped_bytes", "page_bytes", "size", "small", "stream")

    def __init__(self, base: int, size: int, stream: Hashable, small: bool, page_bytes: int = 0) -> None:
        self.base = base
        self.size = size
        self.stream = stream
        self.small = small
        self.expandable = page_bytes > 0
        self.page_bytes = page_bytes
        self.mapped_bytes = 0 if self.expandable else size
        self.head: _Block | None = None  # the first block of an expandable segment

    @property
    def reserved(self) -> int:
        return self.mapped_bytes


class _Block:
    __slots__ = ("addr", "free", "gc_base", "mapped", "next", "pending", "prev", "segment", "size", "small", "uses")

    def __init__(self, size: int, small: bool, segment: _Segment | None = None, addr: int = 0) -> None:
        self.size = size
        self.small = small
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment
        self.addr = addr
        self.mapped = True
        self.uses: set[Hashable] = set()  # streams recorded by record_stream while allocated
        self.pending: set[Hashable] = set()  # streams whose events the free still waits for
        self.gc_base = 0

    @property
    def stream(self) -> Hashable:
        return None if self.segment is None else self.segment.stream

    @property
    def split(self) -> bool:
        return self.prev is not None or self.next is not None


class CachingAllocatorModel:
    """The CUDA caching allocator's pools, blocks and segments, so that a prediction has ``memory_reserved`` too.

    A GPU's allocator keeps freed blocks for reuse, so what a process reserves outgrows what its tensors take; the
    fake run replays every allocation and free through this model to say by how much. Each rule below is PyTorch's
    (``c10/cuda/CUDACachingAllocator.cpp``, 2.13):

    - **Sizes.** A request is rounded up to 512 bytes, or per ``roundup_power2_divisions`` (:func:`round_size`).
      Up to 1 MiB it belongs to the small pool, above to the large pool.
    - **Pools per stream.** A block belongs to the stream that was current when it was allocated (``stream()``).
      A request takes the smallest free block of its own stream and pool that fits (lowest address among equals);
      a block freed on stream A is never reused by stream B, which reserves anew.
    - **Splitting.** The block is split when the rest is worth keeping: 512 bytes in the small pool (and with
      expandable segments), more than 1 MiB in the large pool and only for a request below ``max_split_size_mb``;
      an unsplit block counts whole in ``allocated_bytes``, as CUDA's own counter does. Freed blocks merge with
      free neighbours.
    - **max_split_size_mb.** A request below it never takes a cached block of that size or more ("oversize"
      blocks, never split); a request at or above it takes a cached block only if that block is less than
      ``max_non_split_rounding_mb`` (20 MiB, torch's kLargeBuffer) larger. When a real ``cudaMalloc`` fails, torch
      first frees oversize cached blocks and then every unsplit cached block and retries; the model has no device
      limit, so that never happens here.
    - **New segments.** 2 MiB for a small request, ``large_segment_size_mb`` (20 MiB) for a request under 10 MiB,
      else the request rounded up to 2 MiB.
    - **expandable_segments.** One segment per stream and pool whose virtual range is mapped in pages as needed:
      2 MiB pages in the small pool, ``large_segment_size_mb`` (20 MiB) pages in the large pool. A request that
      finds no free block maps pages after the lowest free block that touches unmapped space (so a free block at
      the end of the segment grows); reserved grows by whole pages and shrinks only through :meth:`empty_cache`,
      which unmaps the pages that hold no used byte.
    - **record_stream.** A block used on another stream is not reused after its free until that stream's work
      recorded before the free is done. The model completes those events only at :meth:`synchronize` (torch polls
      them at every malloc: on a GPU they may complete sooner, so the model's reserved bytes are an upper bound).
      ``allocated_bytes`` drops at the free itself, as CUDA's counter does.
    - **garbage_collection_threshold.** With a per-process memory fraction below 1 (torch collects only then), a
      request that finds no free block first checks whether reserved bytes exceed threshold x fraction x
      ``device_bytes``; if so it releases unsplit cached blocks of the large pool whose age (requests on that pool
      since they were freed) is at least the average, oldest first, until the excess is released. Reserved bytes
      can fall, so :attr:`reserved_peak_bytes` keeps the high-water mark.

    Args:
        settings: the allocator's settings (:class:`AllocatorSettings`); ``None`` for torch's defaults.
        stream: returns the current stream's identity, read at each malloc; ``None`` for one default stream.
        device_bytes: the GPU's memory, which ``garbage_collection_threshold`` is a fraction of; ``None`` for a
            threshold never reached.

    Attributes:
        reserved_bytes: the segments' bytes (mapped bytes of expandable segments), ``memory_reserved``.
        allocated_bytes: the taken blocks' bytes, ``memory_allocated``.
        segments: how many segments are reserved (an expandable segment counts once while it has mapped pages).
        reserved_peak_bytes: the high-water mark of ``reserved_bytes`` since construction or :meth:`reset_peak`.
        allocated_peak_bytes: the same for ``allocated_bytes``.
    """

    SMALL_SIZE = 1 << 20
    SMALL_BUFFER = 2 << 20
    LARGE_BUFFER = 20 << 20
    MIN_LARGE_ALLOC = 10 << 20
    ROUND_LARGE = 2 << 20
    _VIRTUAL_BYTES = 1 << 50  # an expandable segment's address range: far beyond any GPU's memory

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        *,
        stream: Callable[[], Hashable] | None = None,
        device_bytes: int | None = None,
    ) -> None:
        if settings is not None and not isinstance(settings, AllocatorSettings):
            raise ValueError(f"settings must be an AllocatorSettings or None, got {settings!r}")
        if device_bytes is not None and (not _whole(device_bytes) or device_bytes <= 0):
            raise ValueError(f"device_bytes must be a positive whole number of bytes or None, got {device_bytes!r}")
        self.settings = AllocatorSettings() if settings is None else settings
        self._stream = stream
        self.device_bytes = device_bytes
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.segments = 0
        self.reserved_peak_bytes = 0
        self.allocated_peak_bytes = 0
        s = self.settings
        self._max_split = MiB * s.max_split_size_mb if s.max_split_size_mb is not None else math.inf
        self._non_split_rounding = MiB * (20 if s.max_non_split_rounding_mb is None else s.max_non_split_rounding_mb)
        self._large_segment = MiB * (20 if s.large_segment_size_mb is None else s.large_segment_size_mb)
        self._free: dict[tuple[Hashable, bool], list[_Block]] = {}  # (stream, small) -> free mapped blocks
        self._taken: dict[int, _Block] = {}
        self._deferred: list[_Block] = []  # freed, waiting for other streams' events
        self._live: list[_Segment] = []
        self._expandable: dict[tuple[Hashable, bool], _Segment] = {}
        self._requests = {True: 0, False: 0}  # get_free_block calls per pool (small?), torch's gc clock
        self._bases = count(1)

    # -- the public calls ------------------------------------------------------------------------------------

    def reset_peak(self) -> None:
        """Set both peaks to the current figures, as ``torch.cuda.reset_peak_memory_stats`` does."""
        self.reserved_peak_bytes = self.reserved_bytes
        self.allocated_peak_bytes = self.allocated_bytes

    def malloc(self, key: int, nbytes: int) -> int:
        """Allocate a block for the storage ``key`` on the current stream, reusing a free one where one fits.

        Args:
            key: the storage's identity, to free it by.
            nbytes: the bytes asked for.

        Returns:
            The block's size, which is what ``memory_allocated`` counts.
        """
        stream = self._stream() if self._stream is not None else None
        size = round_size(nbytes, self.settings)
        small = size <= self.SMALL_SIZE
        block = self._get_free_block(stream, small, size)
        if block is None:
            if self.settings.gc_active and self.device_bytes is not None:
                self._garbage_collect()
            if self.settings.expandable_segments:
                block = self._expand(stream, small, size)
            else:
                block = self._new_segment(stream, small, self._allocation_size(size))
        if self._should_split(block, size):
            remainder = _Block(block.size - size, small, block.segment, block.addr + size)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            self._insert(remainder)
        block.free = False
        self._taken[key] = block
        self.allocated_bytes += block.size
        self.allocated_peak_bytes = max(self.allocated_peak_bytes, self.allocated_bytes)
        return block.size

    def free(self, key: int) -> None:
        """Give back the block of ``key`` (nothing if it has none): to its pool, or after other streams' events.

        Args:
            key: the storage's identity, as given to :meth:`malloc`.
        """
        block = self._taken.pop(key, None)
        if block is None:
            return
        self.allocated_bytes -= block.size
        if block.uses:
            block.pending, block.uses = block.uses, set()
            self._deferred.append(block)
        else:
            self._free_block(block)

    def record_stream(self, key: int, stream: Hashable) -> None:
        """Mark the block of ``key`` as used on ``stream`` too (``Tensor.record_stream``).

        Its free will then wait for ``stream``'s work up to the free; a use on the block's own stream needs no
        event and is ignored, as torch ignores it.

        Args:
            key: the storage's identity, as given to :meth:`malloc` (nothing happens if it has no block).
            stream: the stream that uses it.
        """
        block = self._taken.get(key)
        if block is not None and stream != block.stream:
            block.uses.add(stream)

    def synchronize(self, stream: Hashable | None = None) -> None:
        """Complete the events recorded on ``stream`` (every stream if ``None``): the frees waiting for them happen.

        Args:
            stream: the stream whose work is done, or ``None`` for the whole device (``torch.cuda.synchronize``).
        """
        waiting = []
        for block in self._deferred:
            if stream is None:
                block.pending.clear()
            else:
                block.pending.discard(stream)
            if block.pending:
                waiting.append(block)
            else:
                self._free_block(block)
        self._deferred = waiting

    def reserved_by_stream(self) -> dict[Hashable, int]:
        """The reserved bytes per stream that owns the segments (the pools' owners).

        Returns:
            Bytes per stream identity, for the streams that hold any; the default stream is ``None`` when no
            ``stream`` callable was given.
        """
        totals: dict[Hashable, int] = {}
        for segment in self._live:
            if segment.reserved:
                totals[segment.stream] = totals.get(segment.stream, 0) + segment.reserved
        return totals

    def empty_cache(self) -> None:
        """Release what no tensor uses, as ``torch.cuda.empty_cache`` does (``release_cached_blocks``).

        Every deferred free completes first (torch synchronizes the events); then each whole free segment is
        released, and expandable segments unmap every page that holds no used byte.
        """
        self.synchronize()
        for pool in list(self._free.values()):
            for block in list(pool):
                if block.segment is not None and block.segment.expandable:
                    self._unmap(block)
                elif not block.split:
                    self._release(block)

    # -- torch's private steps -------------------------------------------------------------------------------

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split``: 512 bytes are worth keeping in the small pool and in expandable segments; in the large
        pool more than 1 MiB, and only below ``max_split_size_mb``."""
        rest = block.size - size
        if block.small or self.settings.expandable_segments:
            return rest >= BLOCK_BYTES
        return size < self._max_split and rest > MiB

    def _allocation_size(self, size: int) -> int:
        if size <= self.SMALL_SIZE:
            return self.SMALL_BUFFER
        if size < self.MIN_LARGE_ALLOC:
            return self._large_segment
        return -(-size // self.ROUND_LARGE) * self.ROUND_LARGE

    def _insert(self, block: _Block) -> None:
        block.gc_base = self._requests[block.small]
        self._free.setdefault((block.stream, block.small), []).append(block)

    def _remove(self, block: _Block) -> None:
        self._free[(block.stream, block.small)].remove(block)

    def _get_free_block(self, stream: Hashable, small: bool, size: int) -> _Block | None:
        """torch's ``get_free_block``: best fit in the stream's pool, then the oversize rules."""
        if self.settings.gc_active:
            self._requests[small] += 1
        fits = [b for b in self._free.get((stream, small), ()) if b.size >= size]
        if not fits:
            return None
        if self.settings.expandable_segments:
            # best fit by the size a block can grow to: a block before unmapped pages is taken last
            fits.sort(key=lambda b: (b.size, b.addr))
            k = 0
            while k + 1 < len(fits) and self._growable(fits[k + 1]) < self._growable(fits[k]):
                k += 1
            block = fits[k]
        else:
            block = min(fits, key=lambda b: (b.size, b.addr))
        if size < self._max_split <= block.size:
            return None
        if size >= self._max_split and block.size >= size + self._non_split_rounding:
            return None
        self._remove(block)
        return block

    @staticmethod
    def _growable(block: _Block) -> int:
        following = block.next
        return block.size + (following.size if following is not None and not following.mapped else 0)

    def _new_segment(self, stream: Hashable, small: bool, nbytes: int) -> _Block:
        segment = _Segment(next(self._bases) << 52, nbytes, stream, small)
        self._live.append(segment)
        self.segments += 1
        self._grow(nbytes)
        return _Block(nbytes, small, segment, segment.base)

    def _grow(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.reserved_peak_bytes = max(self.reserved_peak_bytes, self.reserved_bytes)

    def _free_block(self, block: _Block) -> None:
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free and not neighbour.pending and neighbour.mapped:
                self._remove(neighbour)
                block = self._merge(block, neighbour)
        self._insert(block)

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _release(self, block: _Block) -> None:
        """``release_block``: give a whole free segment back to the device."""
        self._remove(block)
        segment = block.segment
        assert segment is not None
        self._live.remove(segment)
        self.segments -= 1
        self.reserved_bytes -= segment.size

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: release old unsplit large-pool blocks until under the threshold.

        A block's age is the number of requests its pool has served (``get_free_block`` calls) since it was
        freed. Each pass releases every candidate at least as old as the candidates' average age, and passes go on
        until the excess over the threshold is released or nothing is left to release.
        """
        fraction = self.settings.per_process_memory_fraction
        threshold = self.settings.garbage_collection_threshold
        assert fraction is not None and threshold is not None and self.device_bytes is not None
        limit = int(threshold * int(fraction * self.device_bytes))
        if self.reserved_bytes <= limit:
            return
        target, reclaimed = self.reserved_bytes - limit, 0
        candidates = [
            b
            for (_, small), pool in self._free.items()
            if not small
            for b in pool
            if not b.split and b.segment is not None and not b.segment.expandable
        ]
        while reclaimed < target and candidates:
            ages = [self._requests[False] - b.gc_base for b in candidates]
            average = sum(ages) / len(ages)
            old = [b for b, age in zip(candidates, ages, strict=True) if age >= average]
            for block in old:
                reclaimed += block.size
                self._release(block)
            candidates = [b for b in candidates if b not in old]

    # -- expandable segments ---------------------------------------------------------------------------------

    def _page(self, small: bool) -> int:
        return self.SMALL_BUFFER if small else self._large_segment

    def _expand(self, stream: Hashable, small: bool, size: int) -> _Block:
        """``try_allocate_expandable_block``: map pages after the lowest free space of the stream's segment."""
        segment = self._expandable.get((stream, small))
        if segment is None:
            segment = _Segment(next(self._bases) << 52, self._VIRTUAL_BYTES, stream, small, self._page(small))
            self._expandable[(stream, small)] = segment
            self._live.append(segment)
            segment.head = _Block(segment.size, small, segment, segment.base)
            segment.head.mapped = False
        assert segment.head is not None
        candidate = self._expandable_candidate(segment.head, size)
        if not candidate.mapped:
            candidate = self._map(candidate, min(candidate.size, size))
        while candidate.size < size:  # free -> unmapped -> ...: map the next pages, merged into the free block
            following = candidate.next
            assert following is not None and not following.mapped
            candidate = self._map(following, min(size - candidate.size, following.size))
        self._remove(candidate)
        return candidate

    def _expandable_candidate(self, head: _Block, size: int) -> _Block:
        """``find_expandable_block``: the lowest unmapped range (with the free block before it) that holds size."""
        block: _Block | None = head
        while block is not None:
            if not block.mapped:
                start = block.prev if block.prev is not None and block.prev.free and not block.prev.pending else block
                room, probe = 0, start
                while room < size and probe is not None and probe.free and not probe.pending:
                    room += probe.size
                    probe = probe.next
                if room >= size:
                    return start
            block = block.next
        raise AssertionError("an expandable segment's virtual range is never full")

    def _map(self, unmapped: _Block, nbytes: int) -> _Block:
        """``map_block``: map whole pages from the start of ``unmapped``, merged with free mapped neighbours."""
        segment = unmapped.segment
        assert segment is not None
        page = segment.page_bytes
        mapped = -(-nbytes // page) * page
        if mapped < unmapped.size:
            rest = _Block(unmapped.size - mapped, unmapped.small, segment, unmapped.addr + mapped)
            rest.mapped = False
            rest.prev, rest.next = unmapped, unmapped.next
            if unmapped.next is not None:
                unmapped.next.prev = rest
            unmapped.next, unmapped.size = rest, mapped
        unmapped.mapped = True
        if segment.mapped_bytes == 0:
            self.segments += 1
        segment.mapped_bytes += mapped
        self._grow(mapped)
        block = unmapped
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.mapped and neighbour.free and not neighbour.pending:
                self._remove(neighbour)
                block = self._merge(block, neighbour)
        self._insert(block)
        return block

    def _unmap(self, block: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free block of an expandable segment."""
        segment = block.segment
        assert segment is not None
        page = segment.page_bytes
        offset = block.addr - segment.base
        begin, end = -(-offset // page) * page, (offset + block.size) // page * page
        if begin >= end:
            return
        self._remove(block)
        pieces = []
        if begin > offset:
            pieces.append(_Block(begin - offset, block.small, segment, block.addr))
        middle = _Block(end - begin, block.small, segment, segment.base + begin)
        middle.mapped = False
        pieces.append(middle)
        if offset + block.size > end:
            pieces.append(_Block(offset + block.size - end, block.small, segment, segment.base + end))
        prev, after = block.prev, block.next
        if prev is None:
            segment.head = pieces[0]
        for piece in pieces:
            piece.prev = prev
            if prev is not None:
                prev.next = piece
            prev = piece
        prev.next = after
        if after is not None:
            after.prev = prev
        for piece in pieces:
            if piece.mapped:
                self._insert(piece)
        for neighbour in (middle.prev, middle.next):
            if neighbour is not None and not neighbour.mapped:
                middle = self._merge(middle, neighbour)
        segment.mapped_bytes -= end - begin
        self.reserved_bytes -= end - begin
        if segment.mapped_bytes == 0:  # release_expandable_segment: nothing mapped is left
            self.segments -= 1
            self._live.remove(segment)
            del self._expandable[(segment.stream, segment.small)]
