"""What ``gpu_check.py`` found, written as it goes: ``results.json`` (every figure) and ``results.md`` (the tables).

A section's results are written as soon as it ends, so a run stopped by its lease still leaves the earlier ones.
Nothing here imports torch: the markdown is made from the JSON alone (``python benchmarks/gpu_results.py DIR``
remakes ``results.md`` from ``results.json``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1024**2
# The sections whose rows are peaks of fresh processes, measured against predicted, in the table's order.
PEAK_SECTIONS = ("models", "fsdp", "expandable", "footprint")


def difference(measured: int | None, predicted: int | None) -> tuple[float | None, float | None]:
    """Predicted minus measured, in MiB and in % of the measured value.

    Args:
        measured: bytes measured, or ``None``.
        predicted: bytes predicted, or ``None``.

    Returns:
        ``(MiB, percent)``; ``None`` for each that cannot be computed (percent of a measured 0).
    """
    if measured is None or predicted is None:
        return None, None
    mib = (predicted - measured) / MiB
    return mib, (100 * (predicted - measured) / measured if measured else None)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


def _diff(measured: int | None, predicted: int | None) -> str:
    mib, pct = difference(measured, predicted)
    if mib is None:
        return "- | -"
    return f"{mib:+.1f} | " + ("-" if pct is None else f"{pct:+.1f}%")


def peak_row(name: str, row: dict[str, Any]) -> str:
    """One markdown row: the set-up, max_memory_allocated and max_memory_reserved measured and predicted.

    Args:
        name: the set-up's name.
        row: ``{"what", "measured": {"max_allocated_bytes", "max_reserved_bytes", "nvidia_smi_bytes"},
            "predicted": {"peak_bytes", "peak_reserved_bytes", "footprint_bytes"}, "error"}``, any part missing.

    Returns:
        The row, ``|``-separated, without a newline.
    """
    measured, predicted = row.get("measured") or {}, row.get("predicted") or {}
    m_alloc, p_alloc = measured.get("max_allocated_bytes"), predicted.get("peak_bytes")
    m_res, p_res = measured.get("max_reserved_bytes"), predicted.get("peak_reserved_bytes")
    smi, footprint = measured.get("nvidia_smi_bytes"), predicted.get("footprint_bytes")
    cells = [
        f"`{name}`",
        _mib(m_alloc),
        _mib(p_alloc),
        _diff(m_alloc, p_alloc),
        _mib(m_res),
        _mib(p_res),
        _diff(m_res, p_res),
        _mib(smi),
        _mib(footprint),
    ]
    line = "| " + " | ".join(cells) + " |"
    if row.get("error"):
        line += f" {str(row['error']).splitlines()[0][:120]}"
    return line


PEAK_HEADER = (
    "| set-up | allocated MiB | predicted | diff MiB | diff % | reserved MiB | predicted | diff MiB | diff % "
    "| nvidia-smi MiB | predicted |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def markdown(results: dict[str, Any]) -> str:
    """The tables of a results dict: the sections' status and seconds, then the peaks measured and predicted.

    Args:
        results: as :class:`Results` keeps it: ``{"device", "torch", "smoke", "sections": {name: {...}}}``.

    Returns:
        The markdown, ending with a newline.
    """
    sections = results.get("sections", {})
    lines = [
        f"# gpu-check on {results.get('device', '?')}",
        "",
        f"torch {results.get('torch', '?')}, lightning {results.get('lightning', '?')},"
        f" transformers {results.get('transformers', '?')}; target {results.get('target', '?')};"
        f" {results.get('seconds', 0):.0f} s of a {results.get('budget_s', 0):.0f} s budget"
        + ("; a smoke run on the CPU: the numbers mean nothing" if results.get("smoke") else ""),
        "",
        "| section | seconds | status |",
        "|---|---:|---|",
    ]
    for name, section in sections.items():
        status = section.get("status", "?")
        if section.get("reason"):
            status += f": {section['reason']}"
        lines.append(f"| {name} | {section.get('seconds', 0):.1f} | {status} |")
    rows = [(name, row) for key in PEAK_SECTIONS for name, row in (sections.get(key, {}).get("rows") or {}).items()]
    if rows:
        lines += [
            "",
            "## Peaks of fresh processes: max_memory_allocated and max_memory_reserved, measured and predicted",
            "",
            "Each row is one fresh process (its counters start at zero) running two training steps; the prediction"
            " is the largest of its two steps' peaks. nvidia-smi's figure is the process's used memory at its end"
            " (the CUDA context and NCCL's buffers included), beside the predicted footprint where one is made.",
            "",
            PEAK_HEADER,
        ]
        lines += [peak_row(name, row) for name, row in rows]
    sac = sections.get("sac", {}).get("rows") or {}
    if sac:
        lines += [
            "",
            "## What the forward leaves: allocated at before_backward minus batch_start, measured and predicted",
            "",
            "| set-up | measured MiB | predicted | diff MiB | diff % | predicted activations | predicted other |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in sac.items():
            m, p = row.get("measured_forward_bytes"), row.get("predicted_forward_bytes")
            lines.append(
                f"| `{name}` | {_mib(m)} | {_mib(p)} | {_diff(m, p)} | {_mib(row.get('predicted_activations_bytes'))}"
                f" | {_mib(row.get('predicted_other_bytes'))} |"
            )
    lines += _more_tables(sections)
    return "\n".join(lines) + "\n"


def _more_tables(sections: dict[str, Any]) -> list[str]:
    """Expandable segments' change, the footprint outside the allocator, and the fits' peaks per step."""
    lines: list[str] = []
    change = sections.get("expandable", {}).get("on_minus_off") or {}
    if change:
        lines += [
            "",
            "## max_memory_reserved with expandable segments minus without",
            "",
            "| model | measured MiB | predicted MiB |",
            "|---|---:|---:|",
        ]
        for name, row in change.items():
            lines.append(f"| `{name}` | {_mib(row.get('measured_bytes'))} | {_mib(row.get('predicted_bytes'))} |")
    alone = sections.get("footprint", {}).get("rows") or {}
    if alone:
        lines += [
            "",
            "## One process alone on the device: nvidia-smi's change against the allocator's reserved bytes",
            "",
            "| set-up | nvidia-smi MiB | reserved at the end | outside the allocator | predicted footprint |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, row in alone.items():
            measured, predicted = row.get("measured") or {}, row.get("predicted") or {}
            lines.append(
                f"| `{name}` | {_mib(measured.get('nvidia_smi_bytes'))} | {_mib(measured.get('end_reserved_bytes'))}"
                f" | {_mib(row.get('outside_allocator_bytes'))} | {_mib(predicted.get('footprint_bytes'))} |"
            )
    fits = {k: v for k, v in (sections.get("fits") or {}).items() if isinstance(v, list)}
    if fits:
        lines += [
            "",
            "## Fits with the callback: the step's peak and reserved bytes, measured and predicted",
            "",
            "| set-up / step | peak MiB | predicted | diff MiB | diff % | reserved MiB | predicted | diff MiB"
            " | diff % |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, steps in fits.items():
            for index, step in enumerate(steps):
                m, p = step.get("measured") or {}, step.get("predicted") or {}
                lines.append(
                    f"| `{name}` / {index + 1} | {_mib(m.get('peak_bytes'))} | {_mib(p.get('peak_bytes'))}"
                    f" | {_diff(m.get('peak_bytes'), p.get('peak_bytes'))} | {_mib(m.get('reserved_bytes'))}"
                    f" | {_mib(p.get('reserved_bytes'))} | {_diff(m.get('reserved_bytes'), p.get('reserved_bytes'))} |"
                )
    return lines


class Results:
    """The run's results, rewritten to ``folder`` (``results.json`` and ``results.md``) after every section.

    Args:
        folder: where to write; made if missing.
        budget_s: the run's time budget in seconds.
        header: what to say of the run (device, versions, target, smoke).
    """

    def __init__(self, folder: str | Path, budget_s: float, header: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.begin = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict[str, Any] = {**header, "budget_s": budget_s, "seconds": 0.0, "sections": {}}
        self.write()

    def elapsed_s(self) -> float:
        """Seconds since the run began.

        Returns:
            The seconds.
        """
        return time.perf_counter() - self.begin

    def remaining_s(self) -> float:
        """Seconds left of the budget (negative once spent).

        Returns:
            The seconds.
        """
        return self.budget_s - self.elapsed_s()

    def add(self, name: str, section: dict[str, Any]) -> None:
        """Keep a section's results and write both files at once.

        Args:
            name: the section's name.
            section: ``{"seconds", "status", ...}`` and its figures.
        """
        self.data["sections"][name] = section
        self.write()

    def write(self) -> None:
        """Write ``results.json`` and ``results.md``; each file is replaced whole, never left half-written."""
        self.data["seconds"] = self.elapsed_s()
        for name, text in (
            ("results.json", json.dumps(self.data, indent=1, default=str)),
            ("results.md", markdown(self.data)),
        ):
            partial = self.folder / (name + ".partial")
            partial.write_text(text)
            partial.replace(self.folder / name)


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_out")
    (folder / "results.md").write_text(markdown(json.loads((folder / "results.json").read_text())))
    print(folder / "results.md")
