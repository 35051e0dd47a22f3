"""MemoryTenantsCallback: thin Lightning wiring over :class:`TenantMonitor`."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.memory import is_oom_error
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_memtenants.alerts import (
    LeakDetector,
    MemoryBudgetError,
    describe_error,
    device_budget_bytes,
    first_step_jump_bytes,
    optimizer_step_temporaries_bytes,
    ranked_fixes,
    write_postmortem,
)
from lightning_memtenants.census import batch_tensors, take_census
from lightning_memtenants.distributed import gather_rank_metrics
from lightning_memtenants.engines import ddp_notes_and_part, precision_notes, scaler_part, sharding_notes
from lightning_memtenants.forecast import (
    PeakForecast,
    batch_elements,
    brief,
    parse_bytes,
    positive_int,
    positive_number,
)
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.report import PHASES, WINDOW_NAMES, MiB, StepReport, format_table
from lightning_memtenants.sources import MemorySource, TrackerSource, source_for
from lightning_memtenants.tensorboard import TensorBoardPanels

_SOURCES = ("auto", "tracker", "none")
# Under manual optimization a step that no optimizer ends is closed after this many batches.
MANUAL_ACCUMULATION_BOUND = 64


class MemoryTenantsCallback(Callback):
    r"""Tell what is using training memory: weights, gradients, optimizer state and activations.

    At every phase of every training batch (``batch_start``, ``before_backward``,
    ``after_backward``, ``before_optimizer_step``, ``batch_end``) the callback counts each
    tenant's bytes from the tensors themselves and checks the fixed cost against the formula
    for the optimizer and dtypes in use. A memory source adds allocated bytes and the peak of
    each phase window, so the step's true peak can be set against the sum of its tenants.
    Scalars go to the trainer's loggers on logging steps under ``memtenants/``; a table is
    printed at the end of fit.

    Args:
        track_activations: count what autograd saves for backward, read from the loss's graph
            at ``before_backward`` (no hook is installed).
        memory_source: ``"auto"`` uses the allocator's counters on CUDA and other accelerators
            (every step) and the live-tensor tracker on CPU (logging steps only); ``"tracker"``
            forces the tracker; ``"none"`` measures tenants only. A :class:`MemorySource` is
            used as given.
        track_every_step: run a costly source (the tracker) on every step, not only on
            logging steps.
        budget_bytes: the memory the step may use, in bytes or a string like ``"24GiB"``.
            ``None`` uses the CUDA device's total (reduced by ``set_per_process_memory_fraction``);
            on CPU there is no budget unless given, and no headroom warnings.
        margin: the fraction of the budget kept free for allocator rounding; warnings fire
            when a prediction passes ``budget x (1 - margin)``.
        strict: raise :class:`MemoryBudgetError` instead of warning when the first optimizer
            step is predicted not to fit.
        postmortem_dir: where an OOM postmortem is written; ``None`` uses the logger's
            directory, else the working directory.
        record_history: on CUDA, record the allocator's history and dump a snapshot for
            pytorch.org/memory_viz next to the postmortem.
        log_every_n_steps: log every this many optimizer steps; ``None`` follows the
            trainer's ``log_every_n_steps``.
        print_summary: print the table of the last step at the end of fit.
        desk_every_n_logs: with a TensorBoardLogger, log the desk picture on every this-many-th
            logging step (the first included); ``0``: only at the end of fit.
        reset_peak_stats: on CUDA and other accelerators, reset the allocator's peak counter at
            every phase boundary, which gives exact window peaks but also resets what the rest of
            the process reads from ``max_memory_allocated()``; the run's highest reading stays in
            ``run_peak_bytes``. ``False`` leaves the counter alone, and a window's peak is then
            measured only where it set a new high.

    Raises:
        ValueError: if an argument has the wrong type or value.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_memtenants import MemoryTenantsCallback
        >>> memtenants = MemoryTenantsCallback()
        >>> trainer = Trainer(callbacks=[memtenants])

    After ``trainer.fit(model)``, ``memtenants.latest.tenants_bytes`` holds the high-water mark
    of each tenant during the last optimizer step.
    """

    def __init__(
        self,
        *,
        track_activations: bool = True,
        memory_source: str | MemorySource = "auto",
        track_every_step: bool = False,
        log_every_n_steps: int | None = None,
        print_summary: bool = True,
        budget_bytes: int | str | None = None,
        margin: float = 0.05,
        strict: bool = False,
        postmortem_dir: str | os.PathLike[str] | None = None,
        record_history: bool = False,
        desk_every_n_logs: int = 10,
        reset_peak_stats: bool = True,
    ) -> None:
        flags = {"track_activations": track_activations, "track_every_step": track_every_step}
        flags.update(print_summary=print_summary, strict=strict, record_history=record_history)
        flags.update(reset_peak_stats=reset_peak_stats)
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be None or a positive int, got {log_every_n_steps!r}")
        if not isinstance(memory_source, MemorySource) and not (
            isinstance(memory_source, str) and memory_source in _SOURCES
        ):
            raise ValueError(f"memory_source must be one of {_SOURCES} or a MemorySource, got {brief(memory_source)}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be a fraction of the budget in [0, 1), got {margin!r}")
        if isinstance(desk_every_n_logs, bool) or not isinstance(desk_every_n_logs, int) or desk_every_n_logs < 0:
            raise ValueError(f"desk_every_n_logs must be an int >= 0 (0: only at the end), got {desk_every_n_logs!r}")
        if postmortem_dir is not None and (
            not isinstance(postmortem_dir, (str, os.PathLike)) or not os.fspath(postmortem_dir)
        ):
            raise ValueError(f"postmortem_dir must be None or a non-empty path, got {brief(postmortem_dir)}")
        self.budget_bytes = None if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        self.margin = float(margin)
        self.strict = strict
        self.postmortem_dir = postmortem_dir
        self.record_history = record_history
        self.reset_peak_stats = reset_peak_stats
        self.postmortem_path: Path | None = None
        self._log_dir: str | None = None
        self._open_batch = False
        self._step = 0
        self._last_step: int | None = None
        self._rank, self._world_size = 0, 1
        self.forecast = PeakForecast()
        self.leaks = LeakDetector()
        self._budget: int | None = None
        self._warned: set[str] = set()
        self._batch: tuple[int, int, int] = (0, 0, 0)
        self._recording = False
        self.track_activations = track_activations
        self.memory_source = memory_source
        self.track_every_step = track_every_step
        self.log_every_n_steps = log_every_n_steps
        self.print_summary = print_summary
        self.desk_every_n_logs = desk_every_n_logs
        self._panels: TensorBoardPanels | None = None
        self.latest: StepReport | None = None
        self.latest_measured: StepReport | None = None
        self.first: StepReport | None = None
        self._monitor: TenantMonitor | None = None
        self._stepped = False
        self._step_hooks: list[Any] = []
        self._step_bound = 1
        self._source: MemorySource | None = None  # kept past fit for run_peak_bytes; it holds no tensor

    @property
    def state_key(self) -> str:
        """One key per configuration, as Lightning's own callbacks build it, so two differently set up
        instances can share a Trainer and its checkpoints."""
        source = self.memory_source if isinstance(self.memory_source, str) else type(self.memory_source).__name__
        return self._generate_state_key(
            memory_source=source,
            track_activations=self.track_activations,
            track_every_step=self.track_every_step,
            log_every_n_steps=self.log_every_n_steps,
            budget_bytes=self.budget_bytes,
            margin=self.margin,
            strict=self.strict,
        )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # each fit starts afresh; a fit resumed from a checkpoint gets its state back in load_state_dict,
            # which Lightning calls after setup
            self.forecast = PeakForecast()
            self.leaks = LeakDetector()
            self.postmortem_path = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(release=True)
        self.latest = self.latest_measured = self.first = None
        self._open_batch, self._last_step, self._step = False, None, 0
        self._rank, self._world_size = int(trainer.global_rank), int(trainer.world_size)
        # read here, where every rank runs the same hook: ``trainer.log_dir`` is a broadcast, and a failure
        # path (the postmortem) must never call a collective while another rank waits in backward
        self._log_dir = None
        if self.postmortem_dir is None:
            try:
                self._log_dir = trainer.log_dir
            except Exception as error:  # a logger of the user's whose directory cannot be read: the working one
                rank_zero_warn(f"memtenants: the logger's directory cannot be read ({describe_error(error)})")
        optimizers: list[Optimizer] = list(trainer.optimizers)
        source: str | MemorySource | None = self.memory_source
        if source == "tracker":
            source = TrackerSource(pl_module.device.type)
        elif source == "none":
            source = None
        elif source == "auto":
            source = source_for(pl_module.device, reset_peaks=self.reset_peak_stats)
        self._monitor = TenantMonitor(
            pl_module,
            optimizers,
            track_activations=self.track_activations,
            source=source,
            device=pl_module.device,
            warn=rank_zero_warn,
        )
        self._source = self._monitor.source
        self._monitor.guard("precision and strategy", self._describe_engines, trainer, pl_module)
        # An optimizer step ends a step: Lightning's hook sees its own steps, a post hook on each optimizer also
        # sees a raw ``.step()`` (``self.optimizers(use_pl_optimizer=False)``). Without one, a step ends after the
        # accumulation Lightning was asked for, or under manual optimization after every batch where it knows
        # no optimizer, else after at most MANUAL_ACCUMULATION_BOUND batches.
        real = [o for o in optimizers if type(o).__name__ != "_MockOptimizer"]
        self._step_hooks = [o.register_step_post_hook(self._optimizer_stepped) for o in real]
        if pl_module.automatic_optimization:
            self._step_bound = max(int(trainer.accumulate_grad_batches or 1), 1)
        else:
            self._step_bound = MANUAL_ACCUMULATION_BOUND if real else 1
        self._rank_metrics: dict[str, float] = {}
        self._warned = set()
        self._budget = self.budget_bytes or device_budget_bytes(pl_module.device)
        if self.record_history and pl_module.device.type == "cuda":
            self._recording = bool(self._monitor.guard("allocator history", _start_history))
        self._panels = self._monitor.guard("tensorboard panels", self._open_panels, trainer)
        if self._panels is not None:
            self._panels.write_layout()

    @property
    def budget(self) -> int | None:
        """The budget in bytes this run checks against (before the margin), or None."""
        return self._budget

    @property
    def run_peak_bytes(self) -> int | None:
        """The highest allocated bytes the memory source saw in the last fit, or None.

        On CUDA it includes what ``max_memory_allocated()`` held when the callback first reset it, so it
        stands in for the counter a script reads at the end.
        """
        return None if self._source is None else self._source.run_peak_bytes

    def predict_peak_bytes(self, batch_size: int) -> int | None:
        """The predicted step peak for ``batch_size`` samples, from the steps measured so far.

        Args:
            batch_size: samples in the batch, a positive integer.

        Returns:
            The predicted peak in bytes, or ``None`` before a step was measured.

        Raises:
            ValueError: if ``batch_size`` is not a positive integer.
        """
        return self.forecast.predict_peak_bytes(positive_int(batch_size, "batch_size"))

    def max_batch_size(
        self, budget_bytes: int | str | None = None, *, elements_per_sample: float | None = None
    ) -> int | None:
        """The largest batch whose predicted peak fits the budget (after the margin).

        Args:
            budget_bytes: bytes or a string like ``"80GiB"``; ``None`` uses the run's budget.
            elements_per_sample: input elements per sample (e.g. the longest sequence in the
                dataset); ``None`` sizes samples as the longest seen so far.

        Returns:
            The batch size, or ``None`` without a budget or before a step was measured.

        Raises:
            ValueError: if an argument is not a positive number.
        """
        budget = self._budget if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        if elements_per_sample is not None:
            elements_per_sample = positive_number(elements_per_sample, "elements_per_sample")
        if budget is None:
            return None
        return self.forecast.max_batch_size(int(budget * (1 - self.margin)), elements_per_sample)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        if self._open_batch:  # the last batch never ended: Lightning skipped it (on_train_batch_start gave -1)
            monitor.abandon_step()
        self._open_batch = True
        if monitor.pending_micro_batches == 0:
            self._stepped = False
            self._step = self._step_number(trainer)
            monitor.measure = self.track_every_step or self._logs_step(trainer, self._step)
        sized = monitor.guard("forecast", _batch_size, batch)
        if sized is not None:
            elements, _nbytes, samples = sized
            if self.forecast.ready and elements > self.forecast.largest_elements:
                projected = self.forecast.predict_for_elements(elements)
                if projected is not None:
                    self._check(
                        "larger batch",
                        projected,
                        f"batch {batch_idx} is the largest yet ({samples} samples, {elements:,} elements, was"
                        f" {self.forecast.largest_elements:,}); its projected peak",
                        "cap the batch size or the sequence length, or sort and bucket samples by length",
                    )
        self._batch = sized if sized is not None else (0, 0, 0)
        self._phase("batch_start", batch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._phase("before_backward", output=loss)
        monitor = self._monitor
        if monitor is not None and self._budget is not None and "forecast" not in monitor.disabled:
            projected = monitor.guard("forecast", self._project_backward)
            if projected is not None:
                self._check(
                    "backward",
                    projected,
                    "the projected peak of this batch's backward and optimizer step",
                    "lower the batch size, or use activation checkpointing or bf16-mixed",
                )

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase("after_backward")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._stepped = True
        self._phase("before_optimizer_step")
        monitor = self._monitor
        if monitor is not None and monitor.steps_done == 0 and self._budget is not None:
            projected = monitor.guard("forecast", self._project_first_step)
            if projected is not None:
                total, state, temporaries = projected
                self._check(
                    "first step",
                    total,
                    f"the first optimizer step adds {state / MiB:.2f} MiB of optimizer state and about"
                    f" {temporaries / MiB:.2f} MiB of temporaries; its projected peak",
                    "shard the optimizer state (ZeRO or FSDP), use fused=True, or an optimizer with less state",
                    strict=self.strict,
                )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        self._open_batch = False
        self._phase("batch_end")
        if not (self._stepped or monitor.pending_micro_batches >= self._step_bound):
            return
        report = monitor.end_step(self._step)
        self._last_step = self._step
        if trainer.world_size > 1 and bool(trainer.loggers) and self._logs_step(trainer, self._step):
            # every rank takes part on the same steps, whatever its own measurement did, so none waits
            self._rank_metrics = _gather_or_warn(trainer, report)
        if report is None:
            return
        self.latest = report
        if report.peak_bytes is not None:
            self.latest_measured = report
            elements, nbytes, samples = self._batch
            monitor.guard("forecast", self.forecast.observe, report, elements, nbytes, samples)
            start = report.micro_batches[0].get("batch_start")
            if start is not None and start.allocated_bytes is not None:
                leak = monitor.guard("leak detection", self.leaks.observe, report.step, start)
                if leak and "leak" not in self._warned:
                    self._warned.add("leak")
                    rank_zero_warn(leak)
        if self.first is None:
            self.first = report
        if self._should_log(trainer, report):
            self._log(trainer, report)
        headroom = self._headroom(report)
        if headroom is not None:
            monitor.guard("progress bar", _show_headroom, pl_module, headroom)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._open_batch and self._monitor is not None:  # the epoch stopped inside a batch: it never ends
            self._open_batch = False
            self._monitor.abandon_step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        if self._panels is not None and self.latest is not None:
            reports = [self.latest] if self.first in (None, self.latest) else [self.first, self.latest]
            desk = self.latest_measured or self.latest
            self._panels.on_fit_end(reports, _logged_step(trainer), self._budget, desk)
        if self.print_summary and self.latest is not None:
            if self.first is not None and self.first is not self.latest:
                rank_zero_info(format_table(self.first))
            rank_zero_info(format_table(self.latest))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Never raises and never talks to other ranks: the user's exception goes on as it is, and a rank that
        # failed leaves as fast as it would without us while the others wait in a collective.
        try:
            monitor = self._monitor
            if monitor is not None and is_out_of_memory(exception):
                written = monitor.guard("postmortem", self._postmortem, trainer, pl_module, exception)
                if written is not None and self._panels is not None:
                    self._panels.on_postmortem(written, _logged_step(trainer), self.latest)
        except Exception as error:  # the postmortem is a courtesy; the user's own exception matters
            rank_zero_warn(f"memtenants: the postmortem failed ({describe_error(error)})")
        finally:
            self._close(release=True)
            self._unbind()

    def state_dict(self) -> dict[str, Any]:
        return {"forecast": self.forecast.state_dict(), "leaks": self.leaks.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the forecast and the leak baseline that ``state_dict`` saved (a resumed fit).

        Raises:
            ValueError: if ``state_dict`` is not a dict saved by ``state_dict()``; nothing changes then.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(
                f"state_dict must be a dict saved by MemoryTenantsCallback.state_dict(), got {brief(state_dict)}"
            )
        forecast, leaks = PeakForecast(), LeakDetector()
        for name, part in (("forecast", forecast), ("leaks", leaks)):
            value = state_dict.get(name, {})
            if not isinstance(value, dict):
                raise ValueError(f"state_dict[{name!r}] must be a dict, got {brief(value)}")
            part.load_state_dict(value)
        self.forecast, self.leaks = forecast, leaks

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(release=True)
        self._unbind()

    def _unbind(self) -> None:
        """Drop ``log`` and ``log_dict``, which Lightning binds from the module onto every callback and pops only
        in a teardown that does not run after an exception: a finished callback keeps no module alive."""
        for name in ("log", "log_dict"):
            self.__dict__.pop(name, None)

    def _phase(self, name: str, batch: Any = None, output: Any = None) -> None:
        """Hand one phase boundary to the core."""
        if self._monitor is not None:
            self._monitor.phase(name, batch, output)

    def _optimizer_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _step_number(self, trainer: pl.Trainer) -> int:
        """The trainer's global step; one past the last report where Lightning counted no step (an optimizer it
        never sees, under manual optimization)."""
        step = int(trainer.global_step)
        if self._last_step is not None and step <= self._last_step:
            step = self._last_step + 1
        return step

    def _close(self, release: bool = False) -> None:
        """Remove our hooks; ``release`` also drops the module and optimizers we point to."""
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []
        monitor = self._monitor
        if monitor is None:
            return
        try:
            monitor.close()
        finally:
            if self._recording:
                self._recording = False
                monitor.guard("allocator history", torch.cuda.memory._record_memory_history, None)
            if release:
                self._monitor = None
                self._panels = None

    def _logs_step(self, trainer: pl.Trainer, step: int) -> bool:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        return every > 0 and step % every == 0

    def _should_log(self, trainer: pl.Trainer, report: StepReport) -> bool:
        return bool(trainer.loggers) and self._logs_step(trainer, report.step)

    def _log(self, trainer: pl.Trainer, report: StepReport) -> None:
        monitor = self._monitor
        if monitor is None or "logging" in monitor.disabled:
            return
        metrics = report.metrics()
        headroom = self._headroom(report)
        if headroom is not None:
            metrics["memtenants/headroom_MiB"] = headroom / MiB
        largest = self.max_batch_size() if self.forecast.ready else None
        if largest is not None:
            metrics["memtenants/max_batch_size"] = float(largest)
        metrics.update(self._rank_metrics)
        step = _logged_step(trainer)
        for logger in trainer.loggers:
            monitor.guard("logging", logger.log_metrics, dict(sorted(metrics.items())), step)
        if self._panels is not None:
            self._panels.on_log(report, step, self._budget)

    def _describe_engines(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Sentences and named parts from the precision plugin (GradScaler) and the strategy (DDP buckets)."""
        monitor = self._monitor
        assert monitor is not None
        plugin = trainer.precision_plugin
        monitor.notes = precision_notes(plugin, pl_module, pl_module.device.type)
        reader = scaler_part(plugin)
        if reader is not None:
            monitor.parts["grad_scaler"] = reader
        notes, buckets = ddp_notes_and_part(trainer.strategy.model, lambda: monitor.measure)
        monitor.notes += notes + sharding_notes(pl_module, trainer.world_size)
        if buckets is not None:
            monitor.parts["ddp_buckets"] = buckets

    def _open_panels(self, trainer: pl.Trainer) -> TensorBoardPanels | None:
        """The TensorBoard panels for this run, on rank zero; other loggers get the scalars only."""
        boards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if trainer.loggers and not boards:
            names = ", ".join(type(logger).__name__ for logger in trainer.loggers)
            rank_zero_info(
                f"memtenants: {names} gets the scalars; the layout, desk picture and summary need a TensorBoardLogger"
            )
        if not boards or not trainer.is_global_zero:
            return None
        return TensorBoardPanels(
            [logger.experiment for logger in boards],
            [logger.log_dir for logger in boards],
            desk_every_n_logs=self.desk_every_n_logs,
            guard=self._monitor.guard if self._monitor is not None else None,
        )

    def _headroom(self, report: StepReport) -> int | None:
        if self._budget is None or report.peak_bytes is None:
            return None
        return self._budget - report.peak_bytes

    def _check(self, key: str, projected: int, what: str, fix: str, strict: bool = False) -> None:
        """Warn once per kind when ``projected`` passes the budget after the margin."""
        if self._budget is None:
            return
        limit = int(self._budget * (1 - self.margin))
        if projected <= limit or key in self._warned:
            return
        self._warned.add(key)
        message = (
            f"memtenants: {what} is {projected / MiB:,.2f} MiB, over the budget of {limit / MiB:,.2f} MiB"
            f" ({self._budget / MiB:,.2f} MiB less a {self.margin:.0%} margin). Fix: {fix}."
        )
        if strict:
            raise MemoryBudgetError(message)
        rank_zero_warn(message)

    def _current_bytes(self) -> int:
        monitor = self._monitor
        assert monitor is not None
        phase = monitor.last_phase()
        if phase is None:
            return 0
        return phase.allocated_bytes if phase.allocated_bytes is not None else phase.total_bytes

    def _project_first_step(self) -> tuple[int, int, int]:
        monitor = self._monitor
        assert monitor is not None
        phase = monitor.last_phase()
        state_now = phase.tenants_bytes["optimizer_state"] if phase is not None else 0
        state, temporaries = first_step_jump_bytes(monitor.module, monitor.optimizers, state_now)
        return self._current_bytes() + state + temporaries, state, temporaries

    def _project_backward(self) -> int | None:
        monitor = self._monitor
        assert monitor is not None
        elements = self._batch[0]
        if self.forecast.ready and elements:
            return self.forecast.predict_for_elements(elements, windows=("after_backward", "batch_end"))
        phase = monitor.last_phase()
        if phase is None:
            return None
        gradients = sum(t.numel() * t.element_size() for t in monitor.counter.tensors if t.requires_grad)
        gradients -= phase.tenants_bytes["gradients"]
        state = temporaries = 0
        if monitor.steps_done == 0:
            state, temporaries = first_step_jump_bytes(
                monitor.module, monitor.optimizers, phase.tenants_bytes["optimizer_state"]
            )
        return self._current_bytes() + max(gradients, 0) + state + temporaries

    def _postmortem(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> Path:
        monitor = self._monitor
        assert monitor is not None
        last = monitor.last_phase()
        order = list(PHASES)
        failing = order[(order.index(last.name) + 1) % len(order)] if last is not None else "batch_start"
        if failing == "before_backward":  # inside the forward: its graph so far hangs off the failing frames
            monitor.observe_failure(exception)
        tenants_now = monitor.guard("census", take_census, pl_module, monitor.optimizers, monitor.tracker)
        tenants = tenants_now or (last.tenants_bytes if last is not None else {})
        reading = monitor.guard("memory source", monitor.source.read) if monitor.measuring else None
        other_now = None
        if reading is not None and reading.allocated_bytes is not None and tenants_now is not None:
            other_now = reading.allocated_bytes - sum(tenants_now.values())
        fixes = ranked_fixes(
            tenants,
            pl_module,
            monitor.optimizers,
            world_size=trainer.world_size,
            temporaries_bytes=optimizer_step_temporaries_bytes(monitor.optimizers) if failing == "batch_end" else 0,
            batch_temporaries_bytes=(other_now or 0) if failing in ("before_backward", "after_backward") else 0,
        )
        directory = self.postmortem_dir or self._log_dir or os.getcwd()
        json_path, _ = write_postmortem(
            directory,
            error=exception,
            last_phase=last,
            failing_window=WINDOW_NAMES[failing],
            tenants_now=tenants_now,
            other_now=other_now,
            fixes=fixes,
            budget_bytes=self._budget,
            step=self._step,
            rank=self._rank,
            world_size=self._world_size,
        )
        self.postmortem_path = json_path
        if self.record_history and pl_module.device.type == "cuda":
            name = "memtenants_oom_snapshot" + (f"_rank{self._rank}" if self._world_size > 1 else "") + ".pickle"
            torch.cuda.memory._dump_snapshot(str(Path(directory) / name))
        warnings.warn(f"memtenants: out of memory; postmortem written to {json_path}", stacklevel=1)
        return json_path


def _logged_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own logging uses (optimizer steps taken), so our scalars line up with the user's."""
    return getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)


