"""Per-rank figures and their cross-rank max and min, gathered through the Lightning strategy.

Every rank measures its own tenants. On logging steps every rank hands one fixed-size vector to
``strategy.all_gather`` (Lightning's collective, whatever the backend), so rank zero can log each
rank's figures and their max and min. The vector has the same shape on every rank even where a
rank's measurement failed (its entries are NaN then), so no rank waits for another that skipped.
A fixed-size tensor, not the record's ``to_dict()``: an object gather pickles, and its size differs by rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lightning_memtenants.checks import describe_error
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.render.tags import RANK_FIELDS, rank_vector


def gather_ranks(strategy: Any, report: StepReport | None) -> list[list[float]]:
    """Every rank's figures (a row per rank, ``RANK_FIELDS``), through ``strategy.all_gather``.

    Every rank must call it on the same steps.

    Args:
        strategy: the Lightning strategy.
        report: this rank's step, or None where it measured nothing (it sends NaN then).

    Returns:
        One row of MiB figures per rank, in rank order.
    """
    try:
        vector = torch.tensor(rank_vector(report), dtype=torch.float64, device=strategy.root_device)
    except Exception:  # never skip the collective: a rank that cannot describe itself sends NaN
        vector = torch.full((len(RANK_FIELDS),), math.nan, dtype=torch.float64, device=strategy.root_device)
    return strategy.all_gather(vector).reshape(-1, len(RANK_FIELDS)).double().cpu().tolist()


def gather_or_warn(strategy: Any, report: StepReport | None, warn: Callable[[str], Any]) -> list[list[float]]:
    """Each rank's figures; a failed collective warns and gives none.

    Args:
        strategy: the Lightning strategy.
        report: this rank's step, or None.
        warn: how the failure is reported.

    Returns:
        The rows of :func:`gather_ranks`, or an empty list where the gather failed.
    """
    try:
        return gather_ranks(strategy, report)
    except Exception as error:  # the collective itself failed: the process group is gone, training will say so
        warn(f"memtenants: gathering per-rank figures failed ({describe_error(error)})")
        return []
