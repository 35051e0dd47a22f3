"""The memory timeline of a step, drawn; and the same step as a PyTorch memory snapshot.

:func:`timeline_figure` draws allocated bytes over the step's operators, stacked by tenant, with
the phases marked and the operator at the peak named. :func:`write_snapshot` writes the step's
allocations and frees in the format of ``torch.cuda.memory._snapshot()``, which
``python -m torch.cuda._memory_viz trace_plot step.pickle -o step.html`` renders offline: memory_viz's
view of a step predicted for a GPU, before renting one.
"""

from __future__ import annotations

import os
import pickle
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lightning_memtenants.core.timeline import LAYER_LABELS, LAYERS, StepTimeline, timeline_of
from lightning_memtenants.units import MiB

TIMELINE = "timeline"
TIMELINE_PNG = "memtenants_timeline.png"
_COLORS = {
    "weights": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer_state": "#2ca02c",
    "activations": "#9467bd",
    "temporaries": "#c7c7c7",
}
# The allocator's block alignment: the snapshot's addresses are laid out on it, as CUDA's would be.
_ALIGN = 512


def timeline(of: Any) -> StepTimeline:
    """The memory timeline of a tracked step's report, or of a prediction (its last step).

    Args:
        of: a :class:`StepReport` the live-tensor tracker measured, or a ``Prediction``.

    Returns:
        The timeline.

    Raises:
        ValueError: if no timeline was recorded for it (a step the tracker did not measure).
    """
    report = getattr(of, "report", of)
    found = timeline_of(report)
    if found is None:
        raise ValueError(
            "no timeline was recorded for this report: timelines are recorded on the steps the live-tensor"
            " tracker measures (logging steps on CPU, every dry run)"
        )
    return found


