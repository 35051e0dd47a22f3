"""The end-of-fit summary: printed to stdout on rank zero, the same lines as the markdown, never an unmeasured MiB."""

from __future__ import annotations

import re
from dataclasses import replace

import lightning as L
import pytest
import torch
from conftest import SEED_WEIGHTS, make_trainer, no_collection
from lightning.pytorch.loggers import TensorBoardLogger
from seed_mlp import SeedMLP, seed_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, PhaseReport, StepReport
from lightning_memtenants.analysis.fixes import Fix
from lightning_memtenants.names import PHASES, TENANTS
from lightning_memtenants.render.table import (
    HEADLINE_HEADING,
    SUMMARY_HEADING,
    fit_summary,
    step_table,
    summary_text,
    summary_to_markdown,
    to_text,
    top_fix,
)
from lightning_memtenants.render.tags import metrics
from lightning_memtenants.render.tensorboard import desk_figure
from lightning_memtenants.units import mib

MiB = 2**20


def report(step: int, peak: int | None, weights: int = 4 * MiB) -> StepReport:
    measured = peak is not None
    phases = {
        name: PhaseReport(
            name,
            {"weights": weights, "gradients": weights, "optimizer_state": 2 * weights, "activations": 0},
            allocated_bytes=4 * weights + MiB if measured else None,
            window_peak_bytes=4 * weights + 2 * MiB if measured else None,
        )
        for name in PHASES
    }
    return StepReport(
        step=step,
        phases=phases,  # type: ignore[arg-type]
        micro_batches=[phases],  # type: ignore[list-item]
        tenants_bytes={"weights": weights, "gradients": weights, "optimizer_state": 2 * weights, "activations": 0},
        expected_fixed_bytes=4 * weights,
        measured_fixed_bytes=4 * weights,
        peak_bytes=peak,
        peak_phase="batch_end" if measured else None,
        peak_explanation="peak inside the optimizer step" if measured else "peak not measured: no memory source",
        memory_source="live-tensor tracker (cpu)" if measured else "not measured",
    )


def bullets(text: str) -> list[str]:
    return [line[2:] for line in text.splitlines() if line.startswith("- ")]


def headings(text: str) -> list[str]:
    return [line.removeprefix("### ").split(" (memory source")[0] for line in text.splitlines()
            if line.startswith(("### ", "memtenants: "))]  # fmt: skip


def test_the_last_measured_step_is_shown_and_both_forms_say_the_same() -> None:
    first, middle, last = report(0, 30 * MiB), report(2, 40 * MiB), report(3, None)
    summary = fit_summary(first, last, middle, 64 * MiB, max_batch_size=123, margin=0.05, how="exact")
    assert [r.step for r in summary.reports] == [0, 2]
    text, markdown = summary_text(summary), summary_to_markdown(summary)
    assert "not measured MiB" not in text and "not measured MiB" not in markdown
    assert bullets(text) == bullets(markdown)  # the same sentences in the same order
    assert (
        headings(text)
        == headings(markdown)
        == [
            HEADLINE_HEADING,
            "memtenants: optimizer step 0",
            "memtenants: optimizer step 2, the last measured",
            SUMMARY_HEADING,
        ]
    )
    lines = bullets(text)
    assert lines.count("budget 64.00 MiB; headroom 34.00 MiB") == 1  # step 0: 64 - 30
    assert "budget 64.00 MiB; headroom 24.00 MiB" in lines  # step 2
    assert lines[-2].startswith("the last step, 3, was not measured (no memory source); the table above is step 2")
    assert lines[-1] == (
        "the largest batch is 123 samples: a steady-state step fits 64 MiB less a 5% margin (60.80 MiB); exact"
    )
    # the rows are the same figures: 4 + 4 + 8 MiB of tenants, 1 MiB of other, 17 MiB allocated, 18 of peak
    assert re.search(r"^batch_end\s+4\.00\s+4\.00\s+8\.00\s+0\.00\s+1\.00\s+17\.00\s+18\.00$", text, re.M)
    assert "| `batch_end` | 4.00 | 4.00 | 8.00 | 0.00 | 1.00 | 17.00 | 18.00 |" in markdown


def test_nothing_measured_says_so_without_a_figure() -> None:
    only = report(0, None)
    summary = fit_summary(only, only, None, 64 * MiB)
    text = summary_text(summary)
    assert [r.step for r in summary.reports] == [0] and summary.lines == []
    assert "not measured MiB" not in text
    assert summary.headline == ["peak: training not measured (no memory source)",
                                "largest tenant: optimizer_state 8.00 MiB"]  # fmt: skip
    assert bullets(text)[2] == (
        "peak not measured: no memory source; largest tenant optimizer_state 8.00 MiB; sum of tenants 16.00 MiB"
    )
    assert "budget 64.00 MiB; no headroom: the peak was not measured" in bullets(text)
    assert bullets(text) == bullets(summary_to_markdown(summary))


