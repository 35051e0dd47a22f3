"""Compiled models, eager against compiled, the real CPU fit against the prediction; and the budget advice.

For each model (``benchmarks/compiled_defs.py``, copies of the tests' models), eagerly and under
``torch.compile`` (inductor): a real 2-step CPU fit with ``MemoryTenantsCallback(print_summary=False)`` (the
live-tensor tracker, which counts inductor's buffers), read from ``cb.latest``, against
``predict(module, batch, steps=2)`` of a fresh module of the same weights. Printed per row: the activations and
the peak, real and predicted, their differences (predicted less real, in bytes and in % of the real figure), the
graphs Dynamo compiled in the real fit, its graph breaks, and the prediction's wall time. Dynamo is reset before
every fit and prediction. The prediction runs first, on a fresh module; it compiles nothing through Dynamo.

Then the budget row: ``advise`` on the compiled gated blocks at batch 1024 with a limit between the peaks the
compiled step predicts at ``activation_memory_budget`` 1 and 0.3, so that no budget of 1 fits and a smaller one
does; the candidate ``activation_memory_budget = x`` it measures (the largest of ``BUDGETS`` that fits, each
value a compiled dry run), and a real fit under
``torch._functorch.config.patch(activation_memory_budget=x)``, its peak against the candidate's.

Run: ``python benchmarks/compiled.py [--models gated-64,...,budget] [--quick] [--json PATH]``; ``--quick`` runs
the gated blocks at batch 64 alone (a smoke run); ``--list`` names the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from inspect import signature
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_defs import WIDTH, CausalLM, GatedLM, LoggedLM, hf_samples

from lightning_memtenants import MemoryTenantsCallback, advise, predict

STEPS = 2
BUDGET_BATCH = 1024
BUDGET_NAME = "activation_memory_budget"
# the limit of the budget row: this far from the peak at budget 1 towards the peak at LOW_BUDGET
LOW_BUDGET = 0.3
LIMIT_FRACTION = 0.5
# the activation_memory_budget values advise tries, each a compiled dry run (its notes suggest these)
BUDGETS = (0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


@dataclass(frozen=True)
class Case:
    """A model of the table: how to build its LightningModule (compiled or not) and its data."""

    name: str
    what: str
    build: Callable[[bool], L.LightningModule]
    data: Callable[[], DataLoader]


def _gated_data(batch_size: int) -> Callable[[], DataLoader]:
    def data() -> DataLoader:
        samples = torch.randn(2 * STEPS * batch_size, WIDTH, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(samples), batch_size=batch_size)

    return data


def _hf_data(name: str) -> Callable[[], DataLoader]:
    return lambda: DataLoader(hf_samples(name) * STEPS, batch_size=len(hf_samples(name)))


def _logged(compiled: bool) -> L.LightningModule:
    module = LoggedLM()
    return torch.compile(module) if compiled else module  # type: ignore[return-value]


CASES: dict[str, Case] = {
    "gated-64": Case("gated-64", "gated blocks, batch 64", lambda c: GatedLM(c), _gated_data(64)),
    "gated-1024": Case("gated-1024", "gated blocks, batch 1024", lambda c: GatedLM(c), _gated_data(1024)),
    "checkpointed-64": Case(
        "checkpointed-64",
        "gated blocks, each checkpointed, batch 64",
        lambda c: GatedLM(c, "checkpointed"),
        _gated_data(64),
    ),
    "broken-64": Case(
        "broken-64",
        "gated blocks, a graph break after block 1, batch 64",
        lambda c: GatedLM(c, "broken"),
        _gated_data(64),
    ),
    "logged-64": Case(
        "logged-64", "gated blocks, `torch.compile(module)`, `self.log` in the step, batch 64", _logged, _gated_data(64)
    ),
    "gpt2": Case("gpt2", "HF GPT-2, 2 x 64, 4 x 32 tokens", lambda c: CausalLM("gpt2", c), _hf_data("gpt2")),
    "llama": Case("llama", "HF Llama, 2 x 64, 4 x 32 tokens", lambda c: CausalLM("llama", c), _hf_data("llama")),
}
QUICK = ["gated-64"]


@dataclass
class Row:
    """One model in one mode: the real fit's figures and the prediction's."""

    model: str
    mode: str
    real_activations: int | None  # None where the real fit failed
    predicted_activations: int
    real_peak: int | None
    predicted_peak: int
    graphs: int | None
    graph_breaks: int | None
    predict_seconds: float
    fit_seconds: float | None
    fit_error: str = ""  # the real fit's exception in one line, where it failed
    break_reasons: tuple[str, ...] = ()  # why Dynamo broke the real fit's graphs, each reason once


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch._dynamo", "torch._inductor"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _trainer(callback: MemoryTenantsCallback) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback],
    )


def real_fit(module: L.LightningModule, data: DataLoader) -> tuple[Any, int, list[str], float]:
    """A real fit of ``STEPS`` steps: the callback's last report, Dynamo's graphs, its graph breaks (a reason per
    break), the seconds."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    callback = MemoryTenantsCallback(print_summary=False)
    gc.collect()
    gc.disable()  # garbage freed by a collection in the middle of a measured step would lower the readings
    began = time.perf_counter()
    try:
        _trainer(callback).fit(module, data)
    finally:
        gc.enable()
    seconds = time.perf_counter() - began
    counters = torch._dynamo.utils.counters
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = [reason.splitlines()[0][:200] for reason, n in counters["graph_break"].items() for _ in range(n)]
    return callback.latest, graphs, breaks, seconds


