"""The end-of-fit summary: printed to stdout on rank zero, the same lines as the markdown, never an unmeasured MiB."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from conftest import make_trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, PhaseReport, StepReport
from lightning_memtenants.names import PHASES, TENANTS
from lightning_memtenants.render.table import SUMMARY_HEADING, fit_summary, summary_text, summary_to_markdown

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
    assert bullets(text)[0] == (
        "peak not measured: no memory source; largest tenant optimizer_state 8.00 MiB; sum of tenants 16.00 MiB"
    )
    assert "budget 64.00 MiB; no headroom: the peak was not measured" in bullets(text)
    assert bullets(text) == bullets(summary_to_markdown(summary))


def test_first_is_the_only_measured_step() -> None:
    first, last = report(0, 30 * MiB), report(5, None)
    summary = fit_summary(first, last, first, None)
    assert headings(summary_text(summary)) == ["memtenants: optimizer step 0, the first and the last measured",
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
