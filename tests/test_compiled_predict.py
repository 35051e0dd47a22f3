"""Compiled models predicted as compiled (issue #31): the saved set of inductor's partitioner, to the byte.

The real runs are plain compiled steps with inductor on the CPU, once per module (a fixture). Their saved tensors
are read by a graph walk of this file's own: every node's ``_saved_*`` tensors, and ``saved_tensors`` of the
``CompiledFunctionBackward`` node that AOT autograd leaves, less the parameters and the batch (the weights and
the input, not activations), each storage once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_models import GatedLM, gated_blocks, square_loss
from conftest import CLOSURE_DIVISOR, CollectedEachStep, make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memtenants import MemoryTenantsCallback, dry_run, predict

pytestmark = pytest.mark.slow

BATCH = torch.Size([64, 256])
FLOAT = 4
# One block's saved tensors run eagerly, by hand: LayerNorm's mean and rstd (64 each), its output h (64 x 256, read
# by fc1 and gate), fc1's output (GELU's input), the sigmoid's output, GELU's output (both read by the product),
# the product (fc2's input); the first block's LayerNorm input is the batch, the others' the previous block's out.
EAGER_BLOCK_BYTES = (2 * 64 + 64 * 256 + 4 * 64 * 1024) * FLOAT
EAGER_BYTES = 3 * EAGER_BLOCK_BYTES + 3 * 64 * 256 * FLOAT  # two blocks' inputs, and the output (the loss's pow)


def saved_bytes(loss: torch.Tensor, exclude: list[torch.Tensor]) -> int:
    """The bytes of the distinct storages the autograd graph of ``loss`` saved, less those of ``exclude``."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    storages: dict[int, int] = {}
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        tensors: list[torch.Tensor] = []
        if type(node).__name__ == "CompiledFunctionBackward":
            tensors += [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                values = value if isinstance(value, (tuple, list)) else (value,)
                tensors += [t for t in values if isinstance(t, torch.Tensor)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage._cdata not in skip:
                storages[storage._cdata] = storage.nbytes()
        stack += [fn for fn, _ in node.next_functions]
    return sum(storages.values())


def real_step(model: nn.Module, compiled: nn.Module) -> tuple[int, torch.Tensor, int]:
    """One real step: the saved bytes at the backward, the loss, the graphs Dynamo compiled so far."""
    batch = torch.randn(BATCH, generator=torch.Generator().manual_seed(1))
    loss = square_loss(compiled, batch)
    saved = saved_bytes(loss, [*model.parameters(), batch])
    loss.backward()
    return saved, loss.detach(), torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def real() -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = gated_blocks()
    batch = torch.randn(BATCH, generator=torch.Generator().manual_seed(1))
    result: dict[str, Any] = {"eager": saved_bytes(square_loss(model, batch), [*model.parameters(), batch])}
    result["compiled"], result["loss"], result["graphs"] = real_step(model, torch.compile(model))
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        model = gated_blocks()
        result["half"] = real_step(model, torch.compile(model))[0]
        result["predicted_half"] = predict(torch.compile(model), BATCH, loss_fn=square_loss)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = gated_blocks()
    compiled = torch.compile(model)
    counters = torch._dynamo.utils.counters
    before = {name: dict(counter) for name, counter in counters.items()}
    result["prediction"] = dry_run(compiled, BATCH, loss_fn=square_loss)
    result["counters_kept"] = {name: dict(counter) for name, counter in counters.items() if counter} == before
    result["graphs_after_predict"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["cuda"] = predict(compiled, BATCH, loss_fn=square_loss, target="A100")
    result["eager_cuda"] = predict(model, BATCH, loss_fn=square_loss, target="A100")
    _, result["loss_after"], result["graphs_after"] = real_step(model, compiled)
    result["eager_prediction"] = predict(model, BATCH, loss_fn=square_loss)
    torch._dynamo.reset()
    callback = MemoryTenantsCallback(print_summary=False)
    data = DataLoader(TensorDataset(torch.randn(4 * BATCH[0], BATCH[1])), batch_size=BATCH[0])
    make_trainer([CollectedEachStep(), callback], steps=2).fit(GatedLM(compiled=True), data)
    result["fit"] = callback.latest
    result["fit_prediction"] = predict(GatedLM(compiled=True), (BATCH,), steps=2)
    torch._dynamo.reset()
    return result


def test_the_eager_model_saves_what_is_worked_out_by_hand(real: dict[str, Any]) -> None:
    assert real["eager"] == EAGER_BYTES == 3_540_480
    assert real["eager_prediction"].tenants_bytes["activations"] == real["eager"]


def test_a_compiled_model_is_predicted_with_inductors_saved_set_to_the_byte(real: dict[str, Any]) -> None:
    assert real["compiled"] == 2_753_792  # measured: inductor recomputes the cheap pointwise work
    assert real["prediction"].report.tenants_bytes["activations"] == real["compiled"]
    assert real["prediction"].report.tenants_bytes["activations"] < real["eager"]
    note = next(n for n in real["prediction"].notes if "predicted as compiled" in n)
    assert "min_cut_rematerialization_partition, activation_memory_budget=1" in note
    assert not any("predicted as they run eagerly" in n for n in real["prediction"].notes)


def test_the_activation_memory_budget_changes_the_prediction_as_it_changes_the_real_run(real: dict[str, Any]) -> None:
    assert real["half"] < real["compiled"]
    assert real["predicted_half"].tenants_bytes["activations"] == real["half"]
    assert any("activation_memory_budget=0.5" in n for n in real["predicted_half"].notes)


def test_a_cuda_target_gets_the_same_partitioners_saved_set(real: dict[str, Any]) -> None:
    # every saved tensor here is a multiple of 512 bytes but LayerNorm's 256-byte mean and rstd: the CUDA
    # allocator rounds each of those up to 512 bytes, eagerly and compiled alike (compiled saves them too)
    cuda, eager = real["cuda"].tenants_bytes["activations"], real["eager_cuda"].tenants_bytes["activations"]
    assert eager - cuda == real["eager"] - real["compiled"]
    assert any("predicted as compiled" in n for n in real["cuda"].notes)


def test_the_users_model_compiles_the_same_graphs_after_a_prediction(real: dict[str, Any]) -> None:
    assert real["graphs_after_predict"] == 0  # the prediction compiled nothing through Dynamo
    assert real["counters_kept"]  # nor counted anything: not a pattern matched, not a recompile
    assert real["graphs_after"] == real["graphs"] == 1
    assert torch.equal(real["loss_after"], real["loss"])


def test_a_custom_backend_runs_eagerly_with_a_note() -> None:
    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        return gm.forward

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    prediction = predict(torch.compile(model, backend=backend), torch.Size([4, 8]), loss_fn=square_loss)
    # eagerly: Tanh's output (4 x 32) and the second Linear's input (the same tensor), pow's input (4 x 2)
    assert prediction.tenants_bytes["activations"] == (4 * 32 + 4 * 2) * FLOAT
    assert any("predicted as they run eagerly (OptimizedModule.forward (backend))" in n for n in prediction.notes)


def test_a_module_compiled_in_place_and_a_compiled_helper_are_predicted_as_compiled(real: dict[str, Any]) -> None:
    in_place = gated_blocks()
    in_place.compile()  # a copy drops Module.compile()'s call: the user's module still holds it

    class Helper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = gated_blocks()
            self.run = torch.compile(self._run)  # bound to the user's module: the copy's own runs instead

        def _run(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.run(x)

    prediction = predict(Helper(), BATCH, loss_fn=square_loss)
    assert prediction.tenants_bytes["activations"] == real["compiled"]  # the same graph as the whole model's
    assert any("torch.compile'd Helper.run (inductor) predicted as compiled" in n for n in prediction.notes)
    # Module.compile() of an nn.Sequential: Dynamo skips torch's own frames and compiles each block's forward, a
    # graph per block, which saves each block's output apart; of torch's modules alone, it compiles nothing
    torch_only = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    torch_only.compile()
    for model, graphs in ((in_place, 2), (torch_only, 0)):  # the three blocks share code: two graphs, one recompile
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        saved = real_step(model, model)[0]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        torch._dynamo.reset()
        assert predict(model, BATCH, loss_fn=square_loss).tenants_bytes["activations"] == saved
    assert saved == (64 * 1024 + 64 * 1024 + 64 * 256) * FLOAT  # eagerly: GELU's input and output, pow's input
    blocks = predict(in_place, BATCH, loss_fn=square_loss).notes
    assert any("Sequential._compiled_call_impl/0, Sequential._compiled_call_impl/1" in n for n in blocks)
    eager = predict(torch_only, BATCH, loss_fn=square_loss).notes
    assert any("Module.compile() of a module of torch's own: Dynamo skips its frames" in n for n in eager)


class Picks(nn.Module):
    """Keeps the even features: their indices come from ``nonzero`` over constants, a size set by values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.arange(32) % 2 == 0).nonzero().flatten()
        return torch.tanh(self.fc(x))[:, keep]


def test_a_callable_aot_autograd_cannot_trace_alone_runs_eagerly_with_a_note() -> None:
    prediction = predict(torch.compile(Picks()), torch.Size([4, 8]), loss_fn=square_loss)
    # eagerly: Tanh's output (4 x 32 floats), the 16 int64 indices, pow's input (4 x 16 floats)
    assert prediction.tenants_bytes["activations"] == 4 * 32 * FLOAT + 16 * 8 + 4 * 16 * FLOAT
    note = next(n for n in prediction.notes if "OptimizedModule.forward could not be traced without Dynamo" in n)
    assert "its submodules fc are traced each on its own" in note  # as Dynamo's graph after the break holds it


def test_aot_eager_is_predicted_with_its_own_partitioner_and_reduce_overhead_gets_a_note() -> None:
    torch._dynamo.reset()
    model = gated_blocks()
    compiled = torch.compile(model, backend="aot_eager")
    prediction = predict(compiled, BATCH, loss_fn=square_loss)
    assert prediction.tenants_bytes["activations"] == real_step(model, compiled)[0]
    assert any("the aot_eager backends trace as torch registers them" in n for n in prediction.notes)
    torch._dynamo.reset()
    graphs = predict(torch.compile(gated_blocks(1), mode="reduce-overhead"), BATCH, loss_fn=square_loss)
    assert any("mode='reduce-overhead' runs CUDA graphs, whose memory pool is not modelled" in n for n in graphs.notes)


def test_a_compiled_fit_is_predicted_to_the_byte_its_peak_too(real: dict[str, Any]) -> None:
    fit, prediction = real["fit"], real["fit_prediction"]
    assert fit.memory_source.startswith("live-tensor tracker")  # measured, compiled kernels and all
    assert fit.tenants_bytes == prediction.tenants_bytes
    assert fit.tenants_bytes["activations"] == real["compiled"] + CLOSURE_DIVISOR  # Lightning's closure's divisor
    assert prediction.peak_bytes == fit.peak_bytes


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A causal LM's own loss on its batch, the cache off, as a compiled training step runs it."""
    return model(**batch, labels=batch["input_ids"], use_cache=False).loss


@pytest.mark.parametrize(
    ("name", "mask", "compiled_bytes", "gap"),
    [("gpt2", True, 1_590_692, -1_056), ("llama", False, 1_139_236, 0)],
)
def test_hugging_face_models_are_predicted_compiled(name: str, mask: bool, compiled_bytes: int, gap: int) -> None:
    # HF's mask code takes its traced path under a compile (is_compiling()), as it does for Dynamo; GPT-2's
    # dropout goes through inductor's random passes. The rotary buffer Llama's backward reads is a weight.
    # GPT-2's loss_function logs (its loss_type is unset), where Dynamo breaks the graph: the prediction traces its
    # submodules each as a graph and runs the loss between them eagerly, which saves 1,056 bytes less (measured).
    from hf_models import BATCH as ROWS
    from hf_models import SEQ, VOCAB, hf_model

    torch.manual_seed(0)
    model = hf_model(name)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, **({"attention_mask": torch.ones_like(ids)} if mask else {})}
    weights = [*model.parameters(), *model.buffers(), *batch.values()]
    eager = saved_bytes(hf_loss(model, batch), weights)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    loss = hf_loss(compiled, batch)
    real = saved_bytes(loss, weights)
    loss.backward()
    torch._dynamo.reset()
    prediction = dry_run(compiled, batch, loss_fn=hf_loss)
    assert real == compiled_bytes < eager  # measured: inductor recomputes the cheap pointwise work
    assert prediction.report.tenants_bytes["activations"] == real + gap
    broken = [n for n in prediction.notes if "predicted as they run eagerly" in n]
    if gap:
        assert "(GraphBreak: logging.Logger.warning_once() in transformers/modeling_utils.py)" in broken[0]
        assert "its submodules transformer, lm_head are traced each on its own" in broken[0]
    else:
        assert broken == []
