"""The OOM postmortem: one record, written as JSON, and rendered from that record as text and as markdown."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_memtenants.analysis.fixes import Fix
from lightning_memtenants.checks import describe_error
from lightning_memtenants.core.record import PhaseReport, StepReport
from lightning_memtenants.names import LOOP_NAMES, TENANTS, WINDOW_NAMES, WINDOWS, Tenant
from lightning_memtenants.units import mib


def postmortem_record(
    *,
    error: BaseException,
    last_phase: PhaseReport | None,
    failing_window: str | None,
    tenants_now: dict[Tenant, int] | None,
    other_now: int | None = None,
    fixes: Sequence[Fix] = (),
    measured_fixes: Sequence[dict[str, Any]] | None = None,
    fixes_note: str | None = None,
    budget_bytes: int | None = None,
    step: int = 0,
    rank: int = 0,
    last_step: StepReport | None = None,
    loop: str = "training",
    batch_index: int | None = None,
) -> dict[str, Any]:
    """What the postmortem says, as JSON types: where it failed, the tenants then and before, and the fixes.

    Args:
        error: the out-of-memory error.
        last_phase: the last phase boundary the step passed, or None.
        failing_window: the window that failed (a ``names.WINDOW_NAMES`` value), or None.
        tenants_now: the tenants counted at the failure, or None where that count failed.
        other_now: allocated bytes less the tenants at the failure, or None.
        fixes: the estimated remedies (``analysis.fixes.ranked_fixes``), most bytes saved first.
        measured_fixes: the fixes measured by dry runs of the step, JSON-ready (``name``, ``peak_bytes``,
            ``saves_bytes``, ``fits``, ``trainer_kwargs``, ``batch_size``, ``changes_training``, ``how``), fits first;
            they replace the estimates, and ``fixes_kind`` says which the record holds.
        fixes_note: why the fixes are what they are (estimates where no dry run could measure them), or None.
        budget_bytes: the run's budget, or None.
        step: the optimizer step that failed.
        rank: this rank.
        last_step: the last completed step, or None.
        loop: the loop that failed, in words (``names.LOOP_NAMES``): ``"training"``, ``"validation"``...
        batch_index: an evaluation batch's index in its loop, or None.

    Returns:
        The record; ``fattest_tenant`` is read from the tenants at the failure, else at the last phase. Its
        ``fixes`` hold ``action`` and ``saves_bytes`` either way (a measured fix's ``action`` is its name).
    """
    tenants: dict[str, int] = dict(tenants_now or (last_phase.tenants_bytes if last_phase else {}))
    if other_now is not None:
        tenants["other"] = other_now
    return {
        "error": describe_error(error),
        "loop": loop,
        "batch_index": batch_index,
        "rank": rank,
        "step": step,
        "phase": failing_window,
        "phase_description": _describe(failing_window),
        "last_completed_phase": last_phase.name if last_phase else None,
        "tenants_at_last_completed_phase_bytes": dict(last_phase.tenants_bytes) if last_phase else None,
        "allocated_at_last_completed_phase_bytes": last_phase.allocated_bytes if last_phase else None,
        "other_at_last_completed_phase_bytes": last_phase.other_bytes if last_phase else None,
        "tenants_at_failure_bytes": dict(tenants_now) if tenants_now is not None else None,
        "other_at_failure_bytes": other_now,
        "fattest_tenant": max(tenants, key=lambda t: tenants[t]) if tenants else None,
        "budget_bytes": budget_bytes,
        "fixes_kind": "estimated" if measured_fixes is None else "measured",
        "fixes": (
            [{"action": f.action, "saves_bytes": f.saves_bytes} for f in fixes]
            if measured_fixes is None
            else [{"action": fix["name"], **fix} for fix in measured_fixes]
        ),
        "fixes_note": fixes_note,
        "last_step": last_step.to_dict() if last_step is not None else None,
    }


def write_postmortem(
    directory: str | os.PathLike[str], record: dict[str, Any], world_size: int = 1
) -> tuple[Path, Path]:
    """Write ``record`` as ``memtenants_oom.json`` and its text as ``.txt``; return their paths.

    On each rank of a distributed run the files are ``memtenants_oom_rank<r>.*``, so that ranks never
    write over each other. Nothing here talks to other ranks.

    Args:
        directory: where the files go; made if missing.
        record: what :func:`postmortem_record` returned.
        world_size: the number of ranks.

    Returns:
        The paths of the JSON and the text file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = "memtenants_oom" if world_size <= 1 else f"memtenants_oom_rank{record['rank']}"
    json_path, text_path = directory / f"{stem}.json", directory / f"{stem}.txt"
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    text_path.write_text(postmortem_text(record, world_size) + "\n")
    return json_path, text_path


def _rows(record: dict[str, Any]) -> list[tuple[str, int | None, int | None]]:
    before = record.get("tenants_at_last_completed_phase_bytes") or {}
    now = record.get("tenants_at_failure_bytes") or {}
    rows = [(t, before.get(t), now.get(t)) for t in TENANTS]
    rows.append(("other", record.get("other_at_last_completed_phase_bytes"), record.get("other_at_failure_bytes")))
    return rows


def _measured(record: dict[str, Any]) -> bool:
    return record.get("fixes_kind") == "measured"


def _fixes_title(record: dict[str, Any]) -> str:
    if _measured(record):
        return (
            "fixes, measured by dry runs of the step (each fix's peak against the budget less the margin), fits first"
        )
    return "fixes, estimated from the tenants (not measured), most bytes saved first"


def _fix_lines(record: dict[str, Any]) -> list[str]:
    fixes = record.get("fixes") or []
    if not _measured(record):
        lines = [f"{i}. {fix['action']}: saves {mib(fix['saves_bytes'])} MiB" for i, fix in enumerate(fixes, 1)]
    else:
        lines = [
            f"{i}. {fix['action']}: peak {mib(fix['peak_bytes'])} MiB, saves {mib(fix['saves_bytes'])} MiB,"
            f" {'fits' if fix['fits'] else 'does not fit'}; {fix['how']}"
            for i, fix in enumerate(fixes, 1)
        ]
    note = record.get("fixes_note")
    return lines + ([f"({note})"] if note else [])


def postmortem_text(record: dict[str, Any], world_size: int = 1) -> str:
    """The postmortem as plain text: the failure, the tenants before and at it, the fixes.

    Args:
        record: what :func:`postmortem_record` returned.
        world_size: the number of ranks; above 1 the rank is named.

    Returns:
        The text.

    """
    where = f", rank {record.get('rank')}" if world_size > 1 else ""
    lines = [
        f"memtenants OOM postmortem: {_where(record)}{where}, {record.get('error')}",
        f"failed in {record.get('phase_description')} ({record.get('phase')}),"
        f" after {record.get('last_completed_phase')}",
        "",
        f"{'tenant (MiB)':<18}{'last phase':>14}{'at failure':>14}",
    ]
    lines += [f"{name:<18}{mib(before):>14}{mib(now):>14}" for name, before, now in _rows(record)]
    lines += ["", f"fattest tenant: {record.get('fattest_tenant')}", f"{_fixes_title(record)}:"]
    return "\n".join(lines + [f"  {line}" for line in _fix_lines(record)])


def postmortem_markdown(record: dict[str, Any]) -> str:
    """The same postmortem as :func:`postmortem_text`, in markdown.

    Args:
        record: what :func:`postmortem_record` returned; a missing field shows as None.

    Returns:
        The markdown.
    """
    lines = [
        f"### memtenants OOM postmortem: {_where(record)}",
        "",
        f"`{record.get('error')}`",
        "",
        f"Failed in {record.get('phase_description')} (`{record.get('phase')}`),"
        f" after `{record.get('last_completed_phase')}`.",
        "",
        "| tenant (MiB) | last phase | at failure |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{name}` | {mib(before)} | {mib(now)} |" for name, before, now in _rows(record)]
    title = _fixes_title(record)
    lines += ["", f"Fattest tenant: `{record.get('fattest_tenant')}`.", "", f"{title[0].upper()}{title[1:]}:", ""]
    return "\n".join(lines + _fix_lines(record))


def _where(record: dict[str, Any]) -> str:
    """``step 3``, or for an evaluation loop ``validation loop, batch 0, at step 3``."""
    loop = record.get("loop") or "training"
    if loop == "training":
        return f"step {record.get('step')}"
    return f"{loop} loop, batch {record.get('batch_index')}, at step {record.get('step')}"


def _describe(window: str | None) -> str:
    for phase, name in WINDOW_NAMES.items():
        if name == window:
            return WINDOWS[phase]
    for loop in LOOP_NAMES.values():
        if window == f"{loop}_step":
            return f"the {loop} step"
    return "before the first phase"
