"""The zoo's table: each third-party configuration by each entry point, as ``tests/test_zoo.py`` checks it.

Runs ``tests/zoo_check.py`` (every configuration of ``tests/zoo_models.py``, or those named) in ``--processes``
fresh processes, each a share of the configurations, and prints one markdown row per configuration: a cell is
``exact`` (equal to the byte where exactness is claimed), ``ok`` (a sanity check passed), the difference in bytes
(``diff``), or the failure in one line. Then the cells' details, the wall and CPU time of the run, and each entry
point's seconds summed over the configurations.

Run: ``python benchmarks/zoo.py [--processes 2] [--ci] [--json FILE] [NAME ...]``; ``--ci`` skips ``advise`` on the
models where it is slowest, as the test does (``zoo_check.SLOW_ADVICE``); ``--from FILE`` prints the table of a
saved ``--json`` run without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from zoo_check import ENTRY_POINTS, verdict  # noqa: E402
from zoo_models import ZOO  # noqa: E402

SHORT = {"exact": "exact", "ok": "ok", "diff": "DIFF", "error": "ERROR", "skipped": "-"}
CELL_CHARACTERS = 110  # a table cell's failure line is cut here; the details below the table give 300


def run_zoo(names: list[str], processes: int, everything: bool) -> tuple[list[dict[str, Any]], float, float]:
    """The configurations' results in their order, the wall seconds and the children's CPU seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(TESTS / "zoo_check.py"), *(["--all"] if everything else [])]
    began = time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [
        subprocess.Popen([*command, *names[i::processes]], stdout=subprocess.PIPE, text=True, env=env)
        for i in range(processes)
        if names[i::processes]
    ]
    found: dict[str, dict[str, Any]] = {}
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"zoo_check.py exited with {proc.returncode}")
        for line in out.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                found[result["config"]] = result
    wall = time.perf_counter() - began
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return [found[name] for name in names if name in found], wall, cpu


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table: a row per configuration, a column per entry point, each cell's status."""
    lines = [
        "| configuration | " + " | ".join(ENTRY_POINTS) + " |",
        "|---|" + "---|" * len(ENTRY_POINTS),
    ]
    for result in results:
        cells = []
        for entry in ENTRY_POINTS:
            status, line = verdict(result, entry)
            if status in ("exact", "ok", "skipped"):
                cells.append(SHORT[status])
            else:
                text = line if len(line) <= CELL_CHARACTERS else line[: CELL_CHARACTERS - 3] + "..."
                cells.append(f"{SHORT[status]} {text}".replace("|", "/"))
        lines.append(f"| {result['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def details(results: list[dict[str, Any]]) -> str:
    """Every cell's line, the passing ones' figures included."""
    lines = []
    for result in results:
        lines.append(f"{result['config']} ({result['kind']})")
        for entry in ENTRY_POINTS:
            status, line = verdict(result, entry)
            seconds = result["cells"][entry]["seconds"]
            lines.append(f"  {entry:<12} {SHORT[status]:<6} {seconds:6.1f} s  {line}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="configurations, e.g. gpt2/32-true (default: the whole zoo)")
    parser.add_argument("--processes", type=int, default=2, help="fresh processes to share the zoo (default: 2)")
    parser.add_argument(
        "--ci", action="store_true", help="skip the slowest advise runs, as tests/test_zoo.py does (default: run all)"
    )
    parser.add_argument("--json", default=None, help="also save the raw results to this file (default: none)")
    parser.add_argument("--from", dest="source", default=None, help="print a saved --json run (default: run the zoo)")
    args = parser.parse_args()
    if args.source:
        saved = json.loads(Path(args.source).read_text())
        results, wall, cpu = saved["results"], saved["wall_s"], saved["cpu_s"]
    else:
        names = args.names or [config.name for config in ZOO]
        results, wall, cpu = run_zoo(names, max(1, args.processes), not args.ci)
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "wall_s": wall, "cpu_s": cpu}) + "\n")
    print(table(results))
    print()
    print(details(results))
    counts: dict[str, int] = {}
    for result in results:
        for entry in ENTRY_POINTS:
            status = verdict(result, entry)[0]
            counts[status] = counts.get(status, 0) + 1
    print()
    print(
        f"{len(results)} configurations x {len(ENTRY_POINTS)} entry points: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    )
    per_entry = {e: sum(r["cells"][e]["seconds"] for r in results) for e in ENTRY_POINTS}
    print("seconds per entry point, summed: " + ", ".join(f"{e} {s:.0f}" for e, s in per_entry.items()))
    print(f"wall {wall:.0f} s, CPU {cpu:.0f} s (the processes', imports included)")


if __name__ == "__main__":
    main()
