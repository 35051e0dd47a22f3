"""The record: what was measured at each phase of a step, as numbers, and its one serialisation.

The core measures the numbers; the analysis writes the sentences (``analysis/explain.py`` the
``peak_explanation`` and the graph's ``notes``, ``analysis/engines.py`` the precision and strategy
``notes``, ``analysis/formulas.py`` the ``fixed_cost_notes`` and the formula's ``expected_fixed_bytes``);
the monitor puts both in the record, and the renderers print it. Nothing here knows a feature or writes
a sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from lightning_memtenants.names import FIXED_TENANTS, STAGES, TENANTS, Part, Phase, Stage, Tenant


@dataclass(frozen=True)
class GraphCounts:
    """What the graph walks of one step found beside the tenants, as counts.

    Attributes:
        checkpointed_regions: activation-checkpointed regions in the largest graph read.
        hooked: saved tensors that the user's ``saved_tensors_hooks`` packed.
        opaque: of those, the ones packed into objects that hold no tensor (not countable).
        offloaded_bytes: bytes the user's hooks moved to another device (``save_on_cpu``).
        compiled: whether ``torch.compile``'d code made part of the graph.
        selective_regions: of the checkpointed regions, those whose selective checkpointing policy cached outputs
            (``create_selective_checkpoint_contexts``): their cache is counted as activations.
    """

    checkpointed_regions: int = 0
    hooked: int = 0
    opaque: int = 0
    offloaded_bytes: int = 0
    compiled: bool = False
    selective_regions: int = 0


@dataclass(frozen=True)
class PhaseReport:
    """The tenants at one phase boundary, and what the memory source saw there.

    ``window_peak_bytes`` is the peak of the window that ends at this boundary (``names.WINDOWS``).

    Args:
        name: the phase boundary.
        tenants_bytes: each tenant's bytes, counted from the tensors.
        allocated_bytes: what the memory source saw allocated; None where not measured.
        window_peak_bytes: the peak of the window that ends here; None where not measured.
        reserved_bytes: what the allocator held from the device; None where not measured.
        parts_bytes: the named parts outside the tenants (``names.PARTS``) that were measured here.
        reserved_peak_bytes: the highest ``reserved_bytes`` of the window that ends here (``max_memory_reserved``
            since the previous boundary); None where not measured (a source that does not reset its peak counters).
    """

    name: Phase
    tenants_bytes: dict[Tenant, int]
    allocated_bytes: int | None = None
    window_peak_bytes: int | None = None
    reserved_bytes: int | None = None
    parts_bytes: dict[Part, int] = field(default_factory=dict)
    reserved_peak_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """The four tenants together."""
        return sum(self.tenants_bytes.values())

    @property
    def other_bytes(self) -> int | None:
        """Allocated minus the four tenants and the named parts: the batch, temporaries; so the desk adds up."""
        if self.allocated_bytes is None:
            return None
        return self.allocated_bytes - self.total_bytes - sum(self.parts_bytes.values())

    @property
    def fragmentation_bytes(self) -> int | None:
        """Reserved by the allocator but not allocated (CUDA and accelerators only)."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes

    def unmeasured(self) -> PhaseReport:
        """The same tenants with the memory source's figures dropped (readings that cannot be trusted)."""
        return replace(
            self, allocated_bytes=None, window_peak_bytes=None, reserved_bytes=None, reserved_peak_bytes=None
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field and the computed ``total_bytes``, ``other_bytes`` and ``fragmentation_bytes``, as JSON types.

        Returns:
            A dict that :meth:`from_dict` reads back.
        """
        out: dict[str, Any] = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        out.update(total_bytes=self.total_bytes, other_bytes=self.other_bytes)
        out["fragmentation_bytes"] = self.fragmentation_bytes
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhaseReport:
        """The report ``to_dict`` wrote (the computed fields are recomputed, not read).

        Args:
            data: a dict written by :meth:`to_dict`, after a JSON round trip or not.

        Returns:
            The report.

        Raises:
            ValueError: if ``data`` is not such a dict (a field missing, a figure that is not a number).
        """
        try:
            return cls(
                name=data["name"],
                tenants_bytes={t: int(data["tenants_bytes"][t]) for t in TENANTS},
                allocated_bytes=_int_or_none(data.get("allocated_bytes")),
                window_peak_bytes=_int_or_none(data.get("window_peak_bytes")),
                reserved_bytes=_int_or_none(data.get("reserved_bytes")),
                parts_bytes={k: int(v) for k, v in (data.get("parts_bytes") or {}).items()},
                reserved_peak_bytes=_int_or_none(data.get("reserved_peak_bytes")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"data must be a dict written by PhaseReport.to_dict(): {error!r}") from None


@dataclass(frozen=True)
class StepReport:
    """One optimizer step: the tenants at each phase, their high-water marks, the fixed cost, the peak.

    ``phases`` holds the last occurrence of each phase in the step; ``micro_batches`` keeps
    every micro-batch's phases when gradients are accumulated. ``expected_fixed_bytes`` is the
    formula's figure, ``None`` where the check did not run (never 0 for "unknown").

    Args:
        step: the optimizer step.
        phases: the last occurrence of each phase in the step.
        micro_batches: every micro-batch's phases, in order.
        tenants_bytes: each tenant's high-water mark over the step.
        expected_fixed_bytes: the formula's fixed cost, or None where the check did not run.
        measured_fixed_bytes: the fixed cost counted from the tensors at ``batch_end`` (else the last phase).
        fixed_cost_notes: the fixed-cost check's sentences: the formula's notes and each way the count differs.
        peak_bytes: the step's true peak, the highest window peak of its micro-batches; None where not measured.
        peak_phase: the phase whose window held the peak.
        peak_explanation: one sentence on what held memory at the peak, or why it was not measured.
        memory_source: what measured the allocated bytes and peaks (the source's status).
        notes: sentences on what the precision, the strategy and the graph add.
        graph: what the graph walks found beside the tenants.
        tenants_from_step: where the tenants were not counted on this step but carried (a step the memory source
            did not measure, whose micro-batches repeat ones counted before: the same batch shapes, parameters,
            optimizer state and gradients present), the step they were counted on, also where a micro-batch carried
            only its first phases and was counted from the phase where it differed; None where they were counted on
            this step. Such a step's ``notes`` say ``tenants carried from step k, not counted``.
        activations_by_module_bytes: the activations tenant split by the module that owns each storage (the
            innermost module whose forward allocated it; ``"(outside any module)"`` where none ran), at the moment
            ``activations_by_module_at`` names: the ten largest, largest first, and the rest summed under
            ``"(other modules)"``, so the values add up to the activations alive then. Filled on the steps that
            record a memory timeline with module paths (every dry run; the training steps the live-tensor tracker
            measures where the timeline is recorded, from the second on, on a model with no compiled part); empty
            elsewhere, and where no activation was alive then.
        activations_by_module_at: when the split was taken: ``"peak"``, the step's peak, where any activation is
            alive at it (a peak in the forward pass or in backward); ``"before_backward"``, the last
            ``before_backward`` boundary, where none is (a peak in the optimizer step); ``""`` where no split was
            taken.
        stage: the loop the report belongs to: ``"train"`` for an optimizer step; ``"validate"``, ``"test"`` or
            ``"predict"`` for one batch of an evaluation loop, whose phases are ``batch_start`` and ``batch_end`` (the
            loop's step between them), whose ``step`` is the trainer's global step when it ran, and whose gradients and
            optimizer state are what training left resident.
        batch_index: an evaluation batch's index in its loop; None for an optimizer step.
        dataloader_index: an evaluation batch's dataloader; None for an optimizer step.
    """

    step: int
    phases: dict[Phase, PhaseReport]
    micro_batches: list[dict[Phase, PhaseReport]]
    tenants_bytes: dict[Tenant, int]
    expected_fixed_bytes: int | None
    measured_fixed_bytes: int
    fixed_cost_notes: list[str] = field(default_factory=list)
    peak_bytes: int | None = None
    peak_phase: Phase | None = None
    peak_explanation: str = "peak not measured"
    memory_source: str = "not measured"
    notes: list[str] = field(default_factory=list)
    graph: GraphCounts = field(default_factory=GraphCounts)
    tenants_from_step: int | None = None
    activations_by_module_bytes: dict[str, int] = field(default_factory=dict)
    activations_by_module_at: str = ""
    stage: Stage = "train"
    batch_index: int | None = None
    dataloader_index: int | None = None

    def renumbered(self, step: int) -> StepReport:
        """The same report for another step: what a step that repeats this one, and reads nothing, reports.

        Args:
            step: the step number the copy carries.

        Returns:
            A copy sharing every other field (they are not changed after a report is made).
        """
        copy = object.__new__(StepReport)
        copy.__dict__.update(self.__dict__)  # ``dataclasses.replace`` would re-run every field: this is per step
        object.__setattr__(copy, "step", step)
        return copy

    @property
    def parts_bytes(self) -> dict[Part, int]:
        """High-water mark of each named part outside the tenants (``names.PARTS``) over the step."""
        out: dict[Part, int] = {}
        for phase in (p for mb in self.micro_batches for p in mb.values()):
            for name, value in phase.parts_bytes.items():
                out[name] = max(out.get(name, 0), value)
        return out

    @property
    def peak_reserved_bytes(self) -> int | None:
        """The step's highest reserved bytes (``max_memory_reserved`` over the step), beside ``peak_bytes``.

        The highest window peak of reserved bytes over every micro-batch's phases; at ``batch_start``, whose window
        spans the time between steps, the reserved bytes there, as ``peak_bytes`` reads it. None where no phase
        measured it (the CPU; a CUDA source that leaves the peak counters to the rest of the process).
        """
        values = []
        for batch_phases in self.micro_batches or [self.phases]:
            for name, phase in batch_phases.items():
                value = phase.reserved_bytes if name == "batch_start" else phase.reserved_peak_bytes
                if value is not None and phase.reserved_peak_bytes is not None:
                    values.append(value)
        return max(values) if values else None

    @property
    def fixed_deviation_bytes(self) -> int | None:
        """Measured minus expected fixed cost; None where the formula did not run."""
        return None if self.expected_fixed_bytes is None else self.measured_fixed_bytes - self.expected_fixed_bytes

    @property
    def tenant_sum_bytes(self) -> int:
        """The sum of the four tenants' high-water marks: an upper bound only if nothing else lives."""
        return sum(self.tenants_bytes.values())

    @property
    def peak_minus_sum_bytes(self) -> int | None:
        """The true peak minus the tenant sum: below 0 when tenants never coexist at their highs."""
        return None if self.peak_bytes is None else self.peak_bytes - self.tenant_sum_bytes

    @property
    def other_bytes(self) -> int | None:
        """High-water mark of ``other`` over the phases where it was measured."""
        values = [p.other_bytes for mb in self.micro_batches for p in mb.values() if p.other_bytes is not None]
        return max(values) if values else None

    @property
    def largest_tenant(self) -> Tenant:
        """The tenant with the highest high-water mark (the first of them on a tie)."""
        return max(TENANTS, key=lambda t: self.tenants_bytes[t])

    def to_dict(self) -> dict[str, Any]:
        """Every field and the computed ones, as JSON types: what the CLI's JSON and the postmortem carry.

        The computed fields are ``parts_bytes``, ``tenant_sum_bytes``, ``peak_minus_sum_bytes``, ``other_bytes``,
        ``fixed_deviation_bytes`` and ``peak_reserved_bytes``, and per phase ``total_bytes``, ``other_bytes`` and
        ``fragmentation_bytes``.

        Returns:
            A dict that :meth:`from_dict` reads back.
        """
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "phases":
                value = {name: phase.to_dict() for name, phase in value.items()}
            elif f.name == "micro_batches":
                value = [{name: phase.to_dict() for name, phase in mb.items()} for mb in value]
            elif f.name == "graph":
                value = {g.name: getattr(value, g.name) for g in fields(value)}
            out[f.name] = _plain(value)
        out["parts_bytes"] = dict(self.parts_bytes)
        out["tenant_sum_bytes"] = self.tenant_sum_bytes
        out["peak_minus_sum_bytes"] = self.peak_minus_sum_bytes
        out["other_bytes"] = self.other_bytes
        out["fixed_deviation_bytes"] = self.fixed_deviation_bytes
        out["peak_reserved_bytes"] = self.peak_reserved_bytes
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepReport:
        """The report ``to_dict`` wrote.

        Args:
            data: a dict written by :meth:`to_dict`, after a JSON round trip or not.

        Returns:
            The report.

        Raises:
            ValueError: if ``data`` is not such a dict.
        """
        try:
            micro = [{name: PhaseReport.from_dict(p) for name, p in mb.items()} for mb in data["micro_batches"]]
            phases = {name: PhaseReport.from_dict(p) for name, p in data["phases"].items()}
            return cls(
                step=int(data["step"]),
                phases=phases,
                micro_batches=micro,
                tenants_bytes={t: int(data["tenants_bytes"][t]) for t in TENANTS},
                expected_fixed_bytes=_int_or_none(data.get("expected_fixed_bytes")),
                measured_fixed_bytes=int(data["measured_fixed_bytes"]),
                fixed_cost_notes=[str(n) for n in data.get("fixed_cost_notes", [])],
                peak_bytes=_int_or_none(data.get("peak_bytes")),
                peak_phase=data.get("peak_phase"),
                peak_explanation=str(data.get("peak_explanation", "peak not measured")),
                memory_source=str(data.get("memory_source", "not measured")),
                notes=[str(n) for n in data.get("notes", [])],
                graph=GraphCounts(**(data.get("graph") or {})),
                tenants_from_step=_int_or_none(data.get("tenants_from_step")),
                activations_by_module_bytes={
                    str(k): int(v) for k, v in (data.get("activations_by_module_bytes") or {}).items()
                },
                activations_by_module_at=str(data.get("activations_by_module_at") or ""),
                stage=_stage(data.get("stage", "train")),
                batch_index=_int_or_none(data.get("batch_index")),
                dataloader_index=_int_or_none(data.get("dataloader_index")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"data must be a dict written by StepReport.to_dict(): {error!r}") from None


def fixed_bytes(tenants: dict[Tenant, int]) -> int:
    """Weights, gradients and optimizer state together: the fixed cost, which the formula predicts.

    Args:
        tenants: each tenant's bytes.

    Returns:
        The bytes of the three fixed tenants.
    """
    return sum(tenants[t] for t in FIXED_TENANTS)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _stage(value: Any) -> Stage:
    if value not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {value!r}")
    return value  # type: ignore[no-any-return]


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
