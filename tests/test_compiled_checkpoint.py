"""Activation checkpointing inside a compiled model (issue #31): predicted as Dynamo's higher-order op compiles it.

Dynamo turns ``checkpoint(fn, x, use_reentrant=False)`` into ``tag_activation_checkpoint``, whose nodes inductor's
partitioner recomputes in backward; the prediction traces without Dynamo, and tags the region the same way. The
real runs are compiled (and eager) CPU fits of three checkpointed gated blocks, measured by the live-tensor
tracker, once per module (a fixture); each is compared with its prediction at every phase.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.utils.checkpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_models import HIDDEN, WIDTH, CheckpointedLM, MixedCheckpointLM
from conftest import CLOSURE_DIVISOR, CollectedEachStep, make_trainer

from lightning_memtenants import PHASES, MemoryTenantsCallback, StepReport, predict

pytestmark = pytest.mark.slow

ROWS = 1024
FLOAT = 4
# What a checkpointed block keeps for backward is its input alone; the tracker does not count the batch (block 1's
# input), so the three blocks keep blocks 2 and 3's inputs, and pow's backward reads block 3's output.
CHECKPOINTED_BYTES = 3 * ROWS * WIDTH * FLOAT + CLOSURE_DIVISOR  # 3,145,736
# The selective block saves its three Linears' outputs, of which backward reads fc1's and the gate's (GELU's and the
# sigmoid's inputs); fc2's is only added to the residual. The reentrant and plain blocks keep their inputs alone.
MIXED_BYTES = CHECKPOINTED_BYTES + 2 * ROWS * HIDDEN * FLOAT  # 11,534,344


def fit(module: L.LightningModule) -> StepReport:
    """The second step of a real two-step CPU fit of ``module``, as the callback measured it."""
    torch._dynamo.reset()
    callback = MemoryTenantsCallback(print_summary=False)
    data = DataLoader(TensorDataset(torch.randn(4 * ROWS, WIDTH)), batch_size=ROWS)
    make_trainer([CollectedEachStep(), callback], steps=2).fit(module, data)
    assert callback.latest is not None
    return callback.latest


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    torchs = (torch.utils.checkpoint._checkpoint_without_reentrant_generator, torch.utils.checkpoint.CheckpointFunction)
    result: dict[str, Any] = {}
    models = {
        "eager": lambda: CheckpointedLM(compiled=False),
        "compiled": lambda: CheckpointedLM(compiled=True),
        "mixed": MixedCheckpointLM,
    }
    for name, model in models.items():
        result[name] = fit(model())
        torch._dynamo.reset()
        result[f"predicted_{name}"] = predict(model(), (torch.Size([ROWS, WIDTH]),), steps=2)
    torch._dynamo.reset()
    after = (torch.utils.checkpoint._checkpoint_without_reentrant_generator, torch.utils.checkpoint.CheckpointFunction)
    result["torchs_kept"] = after == torchs
    return result


def assert_the_same_step(real: StepReport, predicted: StepReport) -> None:
    """Every tenant at every phase, the allocated bytes and window peaks, the peak and its phase."""
    assert predicted.tenants_bytes == real.tenants_bytes
    for name in PHASES:
        assert predicted.phases[name].tenants_bytes == real.phases[name].tenants_bytes, name
        assert predicted.phases[name].allocated_bytes == real.phases[name].allocated_bytes, name
        assert predicted.phases[name].window_peak_bytes == real.phases[name].window_peak_bytes, name
    assert predicted.peak_bytes == real.peak_bytes
    assert predicted.peak_phase == real.peak_phase


def test_a_checkpointed_model_keeps_only_the_blocks_inputs_eagerly_and_compiled(runs: dict[str, Any]) -> None:
    assert runs["eager"].memory_source.startswith("live-tensor tracker")
    assert runs["compiled"].memory_source.startswith("live-tensor tracker")  # compiled kernels' buffers too
    assert runs["eager"].tenants_bytes["activations"] == CHECKPOINTED_BYTES
    assert runs["compiled"].tenants_bytes["activations"] == CHECKPOINTED_BYTES


def test_the_eager_checkpointed_fit_is_predicted_to_the_byte(runs: dict[str, Any]) -> None:
    assert_the_same_step(runs["eager"], runs["predicted_eager"])


def test_the_compiled_checkpointed_fit_is_predicted_to_the_byte_its_recomputing_backward_too(
    runs: dict[str, Any],
) -> None:
    real, predicted = runs["compiled"], runs["predicted_compiled"]
    assert real.peak_phase == "after_backward"  # the peak is inside the compiled backward, which recomputes
    assert_the_same_step(real, predicted)
    assert any("predicted as compiled" in note for note in predicted.notes)
    assert not any("predicted as they run eagerly" in note for note in predicted.notes)
    assert runs["torchs_kept"]  # the checkpoint's generator and reentrant Function are torch's own after the trace


def test_reentrant_and_selective_checkpoints_are_predicted_as_dynamo_compiles_them(runs: dict[str, Any]) -> None:
    # Dynamo runs a reentrant checkpoint non-reentrant (eagerly this one would fail: the batch requires no grad), and
    # a selective one with the user's policy; all three regions are recomputed in the one compiled backward
    real, predicted = runs["mixed"], runs["predicted_mixed"]
    assert real.tenants_bytes["activations"] == MIXED_BYTES
    assert_the_same_step(real, predicted)
    assert not any("predicted as they run eagerly" in note for note in predicted.notes)
