"""The memory source's session over a monitor's steps: when it measures, pauses, resumes and stops.

A costly source (the live-tensor tracker) measures only the steps asked for, and within one only the micro-batches:
what runs between them (the data loader's fetch and collate) is not the step's. Keeping that on/off state, and that
a failed source is read no more, is one idea of its own; :class:`SourceSession` holds it for the monitor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.sources import MemorySource, Reading

_PART = "memory source"  # the guard's name for it: a failure disables it for the rest of the run


class SourceSession:
    """A memory source as the monitor uses it: started at a measured step's first phase, paused between its
    micro-batches and at its end, stopped for good where it cannot measure.

    Every call to the source goes through the guard: a source that fails warns once and is read no more.

    Args:
        source: the memory source.
        guard: the monitor's guard; ``"memory source"`` among its disabled parts stops the measuring.
    """

    def __init__(self, source: MemorySource, guard: Guard) -> None:
        self.source = source
        self._guard = guard
        self.measuring = False  # whether the source measures the step under way
        self.paused_between = False  # paused between the micro-batches of a measured step

    def begin(self, measure: bool) -> bool:
        """Open a step, measured where ``measure`` and the source has not failed; :meth:`start` starts it.

        Args:
            measure: whether this step is to be measured.

        Returns:
            Whether the source is to measure the step.
        """
        self.paused_between = False
        self.measuring = self._works() and measure
        return self.measuring

    def start(self, roots: Iterable[Tensor]) -> bool:
        """Start the source for the step just opened, or again after a pause.

        Args:
            roots: the tensors alive now (read by the live-tensor tracker), the batch among them.

        Returns:
            Whether the source measures (False once it failed to start).
        """
        self._guard.run(_PART, self.source.start, roots)
        self.measuring = self._works()
        return self.measuring

    def read(self) -> Reading:
        """What the source sees now, where it measures this step (it opens a new window); else an empty reading."""
        if not self.measuring:
            return Reading()
        return self._guard.run(_PART, self.source.read) or Reading()

    def adopt(self, storages: Iterable[Any]) -> None:
        """Hand the source storages that were alive before it started (what the graph saved), where it measures."""
        if self.measuring:
            self._guard.run(_PART, self.source.adopt, storages)

    def pause_between(self) -> None:
        """Pause a costly source after a micro-batch, until :meth:`resume` at the next one."""
        if self.measuring and not self.source.every_step:
            # what runs until the next micro-batch (the data loader's fetch: a TensorDataset's sample is a view of
            # the whole data set; the collate; the prefetch of the batch after) is not the step's
            self._guard.run(_PART, self.source.pause)
            self.paused_between = True

    def resume(self, roots: Iterable[Tensor]) -> None:
        """Start the paused source again for the step's next micro-batch.

        Args:
            roots: the tensors alive now, the micro-batch's batch among them.
        """
        self.paused_between = False
        if self.measuring:
            self.start(roots)

    def pause(self) -> None:
        """The step is over (or dropped): a costly source pauses, and nothing is measured until the next
        :meth:`begin`."""
        if self.measuring and not self.source.every_step:
            self._call(self.source.pause)
        self.measuring = self.paused_between = False

    def stop(self) -> None:
        """Stop the source for good, without calling it a failure (the monitor says why)."""
        self.measuring = False
        with contextlib.suppress(Exception):
            self.source.stop()

    def close(self) -> None:
        """Stop the source and its hooks; a failure to stop is the guard's to report."""
        self.measuring = self.paused_between = False
        self._call(self.source.stop)

    def _works(self) -> bool:
        return _PART not in self._guard.disabled

    def _call(self, fn: Callable[[], Any]) -> None:
        """Pause or stop the source through the guard; where it already failed, still, quietly: a source that
        failed to read may hold a dispatch mode or hooks, which must not outlive the step."""
        if self._works():
            self._guard.run(_PART, fn)
        else:
            with contextlib.suppress(Exception):
                fn()