def timeline_figure(line: StepTimeline, budget_bytes: int | None = None) -> Figure:
    """Allocated MiB over the step's operators, stacked by tenant; the phases, the peak and its operator.

    Args:
        line: the step's timeline.
        budget_bytes: the budget, drawn as a dashed line where it is within 3x of the peak.

    Returns:
        The figure, on a bare Agg canvas (never through pyplot).
    """
    figure = Figure(figsize=(11, 5.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    xs = spread(line.op_index)
    bottom = np.zeros(len(xs))
    for name in LAYERS:
        values = np.asarray(line.layers[name], dtype=float) / MiB
        if not values.any():
            continue
        axes.fill_between(
            xs, bottom, bottom + values, step="post", color=_COLORS[name], label=LAYER_LABELS[name], linewidth=0
        )
        bottom = bottom + values
    axes.step(xs, bottom, where="post", color="black", linewidth=0.6)
    peak = line.peak_bytes / MiB
    top = max(peak, float(bottom.max()) if len(bottom) else 0.0)
    if budget_bytes is not None and budget_bytes <= 3 * max(line.peak_bytes, 1):
        axes.axhline(budget_bytes / MiB, color="#8b0000", linestyle="--", linewidth=1.5, label="budget")
        top = max(top, budget_bytes / MiB)
    end = max(line.ops, int(xs.max()) if len(xs) else 0, 1)
    previous = None
    for phase, at, _ in line.phases:
        axes.axvline(at, color="black", linestyle=":", linewidth=0.8)
        after = previous is None or at - previous < 0.03 * end  # the label right of its line, clear of the last one
        text = f" {phase}" if after else f"{phase} "
        axes.text(at, top * 1.15, text, rotation=90, fontsize=8, va="top", ha="left" if after else "right")
        previous = at
    peak_x = float(xs[line.peak_point]) if 0 <= line.peak_point < len(xs) else float(line.peak_op_index)
    axes.plot([peak_x], [peak], marker="*", markersize=16, color="black", linestyle="none", label="step peak")
    right = peak_x > 0.6 * end
    axes.annotate(
        f"peak {peak:,.2f} MiB at operator {line.peak_op_index:,}\n{line.peak_label}",
        (peak_x, peak),
        xytext=(-14 if right else 14, -4),
        textcoords="offset points",
        ha="right" if right else "left",
        va="top",
        fontsize=9,
        bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "alpha": 0.85, "edgecolor": "#999999"},
    )
    axes.set_xlim(0, end)
    axes.set_ylim(0, top * 1.16 if top else 1)
    axes.set_xlabel(f"operators dispatched in the step ({line.ops:,} in all; dotted lines: the phase boundaries)")
    figure.supxlabel(
        textwrap.fill(
            "Stacked bottom up. Weights, gradients, optimizer state: the storages that are those tensors at a phase"
            " boundary; activations: what autograd saved for backward, as read at before_backward; on top, the rest:"
            " temporaries and other (the batch, outputs, an optimizer's scratch). Star: the step's peak, to the byte.",
            160,
        ),
        x=0.01,
        ha="left",
        fontsize=9,
    )
    axes.set_ylabel("allocated (MiB)")
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    axes.set_title(f"memtenants timeline: optimizer step {line.step}, {line.source}", fontsize=12)
    handles, labels = axes.get_legend_handles_labels()
    axes.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    return figure


def spread(op_index: list[int]) -> np.ndarray:
    """The points' x positions: an operator's events (an allocation, then the frees after it) side by side
    within its unit of the axis, so that a peak inside one operator is drawn, not hidden by the frees after it."""
    ops = np.asarray(op_index, dtype=float)
    if not len(ops):
        return ops
    starts = np.r_[0, np.flatnonzero(np.diff(ops)) + 1]
    counts = np.diff(np.r_[starts, len(ops)])
    rank = np.arange(len(ops)) - np.repeat(starts, counts)
    return ops + rank / np.repeat(counts, counts)


def snapshot(line: StepTimeline, device: int = 0) -> dict[str, Any]:
    """The step as a memory snapshot (``torch.cuda.memory._snapshot()``'s format) for ``torch.cuda._memory_viz``.

    Each allocation is an ``alloc`` event and each free a ``free_completed`` one, on stream 0, at made-up
    addresses laid out on 512-byte blocks; its frame names the operator, and the module that ran it (in
    ``filename``; ``line`` is the operator's index in the step). What was resident when the step began is
    allocated first; what is alive at its end is in ``segments``, one block per segment.

    Args:
        line: the step's timeline.
        device: the device index the events are listed under.

    Returns:
        ``{"segments": [...], "device_traces": [[...] per device]}``.

    Raises:
        ValueError: if the step had more events than the recorder keeps for a snapshot.
    """
    if not line.allocations and line.events:
        raise ValueError(f"the step had {line.events:,} allocations and frees, more than a snapshot keeps")
    addresses: dict[int, int] = {}
    cursor = 0

    def address(index: int) -> int:
        nonlocal cursor
        if index not in addresses:
            addresses[index] = cursor
            cursor += max(-(-line.allocations[index][0] // _ALIGN) * _ALIGN, _ALIGN)
        return addresses[index]

    def frames(index: int) -> list[dict[str, Any]]:
        _, op, where, at = line.allocations[index]
        return [{"filename": where or "(no module)", "line": at, "name": op}]

    events: list[dict[str, Any]] = []
    alive: set[int] = set()
    time_us = 0
    for index in line.resident:
        events.append(_event("alloc", address(index), line.allocations[index][0], frames(index), time_us))
        alive.add(index)
    for action, index, at in line.trace:
        size = line.allocations[index][0]
        if action == "alloc":
            events.append(_event("alloc", address(index), size, frames(index), at))
            alive.add(index)
        elif index in alive:
            events.append(_event("free_requested", address(index), size, frames(index), at))
            events.append(_event("free_completed", address(index), size, frames(index), at))
            alive.discard(index)
    segments = []
    for index in sorted(alive, key=address):
        size = line.allocations[index][0]
        block = max(-(-size // _ALIGN) * _ALIGN, _ALIGN)
        segments.append(
            {
                "device": device,
                "address": address(index),
                "total_size": block,
                "stream": 0,
                "segment_type": "large" if block > 1 << 20 else "small",
                "allocated_size": block,
                "active_size": block,
                "requested_size": size,
                "blocks": [
                    {
                        "address": address(index),
                        "size": block,
                        "requested_size": size,
                        "state": "active_allocated",
                        "frames": frames(index),
                    }
                ],
            }
        )
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device)] + [events]
    return {"segments": segments, "device_traces": traces}


def _event(action: str, addr: int, size: int, frames: list[dict[str, Any]], time_us: int) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames, "time_us": time_us}


def write_snapshot(of: Any, path: str | os.PathLike[str]) -> Path:
    """Write the step (a prediction, a report or a timeline) as a memory-snapshot pickle at ``path``.

    ``python -m torch.cuda._memory_viz trace_plot step.pickle -o step.html`` renders it offline, or drop it
    on https://pytorch.org/memory_viz.

    Args:
        of: a ``Prediction``, a tracked :class:`StepReport`, or a :class:`StepTimeline`.
        path: the pickle to write.

    Returns:
        The path written.

    Raises:
        ValueError: as :func:`timeline` and :func:`snapshot`.
    """
    line = of if isinstance(of, StepTimeline) else timeline(of)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as out:
        pickle.dump(snapshot(line), out)
    return target
