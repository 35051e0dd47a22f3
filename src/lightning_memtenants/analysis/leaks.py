"""Leak detection: steady growth of allocated bytes at batch start, across steps."""

from __future__ import annotations

from collections import deque
from typing import Any

from lightning_memtenants.core.record import PhaseReport
from lightning_memtenants.units import MiB


class LeakDetector:
    """Flags steady growth of allocated bytes at ``batch_start`` across steps.

    Growth counts as a leak when, over the last ``window`` observations, the fitted slope is
    above ``min_bytes_per_step``, memory grew at most steps, and the rise is large next to
    the scatter around the line. Healthy training settles after its first steps (Adam's
    state appears once), so the first two observations are not used.

    An evaluation loop (``loop="validation"``, ``"test"``, ``"predict"``) is watched batch by batch from its first
    batch: nothing should outlive an evaluation step but what the user keeps, so its window is short.

    Args:
        window: how many of the latest observations are fitted; none is judged before the window is full.
        min_bytes_per_step: the least growth per step (per batch in an evaluation loop), in bytes, that counts as a
            leak.
        skip: how many first observations are not used.
        loop: the loop watched, in words (``names.LOOP_NAMES``); the warning's wording follows it.

    Raises:
        ValueError: if ``window`` is not an int of 3 or more, ``min_bytes_per_step`` or ``skip`` not an int of 0 or
            more.
    """

    def __init__(
        self, window: int = 8, min_bytes_per_step: int = 64 * 1024, *, skip: int = 2, loop: str = "training"
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 3:
            raise ValueError(f"window must be an int of 3 or more (a line through fewer says nothing), got {window!r}")
        if isinstance(min_bytes_per_step, bool) or not isinstance(min_bytes_per_step, int) or min_bytes_per_step < 0:
            raise ValueError(f"min_bytes_per_step must be an int of 0 or more, got {min_bytes_per_step!r}")
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip must be an int of 0 or more, got {skip!r}")
        self.window = window
        self.skip = skip
        self.loop = loop
        self.min_bytes_per_step = min_bytes_per_step
        self._seen = 0
        self._points: deque[tuple[int, int, dict[str, int]]] = deque(maxlen=window)

    def observe(self, step: int, phase: PhaseReport) -> str | None:
        """Add ``batch_start`` of one step; return a warning whenever the window's growth looks like a leak.

        Allocated bytes are fitted where they were measured, else the tenants' sum; the warning names the
        tenant (or ``other``) that grew fastest. The caller warns once.

        Args:
            step: the optimizer step.
            phase: the step's ``batch_start``.

        Returns:
            The warning, or None.
        """
        self._seen += 1
        if self._seen <= self.skip:
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
        if self.loop != "training":
            kept = (
                " (trainer.predict keeps every batch's predictions unless return_predictions=False)"
                if self.loop == "predict"
                else ""
            )
            return (
                f"memtenants: memory grows by {slope / MiB:.2f} MiB per {self.loop} batch at batch start"
                f" (batches {steps[0]}-{steps[-1]}), mostly in {tenant}: tensors outlive the {self.loop} step{kept}."
                " A common cause is appending its outputs to a list with their graph (the step ran with grad"
                " enabled) or on the device; keep `.detach().cpu()`, `.item()`, or a metric's running state instead."
            )
        return (
            f"memtenants: memory grows by {slope / MiB:.2f} MiB per step at batch start"
            f" (steps {steps[0]}-{steps[-1]}), mostly in {tenant}. A common cause is keeping a loss or an"
            " output with its graph across steps (e.g. appending `loss` to a list); keep `loss.detach()`"
            " or `loss.item()` instead."
        )

    def state_dict(self) -> dict[str, Any]:
        """The observations so far, as plain types, so that a resumed run keeps its baseline."""
        return {"seen": self._seen, "points": [list(p) for p in self._points]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved.

        Args:
            state: a dict returned by :meth:`state_dict`.

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
