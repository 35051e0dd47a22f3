"""Per-rank figures and their cross-rank max and min, gathered through the Lightning strategy.

Every rank measures its own tenants. On logging steps every rank hands one fixed-size vector to
``strategy.all_gather`` (Lightning's collective, whatever the backend), so rank zero can log each
rank's figures and their max and min. The vector has the same shape on every rank even where a
rank's measurement failed (its entries are NaN then), so no rank waits for another that skipped.
A fixed-size tensor, not the record's ``to_dict()``: an object gather pickles, and its size differs by rank.

The vector ends with the rank's largest batch: ranks hold different batches (and under ZeRO or FSDP
different shards), so the largest batch every rank fits is the minimum over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memtenants.checks import describe_error
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.render.tags import RANK_FIELDS, rank_vector


@dataclass
class Gathered:
    """What the ranks sent: their figures, and the largest batch each fits.

    Attributes:
        rows: one row of MiB figures per rank, in rank order (``RANK_FIELDS``); empty where the gather failed.
        max_batch_sizes: each rank's largest batch, NaN where it had none.
    """

    rows: list[list[float]] = field(default_factory=list)
    max_batch_sizes: list[float] = field(default_factory=list)

    @property
    def max_batch_size(self) -> int | None:
        """The largest batch every rank fits: the minimum over ranks; None where a rank had no answer."""
        if not self.max_batch_sizes or any(math.isnan(v) for v in self.max_batch_sizes):
            return None
        return int(min(self.max_batch_sizes))


def gather_ranks(strategy: Any, report: StepReport | None, max_batch_size: int | None = None) -> Gathered:
    """Every rank's figures (a row per rank, ``RANK_FIELDS``) and largest batch, through ``strategy.all_gather``.

    Every rank must call it on the same steps.

    Args:
        strategy: the Lightning strategy.
        report: this rank's step, or None where it measured nothing (it sends NaN then).
        max_batch_size: this rank's largest batch, or None (NaN is sent).

    Returns:
        The rows, in rank order, and each rank's largest batch.
    """
    width = len(RANK_FIELDS) + 1
    try:
        values = [*rank_vector(report), math.nan if max_batch_size is None else float(max_batch_size)]
        vector = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
    except Exception:  # never skip the collective: a rank that cannot describe itself sends NaN
        vector = torch.full((width,), math.nan, dtype=torch.float64, device=strategy.root_device)
    table = strategy.all_gather(vector).reshape(-1, width).double().cpu().tolist()
    return Gathered([row[:-1] for row in table], [row[-1] for row in table])


def gather_or_warn(
    strategy: Any, report: StepReport | None, warn: Callable[[str], Any], max_batch_size: int | None = None
) -> Gathered:
    """Each rank's figures and largest batch; a failed collective warns and gives none.

    Args:
        strategy: the Lightning strategy.
        report: this rank's step, or None.
        warn: how the failure is reported.
        max_batch_size: this rank's largest batch, or None.

    Returns:
        What :func:`gather_ranks` gathered, or an empty :class:`Gathered` where the gather failed.
    """
    try:
        return gather_ranks(strategy, report, max_batch_size)
    except Exception as error:  # the collective itself failed: the process group is gone, training will say so
        warn(f"memtenants: gathering per-rank figures failed ({describe_error(error)})")
        return Gathered()
