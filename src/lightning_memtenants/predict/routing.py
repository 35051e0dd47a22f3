"""The routing a dry run assumes where a mixture of experts chooses experts from values it does not have.

A router picks each token's experts with ``topk``, ``argmax`` or ``max`` over its logits, which a dry run
computes as fake tensors: the choice has no value, so the tokens each expert receives (``nonzero``, ``where``,
``bincount`` over the choice, the expert loop, a capacity's drops) have no size. A dry run replaces the
choice, an index tensor, by a real one that follows one documented routing; everything after it runs on known
values (:class:`~lightning_memtenants.predict.values.KnownValues`), so every shape is the shape a real run with
that routing has. The routings:

- ``"balanced"`` (the default): each expert gets ``tokens x top_k / experts`` choices (the first experts one
  more where that does not divide), each token its ``top_k`` distinct experts, round robin;
- ``"worst"``: every token chooses the same ``top_k`` experts, the first ones: the largest tensors an expert
  can get (and, under a capacity, the most tokens dropped);
- ``{"capacity_factor": f}``: as concentrated as a capacity factor ``f`` (at least 1) allows: experts in order
  get ``ceil(f x tokens x top_k / experts)`` choices each until none are left;
- ``{"counts": [c0, c1, ...]}``: the choices per expert, given (from a real run, say); a list of such lists
  gives one per router call, in the order the step calls them (one per layer), repeated for the next steps.

Capacity limits apply as the model states them: they run on the chosen indices, as in training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_memtenants.checks import brief

ROUTINGS = ("balanced", "worst")
ACCEPTS = (
    'routing must be "balanced", "worst", {"capacity_factor": f} with f >= 1, or {"counts": [...]} of non-negative'
    " integers per expert (or a list of such lists, one per router call)"
)


@dataclass(frozen=True)
class Routing:
    """One routing assumption, checked (see the module's docstring).

    Args:
        kind: ``"balanced"``, ``"worst"``, ``"capacity_factor"`` or ``"counts"``.
        counts: for ``"counts"``, the choices per expert of each router call, in call order.
        capacity_factor: for ``"capacity_factor"``, the factor (at least 1).
    """

    kind: str = "balanced"
    counts: tuple[tuple[int, ...], ...] = ()
    capacity_factor: float = 1.0

    def describe(self) -> str:
        """The assumption in words, for a report's note."""
        if self.kind == "balanced":
            return "balanced routing (each expert gets tokens x top_k / experts)"
        if self.kind == "worst":
            return "worst-case routing (every token chooses the same top_k experts)"
        if self.kind == "capacity_factor":
            return f"routing as concentrated as a capacity factor of {self.capacity_factor:g} allows"
        shown = "; ".join(str(list(c)) for c in self.counts)
        return f"the given routing (choices per expert: {shown})"

    def chooses_among(self, call: int, experts: int) -> bool:
        """Whether router call ``call`` over ``experts`` options is one this routing routes.

        Given counts route only a choice among as many experts as they count (a ``max`` over a sequence, say, is
        no router: its indices stay fake); every other routing routes every choice.

        Args:
            call: the router call's index in the dry run.
            experts: the options it chooses among.

        Returns:
            True where :meth:`counts_for` applies.
        """
        return self.kind != "counts" or len(self.counts[call % len(self.counts)]) == experts

    def counts_for(self, call: int, rows: int, top_k: int, experts: int) -> list[int]:
        """The choices per expert for one router call.

        Args:
            call: the router call's index in the dry run (0, 1, ...).
            rows: the choices' rows (tokens, or whatever the router chooses for).
            top_k: the choices per row.
            experts: the options each row chooses from.

        Returns:
            One count per expert, summing to ``rows x top_k``, none above ``rows``.

        Raises:
            ValueError: naming ``routing``, where given counts do not fit this call.
        """
        total = rows * top_k
        if self.kind == "balanced":
            base, extra = divmod(total, experts)
            return [base + (1 if e < extra else 0) for e in range(experts)]
        if self.kind == "worst":
            return [rows if e < top_k else 0 for e in range(experts)]
        if self.kind == "capacity_factor":
            cap = min(rows, math.ceil(self.capacity_factor * total / experts))
            counts = []
            for _ in range(experts):
                counts.append(min(cap, total - sum(counts)))
            return counts
        counts = list(self.counts[call % len(self.counts)])
        if len(counts) != experts or sum(counts) != total or max(counts) > rows:
            raise ValueError(
                f"routing counts {counts} do not fit router call {call}: its {experts} experts' counts must sum to"
                f" rows x top_k ({rows} x {top_k} = {total}), none above the rows ({rows})"
            )
        return counts


def check_routing(routing: Any) -> Routing:
    """``routing`` as a :class:`Routing`, checked before anything runs.

    Args:
        routing: ``"balanced"``, ``"worst"``, ``{"capacity_factor": f}``, ``{"counts": [...]}`` or a
            :class:`Routing`.

    Returns:
        The routing.

    Raises:
        ValueError: naming ``routing`` and what it accepts.
    """
    if isinstance(routing, Routing):
        return routing
    if isinstance(routing, str) and routing in ROUTINGS:
        return Routing(routing)
    if isinstance(routing, Mapping) and len(routing) == 1:
        ((key, value),) = routing.items()
        if key == "capacity_factor" and _number(value) and value >= 1 and math.isfinite(value):
            return Routing("capacity_factor", capacity_factor=float(value))
        if key == "counts":
            counts = _counts(value)
            if counts is not None:
                return Routing("counts", counts=counts)
    raise ValueError(f"{ACCEPTS}, got {brief(routing)}")


def parse_routing(text: str) -> Routing:
    """The command line's ``--routing``: ``balanced``, ``worst``, ``capacity:1.25`` or ``counts:5,3,4,4``.

    Several routers' counts are separated by ``/``: ``counts:5,3,4,4/4,4,4,4``.

    Args:
        text: the flag's value.

    Returns:
        The routing.

    Raises:
        ValueError: naming ``--routing`` and what it accepts.
    """
    name, _, rest = text.partition(":")
    try:
        if name == "capacity" and rest:
            return check_routing({"capacity_factor": float(rest)})
        if name == "counts" and rest:
            return check_routing({"counts": [[int(c) for c in part.split(",")] for part in rest.split("/")]})
        return check_routing(text)
    except ValueError:
        raise ValueError(
            f"--routing must be balanced, worst, capacity:F (F >= 1) or counts:C0,C1,... (routers separated by /),"
            f" got {text!r}"
        ) from None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counts(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        return None
    if all(_whole(v) for v in value):
        return (tuple(value),)
    lists = []
    for item in value:
        if not isinstance(item, Sequence) or isinstance(item, str) or not item or not all(_whole(v) for v in item):
            return None
        lists.append(tuple(item))
    return tuple(lists)


def routed_indices(counts: list[int], rows: int, top_k: int) -> Tensor:
    """A ``(rows, top_k)`` int64 choice in which expert ``e`` is chosen ``counts[e]`` times, by distinct rows.

    The choices sorted by expert fill the columns one after another, so no row chooses an expert twice (no
    count is above ``rows``).

    Args:
        counts: the choices per expert.
        rows: the rows.
        top_k: the choices per row.

    Returns:
        The index tensor, a real CPU tensor.
    """
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    return experts.reshape(top_k, rows).t().contiguous()