def test_first_is_the_only_measured_step() -> None:
    first, last = report(0, 30 * MiB), report(5, None)
    summary = fit_summary(first, last, first, None)
    assert headings(summary_text(summary)) == [HEADLINE_HEADING,
                                               "memtenants: optimizer step 0, the first and the last measured",
                                               SUMMARY_HEADING]  # fmt: skip


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 64)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


@pytest.mark.filterwarnings("ignore:The number of training batches")
def test_a_cpu_fit_prints_the_summary_on_stdout_as_its_markdown(
    tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    L.seed_everything(0, verbose=False)
    cb = MemoryTenantsCallback(budget_bytes="64MiB")
    logger = TensorBoardLogger(tmp_path, name="tiny")
    data = DataLoader(TensorDataset(torch.randn(4 * 8, 64)), batch_size=8)
    # Lightning's default cadence: step 0 is measured, steps 1 to 3 are not
    make_trainer([cb], steps=4, log_every_n_steps=50, logger=logger).fit(Tiny(), data)
    out = capsys.readouterr().out
    assert cb.latest is not None and cb.latest.step == 3 and cb.latest.peak_bytes is None
    assert cb.latest_measured is cb.first
    assert "memtenants: optimizer step 0, the first and the last measured (memory source: live-tensor tracker" in out
    assert "not measured MiB" not in out
    assert "- the last step, 3, was not measured (no memory source measured this step: the live-tensor tracker" in out
    largest = cb.max_batch_size()
    assert largest is not None and largest > 8
    assert f"- the largest batch is {largest:,} samples: a steady-state step fits 64 MiB less a 5% margin" in out
    path = tmp_path / "tiny" / "version_0" / "memtenants_summary.md"
    assert out.rstrip().endswith(f"memtenants: the same summary in markdown: {path}")
    markdown = path.read_text()
    assert bullets(out) == bullets(markdown)
    assert headings(out)[:-1] == headings(markdown)  # the printed text also says where the markdown is
    # the desk's tenants, in the printed table
    weights = (64 * 64 + 64) * 4 / MiB
    assert re.search(rf"^batch_start\s+{weights:.2f}\s+0\.00\s+0\.00\s+0\.00\s", out, re.M)
    assert set(TENANTS) <= set(out.split())


def test_print_summary_false_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    cb = MemoryTenantsCallback(print_summary=False)
    make_trainer([cb], steps=1).fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 64)), batch_size=8))
    assert cb.latest is not None
    assert "memtenants" not in capsys.readouterr().out


# The headline's fix: a 1024 x 1024 fp32 weight under single-tensor Adam (the CPU's default), whose step makes two
# temporaries the size of that weight, 2 x 4 MiB; with 8 MiB of state, fused=True (8 MiB, ranked first of the two
# that save 8 MiB) beats sharding the state over 2 devices (4 MiB).
FIX_MODULE = nn.Linear(1024, 1024, bias=False)
FIX_OPTIMIZERS = [torch.optim.Adam(FIX_MODULE.parameters())]
FUSED = (
    "use the optimizer's fused=True (no per-parameter temporaries) or foreach=False (saves about 8.00 MiB, an estimate)"
)


def headline_of(budget: int | None, evaluations: list[StepReport] | None = None) -> list[str]:
    first, middle, last = report(0, 30 * MiB), report(2, 40 * MiB), report(3, None)
    summary = fit_summary(first, last, middle, budget, evaluations=evaluations or [], module=FIX_MODULE,
                          optimizers=FIX_OPTIMIZERS)  # fmt: skip
    text, markdown = summary_text(summary), summary_to_markdown(summary)
    assert text.startswith(f"{HEADLINE_HEADING}\n- {summary.headline[0]}\n")  # the first thing printed
    assert markdown.startswith(f"### {HEADLINE_HEADING}\n\n- {summary.headline[0]}\n")
    assert bullets(text) == bullets(markdown)
    assert bullets(text)[: len(summary.headline)] == summary.headline
    return summary.headline


