"""The monitor: the core's measurements taken at each phase of a step, and the step's report.

It is where the pipeline's first two stages meet: ``core/`` counts the tenants and reads the memory
source at each phase boundary, and ``analysis/`` checks the fixed cost and explains the peak when the
step ends. The callback wires it to Lightning; a hand-written loop calls it directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from operator import is_
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants._private import compiled_by_lightning, compiled_in_place
from lightning_memtenants.analysis.explain import (
    COMPILED_REASON,
    NO_OUTPUT,
    carried_note,
    diverged_note,
    explain_peak,
    graph_notes,
    readings_note,
)
from lightning_memtenants.analysis.formulas import (
    expected_fixed_cost,
    explain_fixed_cost,
    fsdp_gathered_bytes,
    optimizer_implementation,
    step_temporaries_bytes,
)
from lightning_memtenants.checks import brief
from lightning_memtenants.core.carry import CountedBatch, CountedPhase, TreeWatch
from lightning_memtenants.core.census import ActivationTracker, TenantCounter
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.micro import Diverged, MicroBatches, compared
from lightning_memtenants.core.record import GraphCounts, PhaseReport, StepReport, fixed_bytes
from lightning_memtenants.core.session import SourceSession
from lightning_memtenants.core.sources import MemorySource, Reading, TrackerSource, source_for
from lightning_memtenants.core.storage import (
    HostState,
    batch_tensors,
    local_optimizer,
    module_device,
    optimizer_state_tensors,
)
from lightning_memtenants.core.timeline import StepTimeline, TimelineRecorder, keep_timeline, tenant_keys
from lightning_memtenants.names import PARTS, PHASES, TENANTS, WINDOWS, Measurement, Part, Phase, Tenant


class TenantMonitor:
    """Measures the four tenants and the memory source at named phases; builds a :class:`StepReport`.

    The activations are read at ``before_backward`` from the graph of the output handed to
    that phase (the loss): what its nodes saved for backward, with no hook installed. The
    input batch is not counted as activations: it is resident whether or not autograd saves it.

    Set ``measure = False`` before a step's ``batch_start`` to skip a costly source (the
    live-tensor tracker) for that step. Its tenants are then carried, micro-batch by micro-batch, from
    the last counted one with the same :func:`~lightning_memtenants.core.carry.batch_key` (the same
    batch shapes, parameters, parameter groups, optimizer state and gradients present), without walking
    the graph; a micro-batch with no such match is counted. At each phase a carried micro-batch must be where
    its counted one was: the same phase, the same optimizers stepped so far (tell the monitor with
    :meth:`optimizer_stepped`), at ``after_backward`` the same parameters with a gradient, at ``batch_end``
    the same optimizer state entries and groups (:func:`~lightning_memtenants.core.carry.structure`); where
    it is not, the micro-batch is counted from that phase on and its key is never carried again. A parameter,
    buffer or submodule registered on any module makes the parameters be read again at the next phase. Every
    carried report says so in its ``notes``. Set ``count_every_step = True`` to count every step regardless.

    Between the micro-batches of a measured step a costly source is paused, and started again at the next
    ``batch_start`` with that batch: what runs between them (the data loader's fetch and collate) is not
    the step's, and a device holds neither the data set nor a prefetched batch.

    Args:
        module: the model whose tenants are counted.
        optimizers: its optimizers, whose state is the optimizer-state tenant.
        track_activations: read the activations from the loss's graph.
        source: ``"auto"`` (allocator counters on accelerators, the live-tensor tracker on
            CPU), a :class:`MemorySource`, or ``None`` for tenants only.
        device: the device trained on, for ``"auto"`` and for telling offloaded saved tensors
            apart; ``None`` reads it from the module's first parameter or buffer, else the CPU.
        warn: how a failed measurement is reported (once per part).
        host_state: the optimizer-state entries kept in host memory, by optimizer (a GPU run's
            ``step`` counters where the optimizer is neither capturable nor fused): left out of the
            optimizer-state tenant and of the fixed-cost formula alike. ``None`` counts every entry.

    Raises:
        ValueError: if ``source`` is none of the above, ``device`` names no device, or
            ``host_state`` is not callable.

    Example::

        monitor = TenantMonitor(model, [optimizer])
        for x, y in loader:
            monitor.phase("batch_start", batch=(x, y))
            loss = F.mse_loss(model(x), y)
            monitor.phase("before_backward", output=loss)
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
        source: MemorySource | str | None = "auto",
        device: torch.device | str | None = None,
        warn: Callable[[str], Any] = warnings.warn,
        host_state: HostState | None = None,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.device = module_device(module, device)
        if isinstance(source, str) and source == "auto":
            source = source_for(self.device)
        elif source is None:
            source = MemorySource()
        elif not isinstance(source, MemorySource):
            raise ValueError(f"source must be 'auto', None or a MemorySource, got {brief(source)}")
        if host_state is not None and not callable(host_state):
            raise ValueError(f"host_state must be None or a callable of an optimizer, got {brief(host_state)}")
        self.host_state = host_state
        self.measure = True
        # count the tenants on every step, also where an earlier micro-batch with the same key could be carried
        self.count_every_step = False
        # the last step made only of carried micro-batches: what they were, its notes, what it read, its report
        self._light: tuple[list[CountedBatch | None], list[str], tuple[Any, ...], StepReport] | None = None
        # record the step's memory timeline (``timeline_of(report)``) on the steps the live-tensor tracker measures
        self.record_timeline = True
        # whether the timeline names the module of each allocation (hooks on the model's modules); without it the
        # timeline still splits each moment into fixed and batch-proportional bytes (``StepTimeline.scaling``)
        self.timeline_module_paths = True
        self._recorder: TimelineRecorder | None = None
        # whether a training model's modules may get the timeline's hooks: once a measured step's graph was read
        # and held no torch.compile'd code (a compiled function that calls the modules is seen only there)
        self._hooks_allowed = False
        self.steps_done = 0
        self._warn = warn
        self._guard = Guard(warn, "measuring", self._released)
        if not track_activations:
            self._guard.disabled.add("activations")
        # the source's on/off state over the steps: measuring, paused between micro-batches, stopped
        self._session = SourceSession(source, self._guard)
        self._tracker = ActivationTracker(self.device.type)
        if isinstance(source, TrackerSource):  # the tenants and the totals agree on what is host memory
            self._tracker.host_memory = source.tracker.is_host
            self._tracker.offloaded_memory = source.tracker.is_offloaded
        self._counter = TenantCounter(module, self.optimizers, host_state)
        self._tracker.params = self._counter.param_ids()
        self._tracker.params_of = self._counter.param_ids
        # registrations of parameters, buffers and submodules anywhere: the cue to read the parameters again
        self._tree = TreeWatch()
        self._tree_seen = self._tree.version
        # the step's micro-batches: which are counted and which carry a counted one, kept by key for later steps
        self._batches = MicroBatches(self._tracker, self.optimizers)
        self._read_sizes()
        self._parts: dict[Part, Callable[[], int]] = {}
        self._notes: list[str] = []
        # why the memory source does not measure this run, where it cannot (compiled code on CPU)
        self.unmeasured_reason: str | None = None
        if not self.source.sees_compiled_code and holds_compiled_code(module):
            self.unmeasured_reason = COMPILED_REASON
            warn(f"memtenants: {COMPILED_REASON}")
        self._step_notes: list[str] = []
        self._state_bytes: int | None = None
        self._state_signature: tuple[int, ...] = ()
        self._fixed: tuple[tuple[int, ...], tuple[int, list[str]]] | None = None
        self._last: PhaseReport | None = None

    # -- what the caller may add or ask -------------------------------------------------------

    def add_part(self, name: Part, read: Callable[[], int]) -> None:
        """Report ``read()`` bytes as the named part ``name`` at every phase (``names.PARTS``).

        Args:
            name: one of ``names.PARTS``.
            read: a callable of no arguments that returns the part's bytes now.

        Raises:
            ValueError: if ``name`` is not one of ``names.PARTS`` or ``read`` is not callable.
        """
        if name not in PARTS:
            raise ValueError(f"name must be one of {list(PARTS)}, got {brief(name)}")
        if not callable(read):
            raise ValueError(f"read must be a callable returning bytes, got {brief(read)}")
        self._parts[name] = read

    def add_note(self, note: str) -> None:
        """A sentence about this run (its precision, its strategy) that every step's report carries.

        Args:
            note: the sentence; one already added is not added again.
        """
        if note not in self._notes:
            self._notes.append(str(note))

    def measures(self, part: Measurement | Part) -> bool:
        """Whether ``part`` (``"activations"``, ``"memory source"``, a named part) is still measured.

        Args:
            part: a measurement or a named part.

        Returns:
            False once a failure has disabled it.
        """
        return part not in self._guard.disabled

    @property
    def source(self) -> MemorySource:
        """The memory source that reads the totals and the peaks (see the ``source`` argument)."""
        return self._session.source

    @source.setter
    def source(self, source: MemorySource) -> None:
        self._session.source = source

    @property
    def measuring(self) -> bool:
        """Whether the memory source measures the step under way."""
        return self._session.measuring

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches begun since the last ``end_step``."""
        return len(self._batches)

    def last_phase(self) -> PhaseReport | None:
        """The most recent phase measured, in this step or the one before."""
        return self._last

    def trainable_bytes(self) -> int:
        """Bytes of the trainable parameters: what their gradients will take once all exist."""
        return sum(t.numel() * t.element_size() for t in self._counter.tensors if t.requires_grad)

    def census(self) -> dict[Tenant, int]:
        """Each tenant's bytes right now, the activations as the last graph read saw them."""
        tracker = self._tracker if self.measures("activations") else None
        return self._counter.count(tracker)

    def read_source(self) -> Reading:
        """What the memory source sees now, where it measures this step (it opens a new window)."""
        return self._session.read()

    # -- the phases ----------------------------------------------------------------------------

    def phase(self, name: Phase, batch: Any = None, output: Any = None) -> PhaseReport | None:
        """Take the census at phase ``name``.

        Args:
            name: one of ``PHASES``; ``batch_start`` opens a new micro-batch.
            batch: at ``batch_start``, the input batch, which is not counted as activations.
            output: at ``before_backward``, the loss (or any output) whose graph holds what the
                forward saved for backward; without it the activations are not measured.

        Returns:
            The phase's report, or ``None`` where the census is disabled.

        Raises:
            ValueError: if ``name`` is not a phase.
        """
        if not isinstance(name, str) or name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {brief(name)}")
        report = self._phase(name, batch, output)
        if name == "batch_end":
            self._session.pause_between()
        return report

    def optimizer_stepped(self, optimizer: Optimizer) -> None:
        """Tell the monitor that ``optimizer`` stepped in the micro-batch under way (the callback's post-step hook).

        Which optimizers step is part of a step's structure: a carried micro-batch whose optimizers stepped
        otherwise than its counted one's (a generator stepped every fifth batch) is counted from its next phase
        on. A loop that never calls this compares nothing here.

        Args:
            optimizer: the optimizer that stepped; one the monitor was not given counts as ``-1``.
        """
        self._batches.optimizer_stepped(optimizer)

    def _phase(self, name: Phase, batch: Any, output: Any) -> PhaseReport | None:
        """``phase`` once its argument is checked."""
        guard = self._guard
        changed = False
        if name == "batch_start":
            self._tracker.clear()
            if self._tree.closed:  # closed and used again: watch again, and read the parameters
                self._tree, self._tree_seen = TreeWatch(), -1
            fresh = self.measure or self.steps_done == 0 or self._tree.version != self._tree_seen
            if fresh and self.measures("census"):
                # the module's parameters are re-read on measured steps and where a parameter, buffer or module was
                # registered; a walk of the module tree at every step would cost more than the rest of the census
                guard.run("census", self._refresh)
            if not self._batches:
                self._begin_step(batch)
            tensors = batch_tensors(batch) if batch is not None else None  # read once: the key and the ignore
            self._begin_micro_batch(tensors)
            if tensors is not None:  # also on a carried step: a postmortem reads its graph (``observe_failure``)
                guard.run("activations", self._tracker.ignore, tensors)
        else:
            if not self._batches:
                self._begin_micro_batch(None)
            if self._tree.version != self._tree_seen and self.measures("census"):
                changed = bool(guard.run("census", self._refresh))  # a head added inside the step
        if self._session.paused_between:
            # the source starts again for the step's next micro-batch, with its batch among the roots
            self._session.resume(self._roots(batch if name == "batch_start" else None))
        carried = self._batches.carried[-1]
        if carried is not None:
            counted = self._batches.follow(name, changed)
            if counted is not None:
                return self._carry(name, carried.step, counted, output)
        if name == "before_backward" and self.measures("activations"):
            if output is None:
                self._step_note(NO_OUTPUT)
            else:
                self.observe_output(output)
        reading = self.read_source()
        if self._recorder is not None:
            self._guard.run("timeline", self._mark, name, batch if name == "batch_start" else None)
        if not self.measures("census"):
            return None
        # Optimizer state appears only inside optimizer.step() and is then updated in place,
        # so it is recounted when an optimizer's state gains entries, and on measured steps.
        signature = tuple(len(local_optimizer(optimizer).state) for optimizer in self.optimizers)
        recount = self._state_bytes is None or signature != self._state_signature
        recount = recount or (self.measure and name in ("batch_start", "batch_end"))
        tracker = self._tracker if self.measures("activations") else None
        state = None if recount else self._state_bytes
        tenants = guard.run("census", self._counter.count, tracker, state)
        if tenants is None:
            return None
        self._state_bytes = tenants["optimizer_state"]
        self._state_signature = signature
        report = PhaseReport(
            name,
            tenants,
            reading.allocated_bytes,
            reading.window_peak_bytes,
            reading.reserved_bytes,
            parts_bytes=self._read_parts(),
            reserved_peak_bytes=reading.reserved_peak_bytes,
        )
        self._batches.counted_phase(name, report, reading)
        self._last = report
        return report

    def observe_output(self, output: Any) -> None:
        """Read what the graph of ``output`` saved for backward into the activations tenant.

        ``phase("before_backward", output=loss)`` calls it; call it yourself for a second output
        whose graph is separate (an auxiliary loss backwarded on its own). Nothing is unpacked,
        so nothing is recomputed and the user's saved-tensor hooks are not called.

        Args:
            output: the loss or any output: a tensor, or a collection holding tensors.
        """
        if not self.measures("activations"):
            return
        tracker = self._tracker
        tracker.observe(output)  # never raises: a failure is kept in ``error``
        if tracker.error is not None:
            self._guard.disable("activations", tracker.error)
            return
        if tracker.compiled and not self.source.sees_compiled_code and self.unmeasured_reason is None:
            self.unmeasured_reason = COMPILED_REASON
            self._warn(f"memtenants: {COMPILED_REASON}")
            self._session.stop()
        if self._session.measuring:
            self._session.adopt(tracker.storages())

    def observe_failure(self, error: BaseException) -> None:
        """Read the graphs still held by the frames of ``error``'s traceback (an OOM inside the forward).

        Before ``before_backward`` there is no loss to read; the frames from the training step down to
        the operator that failed hold the forward's intermediate tensors, and their graphs hold what was
        saved so far. Only a postmortem does this.

        Args:
            error: the exception the step failed with.
        """
        outputs: list[Any] = []
        tb = error.__traceback__
        while tb is not None:
            outputs.extend(tb.tb_frame.f_locals.values())
            tb = tb.tb_next
        self.observe_output(outputs)

    def skip_step(self) -> None:
        """Drop a step that will never end (a batch Lightning skipped); its measurement stops here."""
        self._batches.drop()
        self._step_notes = []
        self._tracker.clear()
        self._tracker.reset_counts()
        self._drop_recorder()
        self._session.pause()

    abandon_step = skip_step

    def end_step(self, step: int | None = None) -> StepReport | None:
        """Close the optimizer step that the phases since the last call belong to.

        Args:
            step: the number the report carries (the trainer's global step); ``None`` counts the
                steps this monitor has closed.

        Returns:
            The step's report, or ``None`` where no phase was measured.

        Raises:
            ValueError: if ``step`` is not None or an int of 0 or more.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be None or a step number (an int, 0 or more), got {brief(step)}")
        ended = self._batches.end()
        read = self._session.measuring
        micro, carried = ended.phases, ended.carried
        self._tracker.clear()
        recorder = self._drop_recorder()
        self._session.pause()
        number = self.steps_done if step is None else step
        self.steps_done += 1
        counts = self._graph_counts()
        step_notes, self._step_notes = self._step_notes, []
        if read and not self._hooks_allowed:  # a measured step whose every micro-batch's graph was read
            walked = micro and all(c is None for c in carried) and all("before_backward" in mb for mb in micro)
            self._hooks_allowed = bool(walked) and NO_OUTPUT not in step_notes and self._no_compiled_code(counts)
        light = self.unmeasured_reason is None and bool(carried) and None not in carried
        readings = ended.readings() if light and read else ()
        if light and self._light is not None:
            last_carried, last_notes, last_readings, last = self._light
            same = len(carried) == len(last_carried) and all(a is b for a, b in zip(carried, last_carried))  # noqa: B905
            if same and step_notes == last_notes and counts == last.graph and readings == last_readings:
                return last.renumbered(number)  # the same counted micro-batches, read the same: the same report
        notes = [*self._notes, *graph_notes(counts, self.device.type), *_carried_notes(carried, ended.diverged)]
        notes += step_notes
        phases: dict[Phase, PhaseReport] = {}
        for batch_phases in micro:
            phases.update(batch_phases)
        if not phases:
            return None
        if self.unmeasured_reason is not None:  # readings taken before we knew cannot be trusted either
            micro = [{name: p.unmeasured() for name, p in mb.items()} for mb in micro]
            phases = {name: p.unmeasured() for name, p in phases.items()}
            ended = ended._replace(phases=micro)
        high: dict[Tenant, int] = {t: max(p.tenants_bytes[t] for mb in micro for p in mb.values()) for t in TENANTS}
        measured = (phases.get("batch_end") or list(phases.values())[-1]).tenants_bytes
        expected, fixed_notes = None, []
        checked = self._guard.run("fixed cost", self._check_fixed, measured)
        if checked is not None:
            expected, fixed_notes = checked
        peak, peak_phase = ended.peak()
        memory_source = self.source.status if peak is not None else "not measured"
        timeline = None
        if recorder is not None and peak is not None:  # finished first: the explanation and the split read it
            timeline = self._guard.run("timeline", recorder.finish, number, memory_source)
        by_module: dict[str, int] = {}
        by_module_at = ""
        if timeline is not None:  # only on steps that record a timeline: no work on the others
            split = self._guard.run("timeline", timeline.activations_by_module)
            if split is not None:
                by_module_at, by_module = split
        if peak is None:
            explanation = "peak not measured: " + (self.unmeasured_reason or "no memory source measured this step")
        else:
            explanation = self._guard.run("peak explanation", self._explain_peak, phases, peak_phase, peak, timeline)
        report = StepReport(
            step=number,
            phases=phases,
            micro_batches=micro,
            tenants_bytes=high,
            expected_fixed_bytes=expected,
            measured_fixed_bytes=fixed_bytes(measured),
            fixed_cost_notes=fixed_notes,
            peak_bytes=peak,
            peak_phase=peak_phase,
            peak_explanation=explanation or "peak not explained",
            memory_source=memory_source,
            notes=notes,
            graph=counts,
            tenants_from_step=ended.tenants_from_step,
            activations_by_module_bytes=by_module,
            activations_by_module_at=by_module_at if by_module else "",
        )
        self._batches.keep(number, ended)
        self._light = (carried, step_notes, readings, report) if light else None
        if timeline is not None:
            keep_timeline(report, timeline)
        return report

    def close(self) -> None:
        """Remove every hook and mode this monitor registered; safe to call more than once."""
        self._tracker.clear()
        self._batches.clear()
        self._tree.close()
        self._light = None
        self._step_notes = []
        self._tracker.reset_counts()
        self._state_bytes = None
        self._drop_recorder()
        self._session.close()

    # -- inside ----------------------------------------------------------------------------------

    def _begin_step(self, batch: Any) -> None:
        """Open a step: the memory source measures it where asked (and a costly one, with its timeline)."""
        session = self._session
        if session.begin(self.unmeasured_reason is None and (self.measure or self.source.every_step)):
            if self.record_timeline and isinstance(self.source, TrackerSource) and self.measures("timeline"):
                # module paths from hooks on the modules: in a dry run, and on a training model that holds no
                # torch.compile'd part, from its second measured step on, once a step's graph showed no compiled
                # code (a compiled function calling the modules): the hooks would change what torch.compile
                # compiles (its guards read them), and measuring never changes the program
                hookable = self._hooks_allowed and not holds_compiled_code(self.module)
                hookable = hookable and self.timeline_module_paths
                named = self.module if self.source.tracker.count_fake or hookable else None
                self._recorder = TimelineRecorder(named)
                self._recorder.attach(self.source.tracker)
            if not session.start(self._roots(batch)):
                self._drop_recorder()

    def _begin_micro_batch(self, batch: list[Tensor] | None) -> None:
        """Open a micro-batch: its key, and the counted micro-batch it carries where the step is not measured."""
        batches = self._batches
        batches.open()
        key = self._guard.run("census", batches.key, batch, self.module, self._counter.tensors)
        counts = self.measure or self.count_every_step or batches.count_this_step
        batches.assign(key, carry=not counts and self.measures("census"))

    def _carry(self, name: Phase, step: int, counted: CountedPhase, output: Any) -> PhaseReport:
        """A phase of a carried micro-batch: the counted tenants and parts, with what the source reads now.

        Where the source reads every step (CUDA) and reads otherwise than on the counted step, the step says so and
        the next step is counted.
        """
        if name == "before_backward" and output is None and self.measures("activations"):
            self._step_note(NO_OUTPUT)
        report = counted.report  # kept without readings: where the source does not measure this step, it is the phase
        if self._session.measuring:
            reading = self.read_source()
            report = PhaseReport(
                name,
                report.tenants_bytes,
                reading.allocated_bytes,
                reading.window_peak_bytes,
                reading.reserved_bytes,
                report.parts_bytes,
                reading.reserved_peak_bytes,
            )
            now = compared(name, reading)
            if counted.reading is not None and now != counted.reading and not self._batches.count_next:
                self._batches.count_next = True
                self._step_note(readings_note(step, name, now, counted.reading))
        self._batches.carried_phase(name, report)
        self._last = report
        return report

    def _refresh(self) -> bool:
        """Read the module's parameters and buffers again; whether they changed (one added, removed or replaced)."""
        before = self._counter.tensors
        self._tree_seen = self._tree.version
        self._counter.refresh()
        tensors = self._counter.tensors
        self._tracker.params = self._counter.param_ids()
        self._read_sizes()
        return len(before) != len(tensors) or not all(map(is_, before, tensors))

    def _read_sizes(self) -> None:
        """The tensors' bytes, and the parameters among them (they come first), for the key and the structure."""
        self._batches.read_sizes(self._counter.tensors, sum(1 for _ in self.module.parameters()))

    def _drop_recorder(self) -> TimelineRecorder | None:
        """Stop the step's timeline recorder (its hooks go); the recorder, to finish, or None."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.detach()
        return recorder

    def _mark(self, name: Phase, batch: Any = None) -> None:
        """A phase boundary on the timeline, with the storages of the tenants known now (and of the batch)."""
        assert self._recorder is not None
        tensors = self._counter.tensors
        activations = self.measures("activations")
        saved = self._tracker.storages() if activations else []
        # autocast's saved casts of weights: the ``autocast_cache`` part, not the activations split by module
        casts = [ref() for ref, _ in self._tracker._casts.values()] if activations else []
        keys = tenant_keys(
            tensors,
            (t.grad for t in tensors if t.grad is not None),
            optimizer_state_tensors(self.optimizers, self.host_state),
            saved,
            [storage for storage in casts if storage is not None],
            batch_tensors(batch) if batch is not None else (),
            self._counter.untenanted(),
        )
        self._recorder.mark(name, keys)

    def _released(self, part: str) -> None:
        """What a disabled part held goes (the guard calls this)."""
        if part == "activations":
            self._tracker.clear()
        if part == "memory source":
            self._session.stop()
        if part == "timeline":
            self._drop_recorder()

    def _read_parts(self) -> dict[Part, int]:
        parts: dict[Part, int] = {}
        if self.measures("activations"):
            casts = self._tracker.cast_bytes()
            if casts:
                parts["autocast_cache"] = casts
        for name, read in self._parts.items():
            value = self._guard.run(name, read)
            if value is not None:
                parts[name] = value
        return parts

    def _step_note(self, note: str) -> None:
        if note not in self._step_notes:
            self._step_notes.append(note)

    def _graph_counts(self) -> GraphCounts:
        """What the graph walks of the step found; the tracker's counts start again from here."""
        counts = self._tracker.counts()
        self._tracker.reset_counts()
        return counts

    def _roots(self, batch: Any) -> Iterator[Tensor]:
        params = list(self.module.parameters())
        yield from params
        yield from self.module.buffers()
        yield from (p.grad for p in params if p.grad is not None)
        yield from optimizer_state_tensors(self.optimizers)
        if batch is not None:
            yield from batch_tensors(batch)

    def _check_fixed(self, measured: dict[Tenant, int]) -> tuple[int, list[str]]:
        """The formula and its sentences; recomputed on measured steps or when the census changes."""
        key = (measured["weights"], measured["gradients"], measured["optimizer_state"])
        if self._fixed is not None and self._fixed[0] == key and not self.measure:
            return self._fixed[1][0], list(self._fixed[1][1])
        expected = expected_fixed_cost(self.module, self.optimizers, self.host_state)
        result = (expected.total_bytes, explain_fixed_cost(expected, measured, self.module, self.optimizers))
        self._fixed = (key, result)
        return result[0], list(result[1])

    def _no_compiled_code(self, counts: GraphCounts) -> bool:
        """Whether the step's graphs, read in full, held no torch.compile'd code (and nothing disabled the read)."""
        return not counts.compiled and self.unmeasured_reason is None and self.measures("activations")

    def _explain_peak(
        self,
        phases: dict[Phase, PhaseReport],
        peak_phase: Phase | None,
        peak: int | None,
        timeline: StepTimeline | None = None,
    ) -> str:
        """The analysis's sentence on the peak; a peak in the forward pass names the operator and its module.

        The module comes from the step's timeline (where one was recorded): the innermost module whose forward
        allocated the peak's bytes, or ``outside any module`` (a loss computed outside the model).
        """
        sizes = [t.numel() * t.element_size() for t in self._counter.tensors if t.requires_grad]
        text = explain_peak(
            phases,
            peak_phase,
            peak,
            largest_parameter_bytes=max(sizes, default=0),
            optimizer=describe_optimizers(self.optimizers),
            expected_temporaries_bytes=sum(step_temporaries_bytes(o) for o in self.optimizers),
            gathered_bytes=fsdp_gathered_bytes(self.module),
        )
        forward = f"peak inside {WINDOWS['before_backward']}"
        if (
            timeline is not None
            and timeline.module_paths
            and peak_phase == "before_backward"
            and text.startswith(forward)
        ):
            where = f"in {timeline.peak_module}" if timeline.peak_in_module else "outside any module"
            text = f"{forward}, at {timeline.peak_op} {where}{text[len(forward) :]}"
        return text


def holds_compiled_code(module: nn.Module) -> bool:
    """Whether ``module`` holds ``torch.compile``'d parts: an ``OptimizedModule``, ``Module.compile()``,
    or Lightning's record of a compiled LightningModule (``_compiler_ctx``).

    Args:
        module: the model; every submodule is looked at.

    Returns:
        True where any part of it is compiled.
    """
    return any(compiled_in_place(sub) or compiled_by_lightning(sub) for sub in module.modules())


def describe_optimizers(optimizers: Sequence[Optimizer]) -> str:
    """Each optimizer's class and the implementation its step runs: single-tensor, foreach or fused.

    Args:
        optimizers: the optimizers; a ZeroRedundancyOptimizer is named by its local one.

    Returns:
        A comma-separated list such as ``"AdamW (foreach)"``, or ``"no optimizer"``.
    """
    names = [f"{type(local_optimizer(o)).__name__} ({optimizer_implementation(o)})" for o in optimizers]
    return ", ".join(names) or "no optimizer"


def _carried_notes(carried: list[CountedBatch | None], partly: list[Diverged]) -> list[str]:
    """The notes of a step whose micro-batches carried tenants: one per step carried from, one per divergence."""
    of = len(carried)
    by_step: dict[int, list[int]] = {}
    for index, counted in enumerate(carried):
        if counted is not None:
            by_step.setdefault(counted.step, []).append(index)
    notes = [carried_note(step, indices, of) for step, indices in by_step.items()]
    notes += [diverged_note(step, name, why, index, of, banned=banned) for index, step, name, why, banned in partly]
    return notes