def _gather_or_warn(trainer: pl.Trainer, report: StepReport | None) -> dict[str, float]:
    """Each rank's figures and their max and min; a failed collective warns and logs none of them."""
    try:
        return gather_rank_metrics(trainer.strategy, report)
    except Exception as error:  # the collective itself failed: the process group is gone, training will say so
        rank_zero_warn(f"memtenants: gathering per-rank figures failed ({type(error).__name__}: {error})")
        return {}


def _start_history() -> bool:
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    return True


def _batch_size(batch: Any) -> tuple[int, int, int] | None:
    """Elements, bytes and samples of a batch; None where it holds no tensor (the forecast then skips it).

    Samples are the leading size of the first tensor: no call to Lightning's ``extract_batch_size``,
    which warns about an ambiguous batch size to a user who never logged anything.
    """
    tensors = batch_tensors(batch)
    elements, nbytes = batch_elements(tensors)
    if not elements:
        return None
    first = next((t for t in tensors if t.dim()), None)
    return elements, nbytes, int(first.shape[0]) if first is not None else 1


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error: ``torch.OutOfMemoryError``, or what Lightning's
    ``is_oom_error`` recognises (the CPU allocator's "can't allocate memory" included).

    That function assumes ``args[0]`` is a string; this one never raises, whatever the exception holds.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    args = getattr(error, "args", ())
    return isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], str) and is_oom_error(error)


def _show_headroom(pl_module: pl.LightningModule, headroom: int) -> None:
    pl_module.log("headroom_MiB", headroom / MiB, prog_bar=True, logger=False, on_step=True, on_epoch=False)