def test_the_headline_names_the_peak_the_largest_tenant_and_the_fix_that_saves_most() -> None:
    peak = "peak: training 40.00 MiB (step 2, the optimizer step)"  # the higher of steps 0 (30) and 2 (40)
    tenant = "largest tenant: optimizer_state 8.00 MiB, 20% of the training peak"  # 8 / 40
    assert headline_of(None) == [peak, tenant, f"to lower the peak most: {FUSED}"]
    # 40 of 100 MiB: no fix is pushed
    assert headline_of(100 * MiB) == [f"{peak}; 40% of the budget (100.00 MiB)", tenant,
                                      "nothing needs changing: the peak is 40% of the budget"]  # fmt: skip
    # 40 MiB of 10 GiB is 0.4%: said as under 1%, never 0%
    assert headline_of(10 * 2**30)[2] == "nothing needs changing: the peak is under 1% of the budget"
    # 40 of 48 MiB (83%): it fits, 8 MiB under
    assert headline_of(48 * MiB)[2] == f"it fits, 8.00 MiB under the budget; to lower the peak most: {FUSED}"
    # 40 MiB over 42 MiB less 5%: int(42 MiB x 0.95) = 41,838,182 bytes; 41,943,040 - 41,838,182 = 104,858 (0.10 MiB)
    assert headline_of(42 * MiB)[0] == f"{peak}; 95% of the budget (42.00 MiB)"
    assert headline_of(42 * MiB)[2] == (
        f"over the budget: 0.10 MiB above 39.90 MiB (the budget less a 5% margin); the change that would help most:"
        f" {FUSED}"
    )


def validation_report(peak: int | None = 21 * MiB) -> StepReport:
    tenants = {"weights": 4 * MiB, "gradients": 4 * MiB, "optimizer_state": 8 * MiB, "activations": 0}
    allocated = {"batch_start": 17 * MiB, "batch_end": 18 * MiB}  # 1 and 2 MiB of other: the batch, the outputs
    window = {"batch_start": 17 * MiB, "batch_end": 21 * MiB}
    phases = {
        name: PhaseReport(name, dict(tenants), allocated_bytes=allocated[name], window_peak_bytes=window[name])
        for name in ("batch_start", "batch_end")
    }
    return StepReport(step=12, phases=phases, micro_batches=[phases], tenants_bytes=dict(tenants),  # type: ignore[arg-type]
                      expected_fixed_bytes=None, measured_fixed_bytes=16 * MiB, peak_bytes=peak,
                      peak_phase="batch_end", peak_explanation="peak in the validation step",
                      memory_source="live-tensor tracker (cpu)", stage="validate", batch_index=7,
                      dataloader_index=0)  # fmt: skip


def test_the_fix_for_an_evaluation_peak_weighs_the_loop_s_own_fixes_against_its_tenants() -> None:
    # working memory 4 MiB (21 - 17), 1 MiB kept past the step (18 - 17); the loop holds 8 MiB of Adam's state
    # and 4 of gradients training left
    high = validation_report(64 * MiB)  # 47 MiB of working memory: halving the batch saves 23.50
    assert top_fix(high, FIX_MODULE, FIX_OPTIMIZERS, samples=32) == Fix(
        "halve the validation batch size (the validation DataLoader's batch_size)", 47 * MiB // 2
    )
    # a batch of one sample cannot be halved: dropping Adam's state saves most
    assert top_fix(high, FIX_MODULE, FIX_OPTIMIZERS, samples=1) == Fix(
        "SGD without momentum keeps no optimizer state", 8 * MiB
    )
    # no training fix that the loop cannot use (activation checkpointing, accumulate_grad_batches)
    grad = replace(high, tenants_bytes={**high.tenants_bytes, "activations": 30 * MiB})
    assert top_fix(grad, FIX_MODULE, FIX_OPTIMIZERS, samples=1).action.startswith(
        "run the validation step without a graph"
    )
    first, middle, last = report(0, 30 * MiB), report(2, 40 * MiB), report(3, None)
    summary = fit_summary(first, last, middle, None, evaluations=[high], module=FIX_MODULE,
                          optimizers=FIX_OPTIMIZERS, evaluation_samples={"validate": 32})  # fmt: skip
    assert summary.headline[2] == (
        "to lower the peak most: for the validation peak, halve the validation batch size (the validation"
        " DataLoader's batch_size) (saves about 23.50 MiB, an estimate)"
    )


