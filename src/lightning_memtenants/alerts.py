"""Warnings before an OOM and the postmortem after one.

Everything here works from reports and plain numbers, so it serves the callback and a
hand-written loop alike.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_memtenants.census import TENANTS
from lightning_memtenants.formulas import expected_fixed_cost, step_temporaries_bytes
from lightning_memtenants.report import WINDOW_NAMES, WINDOWS, MiB, PhaseReport

_ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


class MemoryBudgetError(RuntimeError):
    """Raised with ``strict=True`` when a step is predicted not to fit the memory budget."""


def device_budget_bytes(device: torch.device) -> int | None:
    """The device's capacity, reduced by ``set_per_process_memory_fraction`` on CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    total = int(torch.cuda.mem_get_info(device)[1])
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    return int(total * fraction)


def optimizer_step_temporaries_bytes(optimizers: Sequence[Optimizer]) -> int:
    """A first estimate of what an optimizer step allocates and frees again.

    The single-tensor loop of Adam-like optimizers makes two temporaries the size of the
    parameter it works on, so its peak is set by the largest parameter; ``foreach`` makes
    one for every parameter at once; ``fused`` makes none (``formulas.step_temporaries_bytes``).
    """
    return sum(step_temporaries_bytes(optimizer) for optimizer in optimizers)


def first_step_jump_bytes(module: nn.Module, optimizers: Sequence[Optimizer], state_now: int) -> tuple[int, int]:
    """What the first optimizer step will add: (lazily created state, temporaries)."""
    state = max(expected_fixed_cost(module, optimizers).optimizer_state_bytes - state_now, 0)
    return state, optimizer_step_temporaries_bytes(optimizers)


