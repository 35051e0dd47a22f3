"""After an OOM: the postmortem of the step that failed, and the CUDA allocator's history for memory_viz."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.memory import is_oom_error
from torch import nn

from lightning_memtenants._private import dump_snapshot, record_history
from lightning_memtenants.analysis.evaluation import evaluation_fixes
from lightning_memtenants.analysis.fixes import optimizer_step_temporaries_bytes, ranked_fixes
from lightning_memtenants.core.guard import Guard
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.evaluation import EvaluationMonitor
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.names import LOOP_NAMES, PHASES, WINDOW_NAMES, Stage
from lightning_memtenants.render.postmortem import postmortem_record, write_postmortem

# What the postmortem says of its fixes where no dry run measured them.
ESTIMATED = (
    "estimated from the tenants at the failure, not measured; MemoryTenantsCallback(measure_fixes=True) measures"
    " each fix by dry runs of the step after the fit has failed, and MemoryTenantsCallback.advise() after fit"
)
MEASURED = "the fixes by dry runs of the step"
EVALUATION_ESTIMATED = (
    "estimated from the tenants at the failure, not measured (no dry run stands for an evaluation step)"
)


def measured_rows(advice: Any) -> list[dict[str, Any]]:
    """The measured fixes of an ``Advice`` as the postmortem's JSON holds them, fits first.

    Args:
        advice: what ``predict.advise.advise`` returned.

    Returns:
        One dict per fix: ``name``, ``peak_bytes``, ``saves_bytes``, ``fits``, ``trainer_kwargs``, ``batch_size``,
        ``changes_training`` and ``how``.
    """
    return [fix.to_dict() for fix in advice.fixes]


class Postmortem:
    """Writes ``memtenants_oom.json`` and ``.txt`` when training runs out of memory; never talks to other ranks.

    Args:
        directory: where the files go; ``None`` uses ``log_dir`` (read by the caller where every rank could:
            ``trainer.log_dir``, which without a logger is the trainer's ``default_root_dir``), else the working
            directory.
        record_history: on CUDA, keep the allocator's history and dump it next to the postmortem.
        warn: how a failure of ours is reported.

    Attributes:
        log_dir: the logger's directory, set by the caller at the start of fit, or None.
        path: the JSON postmortem written in this fit, or None.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, *, record_history: bool, warn: Callable[[str], Any]):
        self.directory = directory
        self.record_history = record_history
        self.guard = Guard(warn, "writing")
        self.measuring = Guard(warn, "measuring")
        self.log_dir: str | None = None
        self.path: Path | None = None
        self._recording = False

    def start(self, device: torch.device) -> None:
        """Begin the allocator's history, where asked and on CUDA.

        Args:
            device: the device trained on.
        """
        if self.record_history and device.type == "cuda":
            self._recording = self.guard.run("the allocator history", _record, True) is not None

    def dump_history(self, *, rank: int, world_size: int) -> Path | None:
        """Write the allocator's history so far for memory_viz, at the end of fit; None where none was recorded.

        Args:
            rank: this process's rank, in the file's name where there are several.
            world_size: the number of ranks.

        Returns:
            The snapshot's path, in the log dir (or ``directory``, or the working directory).
        """
        if not self._recording:
            return None
        path = self._snapshot_path("memtenants_snapshot", rank, world_size)
        written = self.guard.run("the allocator history", _dump, path)
        return path if written is not None else None

    @property
    def _directory(self) -> Path:
        """Where the files go: ``directory``, else the logger's log dir, else the working directory."""
        return Path(self.directory or self.log_dir or os.getcwd())

    def _snapshot_path(self, stem: str, rank: int, world_size: int) -> Path:
        """An allocator snapshot's file, one per rank where there are several."""
        return self._directory / (stem + (f"_rank{rank}" if world_size > 1 else "") + ".pickle")

    def stop(self) -> None:
        """End the allocator's history, if this object began it."""
        if self._recording:
            self._recording = False
            self.guard.run("the allocator history", _record, False)

    def write(
        self,
        monitor: TenantMonitor | EvaluationMonitor,
        module: nn.Module,
        error: BaseException,
        *,
        world_size: int,
        rank: int,
        step: int,
        budget_bytes: int | None,
        last_step: StepReport | None,
        advice: Callable[[], Any] | None = None,
        stage: Stage = "train",
        batch_index: int | None = None,
        samples: int = 0,
    ) -> dict[str, Any] | None:
        """Write the postmortem of ``error`` and return its record; None where writing it failed.

        It also dumps the allocator's history where it was recorded, and warns where the files are.

        Args:
            monitor: the run's monitor, which counts the tenants at the failure.
            module: the model.
            error: the out-of-memory error.
            world_size: the number of ranks; above 1 the files carry the rank.
            rank: this rank.
            step: the optimizer step that failed.
            budget_bytes: the run's budget, or None.
            last_step: the last completed step, or None.
            advice: measures the fixes by dry runs of the step (``Alerts.advice``, an ``Advice``, or None where
                that failed, warned once), or None for the estimates of ``analysis.fixes``; without an advice the
                postmortem holds the estimates, labelled so.
            stage: the loop that failed: ``"train"``, or an evaluation loop, whose ``monitor`` is then the
                :class:`~lightning_memtenants.evaluation.EvaluationMonitor` and whose fixes are the evaluation's.
            batch_index: the evaluation batch that failed, or None.
            samples: its samples, for the estimates.

        Returns:
            The record, or None.
        """
        return self.guard.run(
            "the postmortem",
            lambda: self._write(
                monitor,
                module,
                error,
                (world_size, rank, step),
                budget_bytes,
                last_step,
                advice,
                stage,
                batch_index,
                samples,
            ),
        )

    def _write(
        self,
        monitor: Any,
        module: nn.Module,
        error: BaseException,
        where: tuple[int, int, int],
        budget_bytes: int | None,
        last_step: StepReport | None,
        advice: Callable[[], Any] | None = None,
        stage: Stage = "train",
        batch_index: int | None = None,
        samples: int = 0,
    ) -> dict[str, Any]:
        world_size, rank, step = where
        if stage != "train":
            return self._write_evaluation(monitor, error, where, budget_bytes, last_step, stage, batch_index, samples)
        last = monitor.last_phase()
        failing = PHASES[(PHASES.index(last.name) + 1) % len(PHASES)] if last is not None else "batch_start"
        if failing == "before_backward":  # inside the forward: its graph so far hangs off the failing frames
            monitor.observe_failure(error)
        tenants_now = self.guard.run("the census at failure", monitor.census)
        tenants = tenants_now or (last.tenants_bytes if last is not None else {})
        reading = monitor.read_source()
        other_now = None
        if reading.allocated_bytes is not None and tenants_now is not None:
            other_now = reading.allocated_bytes - sum(tenants_now.values())
        fixes = ranked_fixes(
            tenants,
            module,
            monitor.optimizers,
            world_size=world_size,
            temporaries_bytes=optimizer_step_temporaries_bytes(monitor.optimizers) if failing == "batch_end" else 0,
            batch_temporaries_bytes=(other_now or 0) if failing in ("before_backward", "after_backward") else 0,
        )
        measured, note = None, ESTIMATED
        if advice is not None:
            monitor.source.pause()  # the failed step's tracker stops here: the dry runs are not the run's memory
            found = self.measuring.run(MEASURED, advice)  # a failure inside warns once, and answers None
            measured = None if found is None else measured_rows(found)
            if measured is None:
                note = "estimated: measuring them by dry runs of the step failed (warned)"
            else:
                note = (
                    "measured by dry runs of the failed step (under fake tensors) after the fit failed, never during"
                    " it; for the step's own memory: what else the process holds is not in these peaks"
                )
        record = postmortem_record(
            error=error,
            last_phase=last,
            failing_window=WINDOW_NAMES[failing],
            tenants_now=tenants_now,
            other_now=other_now,
            fixes=fixes,
            measured_fixes=measured,
            fixes_note=note,
            budget_bytes=budget_bytes,
            step=step,
            rank=rank,
            last_step=last_step,
        )
        self.path, _ = write_postmortem(self._directory, record, world_size)
        if self._recording:
            dump_snapshot(str(self._snapshot_path("memtenants_oom_snapshot", rank, world_size)))
        warnings.warn(f"memtenants: out of memory; postmortem written to {self.path}", stacklevel=1)
        return record

    def _write_evaluation(
        self,
        monitor: EvaluationMonitor,
        error: BaseException,
        where: tuple[int, int, int],
        budget_bytes: int | None,
        last_step: StepReport | None,
        stage: Stage,
        batch_index: int | None,
        samples: int,
    ) -> dict[str, Any]:
        """An evaluation batch's postmortem: the loop named, its step's working memory, the evaluation's fixes."""
        world_size, rank, step = where
        last = monitor.last_phase()
        monitor.observe_failure(error)  # a step run with grad enabled: its graph so far hangs off the frames
        tenants_now = self.guard.run("the census at failure", monitor.census)
        tenants = tenants_now or (last.tenants_bytes if last is not None else {})
        reading = monitor.read_source()
        other_now = working = None
        if reading.allocated_bytes is not None:
            if tenants_now is not None:
                other_now = reading.allocated_bytes - sum(tenants_now.values())
            if last is not None and last.allocated_bytes is not None:
                working = reading.allocated_bytes - last.allocated_bytes
        fixes = evaluation_fixes(stage, dict(tenants), working_bytes=working or 0, samples=samples)
        record = postmortem_record(
            error=error,
            last_phase=last,
            failing_window=f"{LOOP_NAMES[stage]}_step",
            tenants_now=tenants_now,
            other_now=other_now,
            fixes=fixes,
            fixes_note=EVALUATION_ESTIMATED,
            budget_bytes=budget_bytes,
            step=step,
            rank=rank,
            last_step=last_step,
            loop=LOOP_NAMES[stage],
            batch_index=batch_index,
        )
        self.path, _ = write_postmortem(self._directory, record, world_size)
        if self._recording:
            dump_snapshot(str(self._snapshot_path("memtenants_oom_snapshot", rank, world_size)))
        warnings.warn(
            f"memtenants: out of memory in the {LOOP_NAMES[stage]} loop (batch {batch_index}); postmortem written to"
            f" {self.path}",
            stacklevel=1,
        )
        return record


def _record(on: bool) -> bool:
    record_history(on)
    return True


def _dump(path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_snapshot(str(path))
    return True


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error, so that a postmortem is written for it and for nothing else.

    That is a ``torch.OutOfMemoryError``, or what Lightning's ``is_oom_error`` recognises (the CPU allocator's
    "can't allocate memory" included). That function assumes ``args[0]`` is a string; this one never raises,
    whatever the exception holds.

    Args:
        error: the exception training raised.

    Returns:
        True for an out-of-memory error.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    args = getattr(error, "args", ())
    return isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], str) and is_oom_error(error)
