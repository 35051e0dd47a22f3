"""The core that the callback wires to Lightning, usable from a hand-written training loop."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants.census import TENANTS, ActivationTracker, take_census
from lightning_memtenants.formulas import expected_fixed_cost, explain_fixed_cost
from lightning_memtenants.report import PHASES, PhaseReport, StepReport

_TRACK_FROM = frozenset({"batch_start", "after_backward"})
_TRACK_UNTIL = frozenset({"before_backward", "batch_end"})


class TenantMonitor:
    """Measures the four tenants at named phases of each step and builds a :class:`StepReport`.

    Autograd's saved tensors are recorded from ``batch_start`` to ``before_backward`` and
    again from ``after_backward`` (a second forward under manual optimization) to ``batch_end``.
    The input batch is not counted as activations: it is resident whether or not autograd
    saves it.

    Example::

        monitor = TenantMonitor(model, [optimizer])
        for x, y in loader:
            monitor.phase("batch_start", batch=(x, y))
            loss = F.mse_loss(model(x), y)
            monitor.phase("before_backward")
            loss.backward()
            monitor.phase("after_backward")
            monitor.phase("before_optimizer_step")
            optimizer.step()
            monitor.phase("batch_end")
            report = monitor.end_step()
            optimizer.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer] = (),
        *,
        track_activations: bool = True,
        warn: Callable[[str], Any] = warnings.warn,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.tracker = ActivationTracker()
        self.disabled: set[str] = set() if track_activations else {"activations"}
        self._warn = warn
        self._micro: list[dict[str, PhaseReport]] = []
        self._steps = 0

    def phase(self, name: str, batch: Any = None) -> PhaseReport | None:
        """Take the census at phase ``name``; ``batch_start`` opens a new micro-batch."""
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        if name == "batch_start":
            self.tracker.clear()
            self._micro.append({})
            if batch is not None:
                self.guard("activations", self.tracker.ignore, _batch_tensors(batch))
        elif not self._micro:
            self._micro.append({})
        if name in _TRACK_UNTIL:
            self.tracker.stop()
        if self.tracker.error is not None and "activations" not in self.disabled:
            self._disable("activations", self.tracker.error)
        report = None
        if "census" not in self.disabled:
            tracker = None if "activations" in self.disabled else self.tracker
            tenants = self.guard("census", take_census, self.module, self.optimizers, tracker)
            if tenants is not None:
                report = PhaseReport(name, tenants)
                self._micro[-1][name] = report
        if name in _TRACK_FROM and "activations" not in self.disabled:
            self.guard("activations", self.tracker.start)
        return report

    def end_step(self) -> StepReport | None:
        """Close the optimizer step that the phases since the last call belong to."""
        micro, self._micro = self._micro, []
        self.tracker.stop()
        self.tracker.clear()
        step = self._steps
        self._steps += 1
        phases: dict[str, PhaseReport] = {}
        for batch_phases in micro:
            phases.update(batch_phases)
        if not phases:
            return None
        high = {t: max(p.tenants_bytes[t] for mb in micro for p in mb.values()) for t in TENANTS}
        last = phases.get("batch_end") or list(phases.values())[-1]
        measured = last.tenants_bytes
        expected = 0
        notes: list[str] = []
        if "fixed_cost" not in self.disabled:
            checked = self.guard("fixed_cost", self._check_fixed, measured)
            if checked is not None:
                expected, notes = checked
        measured_fixed = measured["weights"] + measured["gradients"] + measured["optimizer_state"]
        return StepReport(
            step=step,
            phases=phases,
            micro_batches=micro,
            tenants_bytes=high,
            expected_fixed_bytes=expected,
            measured_fixed_bytes=measured_fixed,
            fixed_cost_notes=notes,
        )

    def close(self) -> None:
        """Remove every hook this monitor registered; safe to call more than once."""
        self.tracker.stop()
        self.tracker.clear()
        self._micro = []

    def _check_fixed(self, measured: dict[str, int]) -> tuple[int, list[str]]:
        expected = expected_fixed_cost(self.module, self.optimizers)
        return expected.total_bytes, explain_fixed_cost(expected, measured, self.module, self.optimizers)

    def guard(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn``; if it raises, warn once, disable ``part`` and return None."""
        if part in self.disabled:
            return None
        try:
            return fn(*args)
        except Exception as error:  # a failed measurement must never fail training
            self._disable(part, error)
            return None

    def _disable(self, part: str, error: BaseException) -> None:
        self.disabled.add(part)
        if part == "activations":
            self.tracker.stop()
        self._warn(
            f"memtenants: measuring {part} failed ({type(error).__name__}: {error}); {part} is disabled from now on"
        )


def _batch_tensors(batch: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found