def measure(case: Case, compiled: bool) -> Row:
    """The prediction on a fresh module, then the real fit of another, both of the same weights."""
    batch = default_collate([case.data().dataset[i] for i in range(case.data().batch_size or 1)])
    torch._dynamo.reset()
    began = time.perf_counter()
    report = predict(case.build(compiled), batch, steps=STEPS)
    predict_seconds = time.perf_counter() - began
    mode = "compiled" if compiled else "eager"
    predicted = (report.tenants_bytes["activations"], report.peak_bytes)
    try:
        latest, graphs, breaks, fit_seconds = real_fit(case.build(compiled), case.data())
    except Exception as error:  # the prediction stands alone: a real fit that fails is a finding too
        line = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return Row(case.name, mode, None, predicted[0], None, predicted[1], None, None, predict_seconds, None, line)
    finally:
        torch._dynamo.reset()
    real = (latest.tenants_bytes["activations"], latest.peak_bytes)
    return Row(
        case.name,
        mode,
        real[0],
        predicted[0],
        real[1],
        predicted[1],
        graphs,
        len(breaks),
        predict_seconds,
        fit_seconds,
        break_reasons=tuple(dict.fromkeys(breaks)),
    )


def _diff(predicted: int, real: int | None) -> str:
    if real is None:
        return "-"
    percent = 100 * (predicted - real) / real if real else 0.0
    return f"{predicted - real:+,} ({percent:+.2f}%)"


def table(rows: list[Row]) -> str:
    """The markdown table: a row per model and mode."""
    lines = [
        "| model | mode | real act | predicted act | act diff | real peak | predicted peak | peak diff"
        " | Dynamo graphs (breaks) | predict s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        real_act, real_peak = (_bytes(r.real_activations), _bytes(r.real_peak))
        graphs = f"{r.graphs} ({r.graph_breaks})" if r.graphs is not None else "-"
        lines.append(
            f"| {CASES[r.model].what} | {r.mode} | {real_act} | {r.predicted_activations:,}"
            f" | {_diff(r.predicted_activations, r.real_activations)} | {real_peak} | {r.predicted_peak:,}"
            f" | {_diff(r.predicted_peak, r.real_peak)} | {graphs} | {r.predict_seconds:.1f} |"
        )
    failed = [f"{r.model}/{r.mode}: the real fit failed, {r.fit_error[:200]}" for r in rows if r.fit_error]
    return "\n".join(lines + failed)


def _bytes(value: int | None) -> str:
    return "fit fails" if value is None else f"{value:,}"


def _budget_peak(batch: Any, budget: float) -> int:
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=budget):
        return predict(GatedLM(True), batch, steps=STEPS).peak_bytes


