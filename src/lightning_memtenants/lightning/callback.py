"""MemoryTenantsCallback: the Lightning hooks, wired to the monitor and to one small part per concern."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_memtenants._private import hidden_from_function_modes, is_mock_optimizer
from lightning_memtenants.analysis.engines import ddp_notes_and_part, precision_notes, scaler_part, sharding_notes
from lightning_memtenants.checks import brief, describe_error, flag, positive_int, positive_number
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.core.sources import MemorySource, TrackerSource, device_budget_bytes, source_for
from lightning_memtenants.core.tracker import raise_pending
from lightning_memtenants.lightning.alerts import Alerts
from lightning_memtenants.lightning.logs import Logs
from lightning_memtenants.lightning.loops import EvaluationLoops
from lightning_memtenants.lightning.postmortem import Postmortem, is_out_of_memory
from lightning_memtenants.lightning.ranks import gather_or_warn
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.names import EVALUATION_STAGES, LOOP_NAMES, STAGES, Phase, Stage
from lightning_memtenants.render.table import fit_summary, fits_text, step_table, to_text
from lightning_memtenants.units import parse_bytes

if TYPE_CHECKING:
    from lightning_memtenants.analysis.forecast import PeakForecast
    from lightning_memtenants.analysis.leaks import LeakDetector
    from lightning_memtenants.predict.advise import Advice

SOURCES = ("auto", "tracker", "none")
_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _stage(stage: Any, exact: bool) -> Stage:
    """``stage`` checked: one of ``names.STAGES``, and ``"train"`` where an exact answer (a dry run) is asked."""
    if not isinstance(stage, str) or stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {brief(stage)}")
    if exact and stage != "train":
        raise ValueError(
            f"exact=True answers for stage='train' only (a dry run of training_step); a {LOOP_NAMES[stage]} batch is"
            " answered from the measured batches"  # type: ignore[index]
        )
    return stage  # type: ignore[return-value]


def _unseen(hook: _Hook) -> _Hook:
    """``hook`` with torch function modes off: a user's ``TorchFunctionMode`` around ``fit`` sees none of our reads."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        with hidden_from_function_modes():
            return hook(*args, **kwargs)

    return cast(_Hook, run)


# The attribute that holds each evaluation loop's last measured batch.
_LATEST: dict[Stage, str] = {"validate": "latest_validation", "test": "latest_test", "predict": "latest_predict"}

# Under manual optimization a step that no optimizer ends is closed after this many batches.
MANUAL_ACCUMULATION_BOUND = 64


# the settings that tell two instances apart, in the order ``state_key`` names them
_STATE_KEY_NAMES = (
    "memory_source",
    "track_activations",
    "track_every_step",
    "log_every_n_steps",
    "budget_bytes",
    "margin",
    "strict",
)


