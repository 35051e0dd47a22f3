"""Graph breaks in compiled models, and LightningModules compiled through Lightning's fit (issue #31).

Real compiled CPU fits measured by MemoryTenantsCallback, against ``predict(model, (BATCH,), steps=2)``. A forward
with ``torch._dynamo.graph_break()`` between its first block and the others compiles two graphs (Dynamo's count);
the prediction traces each block as its own graph, which saves and peaks as Dynamo's two graphs do, to the byte.
``trainer.fit(torch.compile(module))`` has Lightning compile ``forward`` and ``training_step``: Dynamo compiles the
step whole where it does not log (one graph), and the prediction runs it with its forward compiled.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_models import WIDTH, BrokenLM, LoggedLM
from conftest import CLOSURE_DIVISOR, CollectedEachStep, make_trainer

from lightning_memtenants import MemoryTenantsCallback, predict

pytestmark = pytest.mark.slow

FLOAT = 4
# measured on torch 2.13 CPU (tests/test_compiled_predict.py): three gated blocks compiled as one graph save this
ONE_GRAPH_BYTES = 2_753_792


class Losses(L.Callback):
    """Keeps each step's loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(module: L.LightningModule, rows: int, measured: bool, steps: int = 2) -> tuple[Any, list[float], int]:
    """A real fit: the last step's report (None unmeasured), the losses, Dynamo's graphs so far."""
    losses = Losses()
    callback = MemoryTenantsCallback(print_summary=False)
    data = DataLoader(TensorDataset(torch.randn(4 * rows, WIDTH, generator=torch.Generator().manual_seed(1))), rows)
    make_trainer([CollectedEachStep(), losses] + ([callback] if measured else []), steps=steps).fit(module, data)
    report = callback.latest if measured else None
    return report, losses.losses, torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def real() -> dict[str, Any]:
    result: dict[str, Any] = {}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _, result["losses"], result["graphs"] = fit(BrokenLM(), 64, measured=False)
    result["breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    before = {name: dict(counter) for name, counter in torch._dynamo.utils.counters.items() if counter}
    result["broken"] = predict(BrokenLM(), (torch.Size([64, WIDTH]),), steps=2)
    after = {name: dict(counter) for name, counter in torch._dynamo.utils.counters.items() if counter}
    result["counters_kept"] = after == before
    result["fit"], result["losses_measured"], result["graphs_measured"] = fit(BrokenLM(), 64, measured=True)
    torch._dynamo.reset()
    result["fit_1024"] = fit(BrokenLM(), 1024, measured=True)[0]
    result["broken_1024"] = predict(BrokenLM(), (torch.Size([1024, WIDTH]),), steps=2)
    for breaks in ("item", "print"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        steps = 3 if breaks == "item" else 2  # the item's float is guarded: step 1 recompiles, step 2 does not
        result[f"{breaks}_fit"], _, result[f"{breaks}_graphs"] = fit(BrokenLM(breaks), 64, True, steps)
        result[breaks] = predict(BrokenLM(breaks), (torch.Size([64, WIDTH]),), steps=2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    result["quiet_fit"], _, result["quiet_graphs"] = fit(torch.compile(LoggedLM(log=False)), 64, measured=True)
    result["quiet"] = predict(torch.compile(LoggedLM(log=False)), (torch.Size([64, WIDTH]),), steps=2)
    torch._dynamo.reset()
    return result


def test_dynamo_splits_the_broken_forward_into_two_graphs_and_the_callback_and_prediction_change_nothing(
    real: dict[str, Any],
) -> None:
    assert real["graphs"] == 2 and real["breaks"] == 1  # block 1, then blocks 2 and 3
    assert real["counters_kept"]  # the prediction compiled nothing through Dynamo, counted no break
    assert real["graphs_measured"] == real["graphs"]  # the measured fit reused the same two graphs
    assert real["losses_measured"] == real["losses"]


@pytest.mark.parametrize("rows", [64, 1024])
def test_a_graph_break_is_predicted_as_dynamos_two_graphs_to_the_byte(real: dict[str, Any], rows: int) -> None:
    fit, prediction = (real["fit"], real["broken"]) if rows == 64 else (real["fit_1024"], real["broken_1024"])
    assert fit.memory_source.startswith("live-tensor tracker")
    assert fit.tenants_bytes == prediction.tenants_bytes
    assert prediction.peak_bytes == fit.peak_bytes
    note = next(n for n in prediction.notes if "could not be traced without Dynamo" in n)
    assert "GraphBreak: torch._dynamo.graph_break()" in note
    assert "blocks, blocks.0, blocks.1, blocks.2 are traced each on its own" in note


def test_the_break_costs_what_one_graph_would_not_save(real: dict[str, Any]) -> None:
    # measured: split at block 1's output, the partitioner keeps one 64-float vector more than in one graph
    assert real["fit"].tenants_bytes["activations"] == ONE_GRAPH_BYTES + CLOSURE_DIVISOR + 64 * FLOAT


def test_a_print_breaks_as_graph_break_does_and_is_predicted_to_the_byte(real: dict[str, Any]) -> None:
    fit, prediction = real["print_fit"], real["print"]
    assert real["print_graphs"] == 2
    assert fit.tenants_bytes == prediction.tenants_bytes == real["fit"].tenants_bytes
    assert prediction.peak_bytes == fit.peak_bytes
    assert any("(GraphBreak: print())" in n for n in prediction.notes)


def test_an_item_break_is_predicted_but_for_the_scalar_dynamos_first_graph_saves(real: dict[str, Any]) -> None:
    # Dynamo's first graph computes x.abs().max() with block 1 and saves the float32 maximum for its backward,
    # kept while block 1's graph lives; the prediction runs the read-out eagerly, whose graph dies with the float
    fit, prediction = real["item_fit"], real["item"]
    assert fit.step == 2  # measured after step 1's recompile (the float made dynamic), which compiled the 3rd graph
    assert real["item_graphs"] == 3
    assert fit.tenants_bytes["activations"] == prediction.tenants_bytes["activations"] + FLOAT
    assert prediction.tenants_bytes["activations"] == real["fit"].tenants_bytes["activations"]
    assert fit.peak_bytes == prediction.peak_bytes + FLOAT
    assert any("(GraphBreak: Tensor.item())" in n for n in prediction.notes)


def test_a_lightning_module_compiled_through_fit_is_predicted_with_its_forward_compiled(real: dict[str, Any]) -> None:
    fit, prediction = real["quiet_fit"], real["quiet"]
    assert real["quiet_graphs"] == 1  # Lightning compiled training_step: forward inlined, the loss with it
    assert fit.tenants_bytes == prediction.tenants_bytes
    assert fit.tenants_bytes["activations"] == ONE_GRAPH_BYTES + CLOSURE_DIVISOR
    assert prediction.peak_bytes == fit.peak_bytes
    assert any("LoggedLM.training_step (inductor, compiled by Lightning's fit" in n for n in prediction.notes)


def test_a_lightning_compiled_step_that_logs_fails_in_dynamo_on_these_versions() -> None:
    # measured on torch 2.13 with Lightning 2.6.6: Dynamo, tracing self.log, fails on the compiled training_step
    # Lightning hands it (InternalTorchDynamoError, no '__dict__' on a method): no real fit to compare against
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match="__dict__"):
        fit(torch.compile(LoggedLM()), 64, measured=False)
    torch._dynamo.reset()