def test_an_evaluation_batch_has_its_own_table() -> None:
    text = to_text(step_table(validation_report(), 64 * MiB))
    assert text.splitlines()[0] == (
        "memtenants: validation batch 7 (dataloader 0), at optimizer step 12 (memory source: live-tensor tracker (cpu))"
    )
    rows = [line.split()[0] for line in text.splitlines()[3:] if line and not line.startswith("- ")]
    assert rows == ["batch_start", "batch_end", "high-water"]
    assert re.search(r"^batch_end\s+4\.00\s+4\.00\s+8\.00\s+0\.00\s+2\.00\s+18\.00\s+21\.00$", text, re.M)
    assert re.search(r"^high-water mark\s+4\.00\s+4\.00\s+8\.00\s+0\.00\s+2\.00\s+-\s+21\.00$", text, re.M)
    lines = bullets(text)
    assert lines[0] == (
        "peak 21.00 MiB in the validation step; largest tenant optimizer_state 8.00 MiB; sum of tenants 16.00 MiB"
    )
    assert "windows: batch_start closes before the batch (data loading); batch_end closes the validation step" in lines
    assert lines[-1] == "budget 64.00 MiB; headroom 43.00 MiB"
    # the tags and the desk read the phases that are there
    assert metrics(validation_report())["memtenants/window_peak/batch_end_MiB"] == 21.0
    assert not any("before_backward" in name for name in metrics(validation_report()))
    title = desk_figure(validation_report(), 64 * MiB).axes[0].get_title()
    assert title.startswith("memtenants desk: validation batch 7 (dataloader 0), at optimizer step 12, live-tensor")


def test_validation_is_put_beside_training() -> None:
    headline = headline_of(None, [validation_report()])
    assert headline[0] == "peak: training 40.00 MiB (step 2, the optimizer step) | validation 21.00 MiB (batch 7)"
    unmeasured = replace(validation_report(None), peak_explanation="peak not measured: the tracker was paused")
    assert headline_of(None, [unmeasured])[0].endswith(" | validation not measured (the tracker was paused)")
    first, middle, last = report(0, 30 * MiB), report(2, 40 * MiB), report(3, None)
    summary = fit_summary(first, last, middle, None, evaluations=[validation_report()])
    assert summary.headline[2:] == []  # no module: no fix is named
    text, markdown = summary_text(summary), summary_to_markdown(summary)
    assert headings(text) == headings(markdown) == [
        HEADLINE_HEADING, "memtenants: training and validation side by side", "memtenants: optimizer step 0",
        "memtenants: optimizer step 2, the last measured", SUMMARY_HEADING]  # fmt: skip
    # training's step 2: 1 MiB of other (17 allocated - 16 of tenants), peak 40; validation: 2 MiB, 21
    assert re.search(r"^tenant \(MiB\)\s+training\s+validation$", text, re.M)
    assert re.search(r"^optimizer_state\s+8\.00\s+8\.00$", text, re.M)
    assert re.search(r"^other\s+1\.00\s+2\.00$", text, re.M)
    assert re.search(r"^peak\s+40\.00\s+21\.00$", text, re.M)
    assert "| **peak** | 40.00 | 21.00 |" in markdown and "| `other` | 1.00 | 2.00 |" in markdown
    assert bullets(text)[2] == (  # under the headline's two lines (no module: no fix)
        "training: optimizer step 2; validation: batch 7 (dataloader 0), at optimizer step 12; each column holds the"
        " high-water marks and the peak over its step or batch"
    )


def test_a_real_fit_heads_its_summary_with_the_peak_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    cb = MemoryTenantsCallback()
    with no_collection():
        make_trainer([cb], steps=2).fit(SeedMLP(), seed_loader(batch_size=8, steps=2))
    out = capsys.readouterr().out
    assert cb.first is not None and cb.latest is not None
    # both steps peak in Adam's step: weights, gradients and state, two temporaries the size of the 4096 x 4096
    # weight and one the size of a 4096 bias, the batch (8 x 1024 floats) and the closure's loss copy (8 bytes)
    largest, state = 4096 * 4096 * 4, 201_400_344
    peak = 2 * SEED_WEIGHTS + state + 2 * largest + 4096 * 4 + 8 * 1024 * 4 + 8
    assert cb.first.peak_bytes == cb.latest.peak_bytes == peak
    assert out.startswith(
        f"{HEADLINE_HEADING}\n"
        f"- peak: training {mib(peak)} MiB (step 0, the optimizer step)\n"
        f"- largest tenant: optimizer_state 192.07 MiB, {state / peak:.0%} of the training peak\n"
        # no budget on the CPU: the fix that saves most, Adam's whole state (more than fused=True's 2 x 64 MiB)
        "- to lower the peak most: SGD without momentum keeps no optimizer state"
        " (saves about 192.07 MiB, an estimate)\n"
    )