def budget_row() -> dict[str, Any]:
    """``advise`` on the compiled gated blocks at batch 1024, a limit the budget answers, and the chosen budget's
    real fit."""
    batch = (torch.Size([BUDGET_BATCH, WIDTH]),)
    high, low = _budget_peak(batch, 1.0), _budget_peak(batch, LOW_BUDGET)
    limit = math.ceil(high - LIMIT_FRACTION * (high - low))
    result: dict[str, Any] = {"peak_at_1": high, f"peak_at_{LOW_BUDGET:g}": low, "limit": limit}
    torch._dynamo.reset()
    began = time.perf_counter()
    searched = (
        {"activation_memory_budgets": BUDGETS} if "activation_memory_budgets" in signature(advise).parameters else {}
    )
    advice = advise(GatedLM(True), batch, limit, margin=0.0, **searched)
    result["advise_seconds"] = time.perf_counter() - began
    result["baseline_peak"] = advice.baseline_peak_bytes
    result["fixes"] = [(fix.name, fix.peak_bytes, fix.fits) for fix in advice.fixes]
    fix = next((fix for fix in advice.fixes if BUDGET_NAME in fix.name), None)
    if fix is None:
        result["status"] = "not yet"
        result["notes"] = advice.notes
        return result
    found = re.search(rf"{BUDGET_NAME} = ([0-9.eE+-]+)", fix.name)
    if found is None:
        result["status"] = f"no budget in the fix's name: {fix.name}"
        return result
    chosen = float(found.group(1))
    result.update(status="ok", chosen=chosen, candidate=fix.name, candidate_peak=fix.peak_bytes, fits=fix.fits)
    with torch._functorch.config.patch(activation_memory_budget=chosen):
        latest, graphs, _, _ = real_fit(GatedLM(True), _gated_data(BUDGET_BATCH)())
    torch._dynamo.reset()
    result.update(real_peak=latest.peak_bytes, real_activations=latest.tenants_bytes["activations"], graphs=graphs)
    return result


def budget_text(result: dict[str, Any]) -> str:
    """The budget row as lines of text, and a table of the chosen budget's peak against the real fit's."""
    lines = [
        f"advise, compiled gated blocks at batch {BUDGET_BATCH}: predicted peak {result['peak_at_1']:,} B at"
        f" {BUDGET_NAME}=1, {result[f'peak_at_{LOW_BUDGET:g}']:,} B at {LOW_BUDGET:g}; limit {result['limit']:,} B"
        f" (margin 0); baseline {result['baseline_peak']:,} B; advise took {result['advise_seconds']:.1f} s",
        "fixes: " + "; ".join(f"{n} {p:,} B{' fits' if f else ''}" for n, p, f in result["fixes"]),
    ]
    if result["status"] != "ok":
        lines.append(f"{BUDGET_NAME} candidate: {result['status']}")
        lines += [f"note: {note}" for note in result.get("notes", [])]
        return "\n".join(lines)
    lines += [
        "",
        "| budget chosen | candidate | candidate's peak | real fit's peak | diff | real activations |",
        "|---|---|---|---|---|---|",
        f"| {result['chosen']:g} | {result['candidate']} | {result['candidate_peak']:,} | {result['real_peak']:,}"
        f" | {_diff(result['candidate_peak'], result['real_peak'])} | {result['real_activations']:,} |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [*CASES, "budget"]
    parser.add_argument("--models", default=",".join(names), help=f"rows, comma-separated (default: {names})")
    parser.add_argument("--quick", action="store_true", help="the gated blocks at batch 64 only (a smoke run)")
    parser.add_argument("--json", default=None, help="also save the results to this file (default: none)")
    parser.add_argument("--list", action="store_true", help="name the rows and stop")
    args = parser.parse_args()
    if args.list:
        for name in names:
            print(name, "-", CASES[name].what if name in CASES else "advise's activation_memory_budget, batch 1024")
        return
    chosen = QUICK if args.quick else [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {names}")
    _quiet()
    began = time.perf_counter()
    rows: list[Row] = []
    errors: dict[str, str] = {}
    for name in chosen:
        if name == "budget":
            continue
        for compiled in (False, True):
            try:
                rows.append(measure(CASES[name], compiled))
            except Exception as error:  # one row failing never stops the others
                errors[f"{name}/{'compiled' if compiled else 'eager'}"] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
            torch._dynamo.reset()
    budget = None
    if "budget" in chosen:
        try:
            budget = budget_row()
        except Exception as error:
            errors["budget"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
    wall = time.perf_counter() - began
    if rows:
        print(table(rows))
        for row in rows:
            for reason in row.break_reasons:
                print(f"{row.model}/{row.mode} graph break: {reason}")
    for key, error in errors.items():
        print(f"{key}: skipped, {error.splitlines()[0][:200]}")
    if budget is not None:
        print()
        print(budget_text(budget))
    print(f"\nwall {wall:.0f} s (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    if args.json:
        saved = {"rows": [asdict(r) for r in rows], "budget": budget, "errors": errors, "wall_s": wall}
        Path(args.json).write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