class LeakDetector:
    """Flags steady growth of allocated bytes at ``batch_start`` across steps.

    Growth counts as a leak when, over the last ``window`` observations, the fitted slope is
    above ``min_bytes_per_step``, memory grew at most steps, and the rise is large next to
    the scatter around the line. Healthy training settles after its first steps (Adam's
    state appears once), so the first two observations are not used.
    """

    def __init__(self, window: int = 8, min_bytes_per_step: int = 64 * 1024) -> None:
        self.window = window
        self.min_bytes_per_step = min_bytes_per_step
        self._seen = 0
        self._points: deque[tuple[int, int, dict[str, int]]] = deque(maxlen=window)

    def observe(self, step: int, phase: PhaseReport) -> str | None:
        """Add ``batch_start`` of one step; return a warning once growth looks like a leak."""
        self._seen += 1
        if self._seen <= 2:
            return None
        total = phase.allocated_bytes if phase.allocated_bytes is not None else phase.total_bytes
        parts = dict(phase.tenants_bytes)
        if phase.other_bytes is not None:
            parts["other"] = phase.other_bytes
        self._points.append((step, total, parts))
        if len(self._points) < self.window:
            return None
        steps = [p[0] for p in self._points]
        slope, scatter = _slope(steps, [p[1] for p in self._points])
        rises = sum(b[1] > a[1] for a, b in zip(self._points, list(self._points)[1:], strict=False))
        if slope < self.min_bytes_per_step or rises < 0.75 * (self.window - 1):
            return None
        if slope * (steps[-1] - steps[0]) < 3 * scatter:
            return None
        slopes = {name: _slope(steps, [p[2].get(name, 0) for p in self._points])[0] for name in parts}
        tenant = max(slopes, key=lambda name: slopes[name])
        return (
            f"memtenants: memory grows by {slope / MiB:.2f} MiB per step at batch start"
            f" (steps {steps[0]}-{steps[-1]}), mostly in {tenant}. A common cause is keeping a loss or an"
            " output with its graph across steps (e.g. appending `loss` to a list); keep `loss.detach()`"
            " or `loss.item()` instead."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen, "points": [list(p) for p in self._points]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved.

        Raises:
            ValueError: if ``state`` is not such a dict; nothing is changed then.
        """
        try:
            seen = int(state.get("seen", 0))
            points = deque(
                ((int(s), int(t), {str(k): int(v) for k, v in dict(p).items()}) for s, t, p in state.get("points", [])),
                maxlen=self.window,
            )
        except (AttributeError, TypeError, ValueError) as error:
            raise ValueError(
                f"the leak detector's state must be a dict saved by LeakDetector.state_dict(), got {state!r:.80}"
                f" ({error})"
            ) from None
        self._seen, self._points = seen, points


def _slope(xs: list[int], ys: list[int]) -> tuple[float, float]:
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs) or 1.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    residuals = [y - (mean_y + slope * (x - mean_x)) for x, y in zip(xs, ys, strict=True)]
    scatter = (sum(r * r for r in residuals) / n) ** 0.5
    return slope, scatter


@dataclass(frozen=True)
class Fix:
    """One remedy for an OOM and the bytes it would save."""

    action: str
    saves_bytes: int


def ranked_fixes(
    tenants: dict[str, int],
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    world_size: int = 1,
    temporaries_bytes: int = 0,
    batch_temporaries_bytes: int = 0,
) -> list[Fix]:
    """The fixes for the tenants at hand, most bytes saved first.

    ``batch_temporaries_bytes`` is memory that grows with the batch but is not (yet) saved for
    backward: the forward's in-flight outputs when an OOM strikes there.
    """
    fixes = []
    activations = tenants.get("activations", 0)
    grows = activations + batch_temporaries_bytes
    if grows:
        fixes.append(
            Fix("halve the batch size (use accumulate_grad_batches=2 to keep the effective batch)", grows // 2)
        )
    if activations:
        fixes.append(
            Fix("activation checkpointing of the largest blocks (torch.utils.checkpoint)", activations * 7 // 10)
        )
    if grows and any(p.dtype == torch.float32 for p in module.parameters()):
        fixes.append(Fix("precision='bf16-mixed': half-size activations", grows // 2))
    state = tenants.get("optimizer_state", 0)
    if state:
        n = max(world_size, 2)
        fixes.append(
            Fix(
                f"shard the optimizer state with ZeRO or FSDP across {n} devices: saves (N-1)/N of it",
                state * (n - 1) // n,
            )
        )
    if temporaries_bytes:
        fixes.append(
            Fix("use the optimizer's fused=True (no per-parameter temporaries) or foreach=False", temporaries_bytes)
        )
    if state and any(type(o).__name__ in _ADAM_LIKE for o in optimizers):
        fixes.append(Fix("SGD without momentum keeps no optimizer state", state))
    return sorted(fixes, key=lambda fix: fix.saves_bytes, reverse=True)


def write_postmortem(
    directory: str | os.PathLike[str],
    *,
    error: BaseException,
    last_phase: PhaseReport | None,
    failing_window: str | None,
    tenants_now: dict[str, int] | None,
    other_now: int | None = None,
    fixes: list[Fix],
    budget_bytes: int | None,
    step: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Path, Path]:
    """Write the postmortem as JSON and text; return their paths.

    The files are ``memtenants_oom.json`` and ``.txt`` in a single process, and
    ``memtenants_oom_rank<r>.json`` and ``.txt`` on each rank of a distributed run, so that
    ranks never write over each other. Nothing here talks to other ranks.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tenants = dict(tenants_now or (last_phase.tenants_bytes if last_phase else {}))
    if other_now is not None:
        tenants["other"] = other_now
    fat = max(tenants, key=lambda t: tenants[t]) if tenants else None
    record = {
        "error": describe_error(error),
        "rank": rank,
        "step": step,
        "phase": failing_window,
        "phase_description": _describe(failing_window),
        "last_completed_phase": last_phase.name if last_phase else None,
        "tenants_at_last_completed_phase_bytes": last_phase.tenants_bytes if last_phase else None,
        "allocated_at_last_completed_phase_bytes": last_phase.allocated_bytes if last_phase else None,
        "tenants_at_failure_bytes": tenants_now,
        "other_at_failure_bytes": other_now,
        "fattest_tenant": fat,
        "budget_bytes": budget_bytes,
        "fixes": [{"action": f.action, "saves_bytes": f.saves_bytes} for f in fixes],
    }
    stem = "memtenants_oom" if world_size <= 1 else f"memtenants_oom_rank{rank}"
    json_path, text_path = directory / f"{stem}.json", directory / f"{stem}.txt"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"memtenants OOM postmortem: step {step}{f', rank {rank}' if world_size > 1 else ''}, {record['error']}",
        f"failed in {record['phase_description']} ({failing_window}), after {record['last_completed_phase']}",
        "",
        f"{'tenant (MiB)':<18}{'last phase':>14}{'at failure':>14}",
    ]
    for tenant in TENANTS:
        before = last_phase.tenants_bytes.get(tenant) if last_phase else None
        now = tenants_now.get(tenant) if tenants_now else None
        lines.append(f"{tenant:<18}{_fmt(before):>14}{_fmt(now):>14}")
    before_other = last_phase.other_bytes if last_phase else None
    lines.append(f"{'other':<18}{_fmt(before_other):>14}{_fmt(other_now):>14}")
    lines += ["", f"fattest tenant: {fat}", "fixes, most bytes saved first:"]
    lines += [f"  {i}. {f.action}: saves {f.saves_bytes / MiB:.2f} MiB" for i, f in enumerate(fixes, 1)]
    text_path.write_text("\n".join(lines) + "\n")
    return json_path, text_path


def describe_error(error: BaseException) -> str:
    """``Type: message`` for any exception, even one whose ``__str__`` raises or whose args are not text."""
    try:
        text = str(error)
    except Exception:  # a user's exception may fail to print itself; its repr of args still tells something
        try:
            text = repr(error.args)
        except Exception:
            text = "<unprintable>"
    return f"{type(error).__name__}: {text}"


def _describe(window: str | None) -> str:
    for phase, name in WINDOW_NAMES.items():
        if name == window:
            return WINDOWS[phase]
    return "before the first phase"


def _fmt(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"