class MemoryTenantsCallback(Callback):
    r"""Tell what is using training memory: weights, gradients, optimizer state and activations.

    At every phase of every training batch (``batch_start``, ``before_backward``,
    ``after_backward``, ``before_optimizer_step``, ``batch_end``) the callback reports each
    tenant's bytes, counted from the tensors themselves, and checks the fixed cost against the
    formula for the optimizer and dtypes in use. The tenants are counted on measured steps and on
    batches of a new kind (new shapes, new optimizer state); a step that repeats one counted
    before carries its figures (``StepReport.tenants_from_step``) instead of walking the graph
    again, so that measuring costs little. A memory source adds allocated bytes and the peak of
    each phase window, so the step's true peak can be set against the sum of its tenants.
    Scalars go to the trainer's loggers on the steps Lightning logs (and the first), under
    ``memtenants`` and the logger's separator.

    Validation, test and predict batches are measured too (``batch_start`` and ``batch_end``, with the
    step's peak between them): the first four batches of each loop run and its last, or every batch on an
    accelerator or with ``track_every_step``. The budget warns before an evaluation batch that would not fit,
    an OOM in one gets a postmortem naming the loop, and each run's figures go to the loggers at its end
    under ``memtenants/validation/...`` (``test``, ``predict``; docs/tags.md).

    At the end of fit, rank zero prints a summary to standard output (``print``, where Lightning prints
    ``trainer.validate``'s and ``trainer.test``'s results, not the logging on standard error): a headline (the
    peak, the largest tenant, and the one change that lowers the peak most), the training and validation peaks
    side by side, the table of the first step and of the last step whose peak was measured, and the largest
    batch for the budget. The same summary, in markdown, goes to ``<log_dir>/memtenants_summary.md`` (beside a
    CSVLogger's ``metrics.csv``), to TensorBoard's text tab (``memtenants/summary``), and to W&B and MLflow with
    the pictures; the printed text ends with the file's path. A stand-alone ``trainer.validate``, ``test`` or
    ``predict`` prints its peak batch's table.

    Args:
        track_activations: count what autograd saves for backward, read from the loss's graph
            at ``before_backward`` (no hook is installed).
        memory_source: ``"auto"`` uses the allocator's counters on CUDA and other accelerators
            (every step) and the live-tensor tracker on CPU (logged steps only); ``"tracker"``
            forces the tracker; ``"none"`` measures tenants only. A :class:`MemorySource` is
            used as given.
        track_every_step: run a costly source (the tracker) on every step, not only on
            logged steps, and count the tenants on every step rather than carry them.
        log_every_n_steps: log every this many optimizer steps; ``None`` follows the
            trainer's ``log_every_n_steps``.
        print_summary: print the summary at the end of fit, on rank zero, to standard output: the tables of
            the first and the last measured steps, and with a budget the largest batch.
        budget_bytes: the memory the step may use, in bytes or a string like ``"24GiB"``.
            ``None`` uses the CUDA device's total (reduced by ``set_per_process_memory_fraction``);
            on CPU there is no budget unless given, and no headroom warnings.
        margin: the fraction of the budget kept free for allocator rounding; warnings fire
            when a prediction passes ``budget x (1 - margin)``.
        strict: raise :class:`MemoryBudgetError` instead of warning when the first optimizer
            step is predicted not to fit.
        postmortem_dir: where an OOM postmortem is written; ``None`` uses the logger's
            directory, else (``logger=False``) the trainer's ``default_root_dir``, which is the working
            directory unless set.
        record_history: on CUDA, record the allocator's history and dump a snapshot for
            pytorch.org/memory_viz next to the postmortem after an OOM, and in the log dir at the end of
            fit (``memtenants_snapshot.pickle``, named in the summary).
        desk_every_n_logs: with a TensorBoardLogger, log the desk and timeline pictures on every this-many-th
            logging step; ``0``: only at the end of fit. Whatever the cadence, the in-fit pictures take at most 2%
            of the fit's time and at most 50 go to the event files, the last at the end of fit (docs/tags.md).
        reset_peak_stats: on CUDA and other accelerators, reset the allocator's peak counter at
            every phase boundary, which gives exact window peaks but also resets what the rest of
            the process reads from ``max_memory_allocated()``; the run's highest reading stays in
            ``run_peak_bytes``. ``False`` leaves the counter alone, and a window's peak is then
            measured only where it set a new high.
        measure_fixes: measure the fixes by dry runs of the step (``advise``: each fix's exact peak, the user's
            ``training_step`` and ``configure_optimizers`` run under fake tensors on the CPU) in an OOM postmortem,
            after the fit has failed, where a dry run can stand for the step (one device, a known precision, a
            budget); else, or where the dry runs fail (warned once), the postmortem holds the estimates, labelled
            so. No dry run ever runs inside the fit: a budget warning gives the estimates and says how to get
            measured fixes (:meth:`advise`, after fit). It keeps a reference to the batch until its step ends.

    Attributes:
        latest: the report of the last optimizer step of the last fit, or None.
        latest_measured: the last report whose peak was measured, or None.
        first: the report of the first optimizer step, or None.
        latest_validation: the report of the last validation batch of the last run of that loop, or None;
            ``latest_test`` and ``latest_predict`` likewise. Their ``stage`` names the loop.

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
        measure_fixes: bool = False,
    ) -> None:
        self.track_activations = flag(track_activations, "track_activations")
        self.track_every_step = flag(track_every_step, "track_every_step")
        self.print_summary = flag(print_summary, "print_summary")
        self.strict = flag(strict, "strict")
        self.record_history = flag(record_history, "record_history")
        self.reset_peak_stats = flag(reset_peak_stats, "reset_peak_stats")
        self.measure_fixes = flag(measure_fixes, "measure_fixes")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be None or a positive int, got {brief(log_every_n_steps)}")
        if not isinstance(memory_source, MemorySource) and not (
            isinstance(memory_source, str) and memory_source in SOURCES
        ):
            raise ValueError(f"memory_source must be one of {SOURCES} or a MemorySource, got {brief(memory_source)}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be a fraction of the budget in [0, 1), got {brief(margin)}")
        if isinstance(desk_every_n_logs, bool) or not isinstance(desk_every_n_logs, int) or desk_every_n_logs < 0:
            raise ValueError(
                f"desk_every_n_logs must be an int >= 0 (0: only at the end), got {brief(desk_every_n_logs)}"
            )
        if postmortem_dir is not None and (
            not isinstance(postmortem_dir, (str, os.PathLike)) or not os.fspath(postmortem_dir)
        ):
            raise ValueError(f"postmortem_dir must be None or a non-empty path, got {brief(postmortem_dir)}")
        self.memory_source = memory_source
        self.log_every_n_steps = log_every_n_steps
        self.budget_bytes = None if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        self.margin = float(margin)
        self.postmortem_dir = postmortem_dir
        self.desk_every_n_logs = desk_every_n_logs
        self.latest: StepReport | None = None
        self.latest_measured: StepReport | None = None
        self.first: StepReport | None = None
        self.latest_validation: StepReport | None = None
        self.latest_test: StepReport | None = None
        self.latest_predict: StepReport | None = None
        self._alerts = self._new_alerts()
        self._logs = Logs(log_every_n_steps, desk_every_n_logs=desk_every_n_logs, warn=rank_zero_warn)
        self._postmortem = Postmortem(postmortem_dir, record_history=record_history, warn=rank_zero_warn)
        self._loops = EvaluationLoops(rank_zero_warn, every_batch=self.track_every_step)
        self._monitor: TenantMonitor | None = None
        self._source: MemorySource | None = None  # kept past fit for run_peak_bytes; it holds no tensor
        self._step_hooks: list[Any] = []
        self._step_bound = 1
        self._stepped = False
        self._open_batch = False
        self._logging_step = False
        self._cadence_step = False  # a step Lightning logs (measured), whether or not there is a logger
        self._step = 0
        self._last_step: int | None = None
        self._rank, self._world_size = 0, 1
        self._ranks: list[list[float]] = []
        self._logged_max_batch_size: int | None = None  # under DDP: the minimum over ranks, last logged
        self._gathered = False
        self._fitting = False  # between setup and teardown of a fit: no dry run of the user's step then

    # -- the public surface ----------------------------------------------------------------------

    @property
    @override
    def state_key(self) -> str:
        """One key per configuration, so that two differently set up instances can share a Trainer and its checkpoints.

        It is built as Lightning's own callbacks build theirs (``_generate_state_key``).
        """
        source = self.memory_source if isinstance(self.memory_source, str) else type(self.memory_source).__name__
        settings = (
            source,
            self.track_activations,
            self.track_every_step,
            self.log_every_n_steps,
            self.budget_bytes,
            self.margin,
            self.strict,
        )
        known = self.__dict__.get("_state_key")
        if known is None or known[0] != settings:  # Lightning asks at every hook call: built once per setting
            key = self._generate_state_key(**dict(zip(_STATE_KEY_NAMES, settings, strict=True)))
            known = self.__dict__["_state_key"] = (settings, key)
        return known[1]

    @property
    def forecast(self) -> PeakForecast:
        """The peak forecast fitted to the measured steps."""
        return self._alerts.forecast

    @property
    def leaks(self) -> LeakDetector:
        """The leak detector watching allocated bytes at batch start."""
        return self._alerts.leaks

    @property
    def budget(self) -> int | None:
        """The budget in bytes this run checks against (before the margin), or None."""
        return None if self._alerts.budget is None else self._alerts.budget.total_bytes

    @property
    def postmortem_path(self) -> Path | None:
        """The JSON postmortem written after an OOM in the last fit, or None."""
        return self._postmortem.path

    @property
    def run_peak_bytes(self) -> int | None:
        """The highest allocated bytes the memory source saw in the last fit, or None.

        On CUDA it includes what ``max_memory_allocated()`` held when the callback first reset it, so it
        stands in for the counter a script reads at the end.
        """
        return None if self._source is None else self._source.run_peak_bytes

    def predict_peak_bytes(self, batch_size: int, *, exact: bool = False, stage: str = "train") -> int | None:
        """The predicted steady-state step peak for ``batch_size`` samples, from the steps measured so far.

        As :meth:`max_batch_size`: on the CPU, scaled from a measured step's own allocations; elsewhere the
        forecast's lines. Nothing of the user's runs. ``exact=True`` runs a dry run of the step at that size now,
        under fake tensors (see :meth:`max_batch_size`), outside the fit only.

        Args:
            batch_size: samples in the batch, a positive integer.
            exact: answer by a dry run of the run's own step, under fake tensors, now.
            stage: ``"train"``, or an evaluation loop (``"validate"``, ``"test"``, ``"predict"``): a batch of that
                loop, projected from its measured batches, else from the training forward (an upper bound).

        Returns:
            The predicted peak in bytes, or ``None`` before a step was measured (without ``exact``).

        Raises:
            ValueError: if ``batch_size`` is not a positive integer, ``exact`` not a bool, ``stage`` not one of
                ``names.STAGES``, or ``exact=True`` with an evaluation stage.
            RuntimeError: with ``exact=True``, while the trainer is fitting (no dry run runs inside a fit), or where
                no dry run can stand for the step (a sharded strategy, the model freed, no measured batch) or it
                failed.
        """
        batch_size = positive_int(batch_size, "batch_size")
        exact = flag(exact, "exact")
        if _stage(stage, exact) != "train":
            return self._loops.predict_peak_bytes(stage, batch_size)  # type: ignore[arg-type]
        if exact:
            self._outside_fit("predict_peak_bytes")
            return self._alerts.exact_peak_bytes(batch_size)
        return self._alerts.predict_peak_bytes(batch_size)

    def max_batch_size(
        self,
        budget_bytes: int | str | None = None,
        *,
        elements_per_sample: float | None = None,
        exact: bool = False,
        stage: str = "train",
    ) -> int | None:
        """The largest batch whose steady-state peak fits the budget less the margin (``budget x (1 - margin)``).

        During a fit nothing of the user's runs for it: the answer comes from what the measured steps recorded.
        On the CPU (the live-tensor tracker) a measured step's timeline splits the live bytes at every moment into
        a fixed part (weights, gradients, optimizer state) and a part that grows with the batch (the batch, the
        activations, the forward's and backward's temporaries); the peak at ``b`` samples is the highest of
        ``fixed + grows * b / b0``, a first optimizer step projected to the steady state. Where it errs it errs low
        (a fixed temporary counted as growing), never above the truth. Elsewhere (CUDA: no timeline), or for an
        ``elements_per_sample`` other than the measured batch's, the forecast's lines answer.

        ``exact=True`` answers by dry runs of the run's own LightningModule step now: ``training_step`` and
        ``configure_optimizers`` run under fake tensors (``predict.dryrun.largest_batch_size``: two steps per size,
        the trainer's precision, the last measured batch resized) on a meta copy of the model made then, calibrated
        by the measured step (its peak less the dry run's at its size is what the process holds besides the step).
        It needs the model still alive (a weak reference is kept) and runs only outside the fit, after it.

        Under DDP, without arguments, it is the answer logged last: the minimum over ranks, which hold
        different batches (gathered on logging steps, with a logger). With arguments it is this rank's.

        ``stage="validate"`` (``"test"``, ``"predict"``) answers for a batch of that loop: its measured batch with the
        most samples as a line (what the loop holds besides the batch, and the batch and the step's working memory
        scaled with the samples; it errs low), else, before one was measured, the training forward's (a forward that
        keeps its graph holds more than one under ``no_grad``: it errs low too).

        Args:
            budget_bytes: bytes or a string like ``"80GiB"``; ``None`` uses the run's budget.
            elements_per_sample: input elements per sample (e.g. the longest sequence in the
                dataset); ``None`` sizes samples as the longest seen so far.
            exact: answer by dry runs of the step, under fake tensors, now (outside the fit only).
            stage: ``"train"``, or the evaluation loop whose batch is asked about.

        Returns:
            The batch size, or ``None`` without a budget or before a step was measured (without ``exact``).

        Raises:
            ValueError: if an argument is not a positive number, ``exact`` not a bool, or with ``exact=True`` there
                is no budget or ``elements_per_sample`` is not the measured batch's; if ``stage`` is not one of
                ``names.STAGES``, or an evaluation stage comes with ``exact=True`` or ``elements_per_sample``.
            RuntimeError: with ``exact=True``, while the trainer is fitting (no dry run runs inside a fit), or where
                no dry run can stand for the step (a sharded strategy, the model freed, no measured batch) or it
                failed.
        """
        budget = None if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        if elements_per_sample is not None:
            elements_per_sample = positive_number(elements_per_sample, "elements_per_sample")
        exact = flag(exact, "exact")
        if _stage(stage, exact) != "train":
            if elements_per_sample is not None:
                raise ValueError(
                    f"elements_per_sample is for stage='train' only; an evaluation batch is sized by samples, got"
                    f" {brief(elements_per_sample)} with stage={stage!r}"
                )
            return self._loops.max_batch_size(stage, budget)  # type: ignore[arg-type]
        if exact:
            self._outside_fit("max_batch_size")
            return self._alerts.exact_max_batch_size(budget, elements_per_sample)
        if self._gathered and budget is None and elements_per_sample is None:
            return self._logged_max_batch_size
        return self._alerts.max_batch_size(budget, elements_per_sample)

    def evaluation_peak(self, stage: str = "validate") -> StepReport | None:
        """The measured batch of an evaluation loop with the highest peak, over the last fit (or validate, test,
        predict): what the summary sets beside the training peak, and what ``memtenants/<loop>/...`` logs per run.

        Args:
            stage: ``"validate"``, ``"test"`` or ``"predict"``.

        Returns:
            The batch's report, or None where no batch of that loop was measured.

        Raises:
            ValueError: if ``stage`` is not an evaluation stage.
        """
        if stage not in EVALUATION_STAGES:
            raise ValueError(f"stage must be one of {EVALUATION_STAGES}, got {brief(stage)}")
        return self._loops.peaks.get(stage)  # type: ignore[call-overload]

    def advise(self, budget_bytes: int | str | None = None) -> Advice:
        """The fixes for the last measured step, each measured now by dry runs of the run's own step.

        Each candidate fix (bf16-mixed, activation checkpointing, a smaller micro-batch, the optimizer's
        implementation, cheaper optimizers) is dry-run: ``training_step`` and ``configure_optimizers`` run under fake
        tensors (``predict.advise.advise``), two steps each, on a meta copy of the model made now, for the last
        measured batch, at the trainer's precision and accumulation. It runs only outside the fit, after it (the
        model still alive): a budget warning in the fit gives the estimates and points here.

        Args:
            budget_bytes: bytes or a string like ``"24GiB"``; ``None`` uses the run's budget.

        Returns:
            The :class:`~lightning_memtenants.predict.advise.Advice`.

        Raises:
            ValueError: if ``budget_bytes`` is not a number of bytes, or there is no budget at all.
            RuntimeError: while the trainer is fitting, or where no dry run can stand for the step (a sharded
                strategy, the model freed, no measured batch) or the dry runs failed.
        """
        budget = None if budget_bytes is None else parse_bytes(budget_bytes, "budget_bytes")
        self._outside_fit("advise")
        return self._alerts.advise(budget)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The forecast and the leak baseline, saved in checkpoints so that a resumed fit goes on from them."""
        return self._alerts.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the forecast and the leak baseline that ``state_dict`` saved (a resumed fit).

        Args:
            state_dict: what :meth:`state_dict` returned.

        Raises:
            ValueError: if ``state_dict`` is not a dict saved by ``state_dict()``; nothing changes then.
        """
        self._alerts.load_state_dict(state_dict)

    # -- the hooks -----------------------------------------------------------------------------------

    @override
    @_unseen
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start each fit with a fresh forecast, leak baseline and postmortem path; each loop with fresh reports."""
        if stage == "fit":
            self._fitting = True
            # each fit starts afresh; a fit resumed from a checkpoint gets its state back in load_state_dict,
            # which Lightning calls after setup
            self._alerts = self._new_alerts()
        self._postmortem.path = None
        self._rank, self._world_size = int(trainer.global_rank), int(trainer.world_size)  # for the files' names
        loops: tuple[Stage, ...] = ("validate",) if stage == "fit" else ((stage,) if stage in STAGES else ())  # type: ignore[assignment]
        self._loops.reset(loops)
        for loop in loops:
            setattr(self, _LATEST[loop], None)

    @override
    @_unseen
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the monitor and its source, describe the precision and strategy, and set the budget."""
        self._close(release=True)
        self.latest = self.latest_measured = self.first = None
        self._open_batch, self._last_step, self._step, self._ranks = False, None, 0, []
        self._logged_max_batch_size, self._gathered = None, False
        self._read_log_dir(trainer)
        optimizers: list[Optimizer] = list(trainer.optimizers)
        self._monitor = TenantMonitor(
            pl_module,
            optimizers,
            track_activations=self.track_activations,
            source=self._make_source(pl_module),
            device=pl_module.device,
            warn=rank_zero_warn,
        )
        self._source = self._monitor.source
        Guard(rank_zero_warn, "describing").run("precision and strategy", self._describe_engines, trainer, pl_module)
        # An optimizer step ends a step: Lightning's hook sees its own steps, a post hook on each optimizer also
        # sees a raw ``.step()`` (``self.optimizers(use_pl_optimizer=False)``). Without one, a step ends after the
        # accumulation Lightning was asked for, or under manual optimization after every batch where it knows
        # no optimizer, else after at most MANUAL_ACCUMULATION_BOUND batches.
        real = [o for o in optimizers if not is_mock_optimizer(o)]
        self._step_hooks = [o.register_step_post_hook(self._optimizer_stepped) for o in real]
        if pl_module.automatic_optimization:
            self._step_bound = max(int(trainer.accumulate_grad_batches or 1), 1)
        else:
            self._step_bound = MANUAL_ACCUMULATION_BOUND if real else 1
        self._alerts.set_budget(self.budget_bytes or device_budget_bytes(pl_module.device))
        # a weak reference and the settings, for exact answers after fit: nothing is copied, nothing runs
        self._alerts.attach(
            pl_module, precision=str(trainer.precision), device=pl_module.device, strategy=trainer.strategy
        )
        self._postmortem.start(pl_module.device)
        self._logs.open(trainer)
        # the timeline is drawn for TensorBoard, W&B and MLflow, and with a budget it gives the largest batch (its fixed
        # and batch-proportional bytes, scaled); without either, no step pays for recording it. The module paths (hooks
        # on the model's modules) are only for the pictures.
        self._monitor.record_timeline = self._logs.draws or self._alerts.budget is not None
        self._monitor.timeline_module_paths = self._logs.draws

    @override
    @_unseen
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Measure ``batch_start``; the first batch of an optimizer step decides whether the step is measured."""
        monitor = self._monitor
        if monitor is None:
            return
        if self._open_batch:  # the last batch never ended: Lightning skipped it (on_train_batch_start gave -1)
            monitor.skip_step()
        self._open_batch = True
        if monitor.pending_micro_batches == 0:
            self._stepped = False
            self._step = self._step_number(trainer)
            logged = self._logs.logs_next_step(trainer)
            self._cadence_step = logged
            self._logging_step = logged and bool(trainer.loggers)
            monitor.measure = self.track_every_step or logged
        self._phase("batch_start", batch)
        self._alerts.batch_start(batch, batch_idx, measured=monitor.measuring)

    @override
    @_unseen
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Measure ``before_backward``, the activations read from the loss's graph, and project backward's peak."""
        self._phase("before_backward", output=loss)
        if self._monitor is not None:
            self._alerts.before_backward(self._monitor)

    @override
    @_unseen
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Measure ``after_backward``."""
        self._phase("after_backward")

    @override
    @_unseen
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        """Measure ``before_optimizer_step``, and before the first step project what it will add."""
        self._stepped = True
        self._phase("before_optimizer_step")
        if self._monitor is not None:
            self._alerts.before_optimizer_step(self._monitor)

    @override
    @_unseen
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Measure ``batch_end``; once the optimizer step is over, close its report, then log and check it.

        The step is over where an optimizer stepped, or after the accumulation Lightning was asked for (under
        manual optimization, a bound on the batches).
        """
        monitor = self._monitor
        if monitor is None:
            return
        self._open_batch = False
        self._phase("batch_end")
        if not (self._stepped or monitor.pending_micro_batches >= self._step_bound):
            return
        report = monitor.end_step(self._step)
        self._last_step = self._step
        if report is not None:
            self.latest = report
            if report.peak_bytes is not None:
                self.latest_measured = report
            if self.first is None:
                self.first = report
            self._alerts.step_end(report, batch if self._cadence_step else None)
            if report.peak_bytes is not None:  # its forward bounds an evaluation batch's peak, until one is measured
                _, batch_bytes, samples = self._alerts.batch_sized
                self._loops.guard.run("the training forward", self._loops.training_step, report, samples, batch_bytes)
        largest = self._alerts.logged_max_batch_size() if self._logging_step else None
        if trainer.world_size > 1 and self._logging_step:
            # every rank takes part on the same steps, whatever its own measurement did, so none waits; the
            # largest batch every rank fits is the minimum over ranks
            gathered = gather_or_warn(trainer.strategy, report, rank_zero_warn, largest)
            self._ranks, largest = gathered.rows, gathered.max_batch_size
            self._logged_max_batch_size, self._gathered = largest, True
        if report is None:
            return
        headroom = self._alerts.headroom_bytes(report)
        if self._logging_step:
            self._logs.log(
                trainer,
                report,
                headroom_bytes=headroom,
                max_batch_size=largest,
                ranks=self._ranks,
                budget_bytes=self.budget,
            )
        if headroom is not None:
            self._logs.show_headroom(trainer, headroom)

    @override
    @_unseen
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Drop the step of a batch the epoch stopped inside, so that the next epoch starts a clean one."""
        if self._open_batch and self._monitor is not None:  # the epoch stopped inside a batch: it never ends
            self._open_batch = False
            self._monitor.skip_step()

    @override
    @_unseen
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the hooks, write TensorBoard's summary and desk, and print the summary (rank zero, stdout)."""
        raise_pending()
        # record_history on CUDA: the allocator's own view of the fit, for memory_viz, before the history stops
        history = self._postmortem.dump_history(rank=self._rank, world_size=self._world_size)
        self._close()
        latest = self.latest
        if latest is None:
            return
        largest, how = None, ""
        if self.print_summary and self.budget is not None:  # the line printed under the tables
            largest = self._logged_max_batch_size if self._gathered else self._alerts.logged_max_batch_size()
            how = self._alerts.how_found() + (", the minimum over ranks" if self._gathered else "")
        why = None
        if isinstance(self._source, TrackerSource) and not self.track_every_step:
            why = "the live-tensor tracker measures the first step and the steps Lightning logs; set"
            why += " track_every_step=True, or log_every_n_steps, to measure others"
        summary = fit_summary(
            self.first,
            latest,
            self.latest_measured,
            self.budget,
            max_batch_size=largest,
            margin=self.margin,
            how=how,
            unmeasured_why=why,
            evaluations=[r for r in (self.evaluation_peak("validate"),) if r is not None],
            module=pl_module,
            optimizers=list(trainer.optimizers),
            world_size=self._world_size,
            evaluation_samples=self._loops.peak_samples,
        )
        largest_validation = self._loops.max_batch_size("validate") if "validate" in self._loops.peaks else None
        if self.print_summary and self.budget is not None and largest_validation is not None:
            summary.lines.append(
                f"the largest validation batch is {largest_validation:,} samples: its peak"
                f" {fits_text(self.budget, self.margin)}; scaled from its measured batches"
                " (max_batch_size(stage='validate'))"
            )
        if history is not None:
            summary.lines.append(
                f"the allocator's history (record_history): {history}; render it with"
                f" python -m torch.cuda._memory_viz trace_plot {history} -o memory.html"
            )
        self._logs.fit_end(
            trainer, summary, self.latest_measured or latest, self.budget, print_summary=self.print_summary
        )

    @override
    @_unseen
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """After an out-of-memory error, write the postmortem; in any case, let go of the model."""
        # Never raises and never talks to other ranks: the user's exception goes on as it is, and a rank that
        # failed leaves as fast as it would without us while the others wait in a collective.
        try:
            monitor = self._monitor
            evaluating = self._loops.open_stage
            if evaluating is not None and self._loops.monitor is not None and is_out_of_memory(exception):
                record = self._postmortem.write(
                    self._loops.monitor,
                    pl_module,
                    exception,
                    world_size=self._world_size,
                    rank=self._rank,
                    step=int(trainer.global_step),
                    budget_bytes=self._budget_now(pl_module),
                    last_step=self._loops.latest.get(evaluating),
                    stage=evaluating,
                    batch_index=self._loops.monitor.open_batch_index,
                    samples=self._loops.open_samples,
                )
                if record is not None:
                    self._logs.postmortem(trainer, record, self._loops.latest.get(evaluating))
            elif monitor is not None and is_out_of_memory(exception):
                record = self._postmortem.write(
                    monitor,
                    pl_module,
                    exception,
                    world_size=self._world_size,
                    rank=self._rank,
                    step=self._step,
                    budget_bytes=self.budget,
                    last_step=self.latest,
                    advice=self._alerts.advice if self._alerts.can_advise() else None,
                )
                if record is not None:
                    self._logs.postmortem(trainer, record, self.latest)
        except Exception as error:  # the postmortem is a courtesy; the user's own exception matters
            rank_zero_warn(f"memtenants: the postmortem failed ({describe_error(error)})")
        finally:
            self._fitting = False
            self._loops.close()
            self._close(release=True)
            self._unbind()

    @override
    @_unseen
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove every hook and let go of the model and optimizers."""
        if stage == "fit":
            self._fitting = False
        self._loops.close()
        self._close(release=True)
        self._unbind()

    # -- the evaluation loops --------------------------------------------------------------------------

    @override
    @_unseen
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A validation run starts (the sanity check's too): its batches are measured from here."""
        self._loop_start(trainer, pl_module, "validate")

    @override
    @_unseen
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Measure ``batch_start`` of a validation batch, check its projected peak, watch for a leak."""
        self._loops.guard.run(
            "validation", self._loops.batch_start, trainer, "validate", batch, batch_idx, dataloader_idx
        )

    @override
    @_unseen
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Close the validation batch: ``latest_validation``."""
        self._loop_batch_end("validate", outputs, batch)

    @override
    @_unseen
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the validation run's figures (``memtenants/validation/...``)."""
        self._loop_end(trainer, "validate")

    @override
    @_unseen
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A test run starts."""
        self._loop_start(trainer, pl_module, "test")

    @override
    @_unseen
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Measure ``batch_start`` of a test batch."""
        self._loops.guard.run("test", self._loops.batch_start, trainer, "test", batch, batch_idx, dataloader_idx)

    @override
    @_unseen
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Close the test batch: ``latest_test``."""
        self._loop_batch_end("test", outputs, batch)

    @override
    @_unseen
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the test run's figures (``memtenants/test/...``)."""
        self._loop_end(trainer, "test")

    @override
    @_unseen
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A predict run starts."""
        self._loop_start(trainer, pl_module, "predict")

    @override
    @_unseen
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Measure ``batch_start`` of a predict batch."""
        self._loops.guard.run("predict", self._loops.batch_start, trainer, "predict", batch, batch_idx, dataloader_idx)

    @override
    @_unseen
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Close the predict batch: ``latest_predict``."""
        self._loop_batch_end("predict", outputs, batch)

    @override
    @_unseen
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the predict run's figures (``memtenants/predict/...``)."""
        self._loop_end(trainer, "predict")

    def _loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Stage) -> None:
        """A loop run's monitor: inside a fit on the training monitor's source; else on a source of its own."""
        if self._monitor is not None:
            source, owned = self._monitor.source, False
        else:  # a stand-alone validate, test or predict, or a fit's sanity check: nothing has read the log dir yet
            self._read_log_dir(trainer)
            if not self._fitting:
                self._postmortem.start(pl_module.device)
            source, owned = self._make_source(pl_module), True
        budget = self._budget_now(pl_module)
        self._loops.guard.run(
            "the evaluation loop",
            lambda: self._loops.start(
                trainer, pl_module, stage, source, owns_source=owned, budget_bytes=budget, margin=self.margin
            ),
        )

    def _loop_batch_end(self, stage: Stage, outputs: Any, batch: Any) -> None:
        raise_pending()
        report = self._loops.guard.run(stage, self._loops.batch_end, stage, outputs, batch)
        if report is not None:
            setattr(self, _LATEST[stage], report)

    def _loop_end(self, trainer: pl.Trainer, stage: Stage) -> None:
        """Log the run's figures; after a stand-alone loop, print its peak batch's table (rank zero, stdout)."""
        sanity = bool(trainer.sanity_checking)
        self._loops.guard.run(stage, self._loops.end, trainer, stage)
        if not self._fitting:
            self._postmortem.stop()
        peak = self._loops.peaks.get(stage)
        if self.print_summary and not self._fitting and not sanity and peak is not None and trainer.is_global_zero:
            print(to_text(step_table(peak, self._loops.budget.total_bytes if self._loops.budget else None)), flush=True)

    def _budget_now(self, pl_module: pl.LightningModule) -> int | None:
        return self.budget_bytes or device_budget_bytes(pl_module.device)

    def _read_log_dir(self, trainer: pl.Trainer) -> None:
        """Where the postmortem goes, read in a hook every rank runs: ``trainer.log_dir`` is a broadcast, and a
        failure path (the postmortem) must never call a collective while another rank waits in backward."""
        self._postmortem.log_dir = None
        if self.postmortem_dir is None:
            try:
                self._postmortem.log_dir = trainer.log_dir
            except Exception as error:  # a logger of the user's whose directory cannot be read: the working one
                rank_zero_warn(f"memtenants: the logger's directory cannot be read ({describe_error(error)})")

    # -- wiring ------------------------------------------------------------------------------------

    def _new_alerts(self) -> Alerts:
        return Alerts(
            None, margin=self.margin, strict=self.strict, warn=rank_zero_warn, measure_fixes=self.measure_fixes
        )

    def _make_source(self, pl_module: pl.LightningModule) -> MemorySource | None:
        source = self.memory_source
        if source == "tracker":
            return TrackerSource(pl_module.device.type, scan=False)
        if source == "none":
            return None
        if source == "auto":
            return source_for(pl_module.device, reset_peaks=self.reset_peak_stats)
        return source  # type: ignore[return-value]

    def _describe_engines(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Sentences and named parts from the precision plugin (GradScaler) and the strategy (DDP buckets)."""
        monitor = self._monitor
        assert monitor is not None
        plugin = trainer.precision_plugin
        for note in precision_notes(plugin, pl_module, pl_module.device.type):
            monitor.add_note(note)
        reader = scaler_part(plugin)
        if reader is not None:
            monitor.add_part("grad_scaler", reader)
        notes, buckets = ddp_notes_and_part(trainer.strategy.model, lambda: monitor.measure)
        for note in notes + sharding_notes(pl_module, trainer.world_size):
            monitor.add_note(note)
        if buckets is not None:
            monitor.add_part("ddp_buckets", buckets)

    def _outside_fit(self, what: str) -> None:
        """Refuse a dry run of the user's step while the trainer is fitting: measuring never changes the program."""
        if self._fitting:
            raise RuntimeError(
                f"{what}: exact answers and measured fixes run dry runs of your training_step (under fake tensors),"
                " which never run inside a fit; call it after trainer.fit returns (without exact=True, the answer"
                " comes from the measured steps)"
            )

    def _phase(self, name: Phase, batch: Any = None, output: Any = None) -> None:
        raise_pending()  # a Ctrl+C our bookkeeping of freed storages caught goes on here, never swallowed
        if self._monitor is not None:
            self._monitor.phase(name, batch, output)

    def _optimizer_stepped(self, optimizer: Optimizer, *_: Any) -> None:
        """The optimizers' post-step hook: the step ends at this batch's end, and the monitor knows which stepped."""
        self._stepped = True
        if self._monitor is not None:
            self._monitor.optimizer_stepped(optimizer)

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
            self._postmortem.stop()
            if release:
                self._monitor = None
                self._logs.panels = None

    def _unbind(self) -> None:
        """Drop ``log`` and ``log_dict``, which Lightning binds from the module onto every callback and pops only
        in a teardown that does not run after an exception: a finished callback keeps no module alive."""
        for name in ("log", "log_dict"):
            self.__dict__.pop(name, None)
