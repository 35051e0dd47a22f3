"""The tenants under every checkpointing method: SAC's cache, full checkpointing's recomputation, offloads.

Every figure is worked out by hand, fp32 (4 bytes an element), for two blocks ``Linear(D, 4D) -> GELU -> Linear(4D, D)``
on a batch of ``B`` rows and the loss ``model(x).pow(2).mean()``:

- a checkpointed region keeps its input (block 0's is the batch, never an activation; block 1's is block 0's output,
  ``B * D`` elements), and ``pow`` keeps the model's output (``B * D``);
- selective checkpointing with a policy that saves the matmuls (``aten.addmm``) keeps, per block, the first Linear's
  output (``B * 4D``) and the second's (``B * D``) in its cache; block 0's second output is block 1's input, and block
  1's is the model's output, one storage each, counted once;
- full checkpointing keeps the inputs only: what backward recomputes is alive only during backward.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import plain_step
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_memtenants import PHASES, TenantMonitor, predict
from lightning_memtenants.core.census import selective_cache
from lightning_memtenants.core.timeline import LAYERS, timeline_of

B, D = 32, 64
FP32 = 4
WIDE = B * 4 * D * FP32  # 32,768 bytes: a block's first Linear's output (and GELU's)
NARROW = B * D * FP32  # 8,192 bytes: a block's output
INPUTS = NARROW + NARROW  # block 1's input (block 0's output) and the model's output, which pow keeps
SAC_ACTIVATIONS = INPUTS + 2 * WIDE  # the cache adds each block's wide matmul output; its narrow ones are the inputs
PARAMS = (D * 4 * D + 4 * D + 4 * D * D + D) * FP32  # 132,352 bytes a block
ENTER = torch.autograd.graph.saved_tensors_hooks.__enter__


def save_matmuls(ctx: object, func: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """The policy: keep what the matmuls return, recompute the rest (GELU)."""
    if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAC = functools.partial(create_selective_checkpoint_contexts, save_matmuls)


class Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "sac":
            return checkpoint(self.mlp, x, use_reentrant=False, context_fn=SAC)
        if self.how == "full":
            return checkpoint(self.mlp, x, use_reentrant=False)
        return self.mlp(x)


def blocks(how: str) -> nn.Sequential:
    return nn.Sequential(Block(how), Block(how))


def wrapped_blocks() -> nn.Sequential:
    """torchtitan's way: each block in FSDP's ``checkpoint_wrapper`` with a selective ``context_fn``."""
    mlp = [nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(2)]
    return nn.Sequential(*(checkpoint_wrapper(m, context_fn=SAC) for m in mlp))


def mean_square(model: nn.Module, batch: object) -> torch.Tensor:
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return model(x).pow(2).mean()


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def real_steps(model: nn.Module, steps: int = 2) -> object:
    """``steps`` real CPU steps under a monitor (the split by module needs the second measured one): the last report."""
    torch.manual_seed(0)
    optimizer = sgd(model.parameters())
    x = torch.randn(B, D)
    monitor = TenantMonitor(model, [optimizer])
    for _ in range(steps):
        report, _ = plain_step(monitor, model, optimizer, x)
    return report


def by_module_before_backward(how: str) -> dict[str, int]:
    """Each block's first Linear owns its cached output; its second Linear owns the block's output."""
    split = {"0.mlp.2": NARROW, "1.mlp.2": NARROW}
    if how == "sac":
        split.update({"0.mlp.0": WIDE, "1.mlp.0": WIDE})
    return dict(sorted(split.items(), key=lambda kv: (-kv[1], kv[0])))


def test_selective_checkpointings_cache_is_activations_in_a_real_cpu_run() -> None:
    report = real_steps(blocks("sac"))
    assert report.phases["before_backward"].tenants_bytes == {
        "weights": 2 * PARAMS,
        "gradients": 0,
        "optimizer_state": 0,
        "activations": SAC_ACTIVATIONS,  # 81,920: the inputs alone would be 16,384
    }
    assert report.phases["after_backward"].tenants_bytes["activations"] == 0  # backward consumed the cache
    assert report.graph.checkpointed_regions == 2 and report.graph.selective_regions == 2
    assert (
        "activation checkpointing: 2 checkpointed region(s), 2 of them selective, keep their inputs and the outputs"
        " of the operators their policy saves (its cache, counted as activations) for backward and recompute the rest"
    ) in report.notes
    timeline = timeline_of(report)
    assert timeline.activations_before_backward_bytes == by_module_before_backward("sac")
    # the peak is in block 0's backward: block 1's cache is consumed and freed, block 0's is alive
    assert report.activations_by_module_at == "peak"
    assert report.activations_by_module_bytes == {"0.mlp.0": WIDE, "0.mlp.2": NARROW}


@pytest.mark.parametrize("how", ["sac", "full"])
def test_a_prediction_counts_checkpointed_activations_as_the_real_run_does(how: str) -> None:
    real = real_steps(blocks(how))
    predicted = predict(lambda: blocks(how), (torch.Size([B, D]),), loss_fn=mean_square, optimizer=sgd, steps=2)
    expected = SAC_ACTIVATIONS if how == "sac" else INPUTS
    for name in PHASES:
        assert predicted.phases[name].tenants_bytes == real.phases[name].tenants_bytes, name
    assert predicted.phases["before_backward"].tenants_bytes["activations"] == expected
    assert timeline_of(predicted).activations_before_backward_bytes == by_module_before_backward(how)
    assert predicted.activations_by_module_at == real.activations_by_module_at
    assert predicted.activations_by_module_bytes == real.activations_by_module_bytes


def test_full_checkpointings_recomputation_is_temporaries_of_backward() -> None:
    """Backward recomputes each block's GELU input and output (both ``B x 4D``, alive together until the block's
    backward uses them): temporaries, never the forward's activations, anywhere on the timeline."""
    predicted = predict(lambda: blocks("full"), (torch.Size([B, D]),), loss_fn=mean_square, optimizer=sgd, steps=2)
    timeline = timeline_of(predicted)
    assert max(timeline.layers["activations"]) == INPUTS
    assert predicted.phases["before_backward"].tenants_bytes["activations"] == INPUTS
    marks = [at for _, at, _ in timeline.phases]
    backward = [i for i, at in enumerate(timeline.op_index) if marks[1] < at <= marks[2]]
    assert max(timeline.layers["temporaries"][i] for i in backward) >= 2 * WIDE + NARROW  # + the batch
    # the step's peak is in block 0's backward, where its region was recomputed: block 0's frame keeps only the batch,
    # block 1's frame and pow's saved output are released, so no activation is alive, and the recomputation is there
    assert timeline.peak_phase == "after_backward" and timeline.peak_module == "0.mlp.2 (backward)"
    at_peak = {name: values[timeline.peak_point] for name, values in timeline.layers.items()}
    assert at_peak["activations"] == 0 and at_peak["temporaries"] >= 2 * WIDE + NARROW
    assert predicted.activations_by_module_at == "before_backward"
    assert predicted.graph.checkpointed_regions == 2 and predicted.graph.selective_regions == 0


def own_offload() -> torch.autograd.graph.saved_tensors_hooks:
    """A user's pack hook that moves the tensor to the CPU, and back in unpack."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: (t.device, t.to("cpu")), lambda p: p[1].to(p[0]))


def offloaded(kind: str) -> object:
    def loss_fn(model: nn.Module, batch: object) -> torch.Tensor:
        hooks = {
            "save_on_cpu": torch.autograd.graph.save_on_cpu,
            "pinned": functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=True),
            "own": own_offload,
        }[kind]
        with hooks():
            return mean_square(model, batch)

    return loss_fn


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))


@pytest.mark.parametrize("kind", ["save_on_cpu", "pinned", "own"])
def test_offloaded_saved_tensors_are_host_memory_in_a_gpu_prediction(kind: str) -> None:
    """Every saved tensor goes through the hook: the batch (Linear 0 keeps its input; its weight is not kept, as the
    batch needs no gradient), the GELU's input and output, Linear 1's transposed weight, and the output pow keeps."""
    shape = (torch.Size([B, D]),)
    plain = predict(mlp, shape, loss_fn=mean_square, optimizer=sgd, target="A100")
    moved = predict(mlp, shape, loss_fn=offloaded(kind), optimizer=sgd, target="A100")
    assert torch.autograd.graph.saved_tensors_hooks.__enter__ is ENTER  # the dry run's wrapper is gone
    copies = NARROW + WIDE + WIDE + 4 * D * D * FP32 + NARROW  # 147,456 bytes of host copies
    assert moved.graph.offloaded_bytes == copies and moved.graph.hooked == 5
    before, before_plain = moved.phases["before_backward"], plain.phases["before_backward"]
    assert before_plain.tenants_bytes["activations"] == 2 * WIDE + NARROW
    assert before.tenants_bytes["activations"] == 0
    # the device copies were freed after the forward: allocated drops by exactly the activations (all 512-multiples)
    assert before_plain.allocated_bytes - before.allocated_bytes == 2 * WIDE + NARROW
    assert any(f"{copies:,} bytes of them were moved off the device to host memory" in note for note in moved.notes)


def test_offloading_on_a_cpu_keeps_the_tensor_on_the_device() -> None:
    """On the CPU, the device is the host: save_on_cpu keeps the tensor itself, which stays an activation."""
    moved = predict(mlp, (torch.Size([B, D]),), loss_fn=offloaded("save_on_cpu"), optimizer=sgd)
    assert moved.phases["before_backward"].tenants_bytes["activations"] == 2 * WIDE + NARROW
    assert moved.graph.offloaded_bytes == 0 and moved.graph.hooked == 5


@pytest.mark.parametrize("model", ["fsdp", "sac under fsdp", "sac"])
def test_the_timeline_files_each_storage_under_the_phase_tables_tenant(model: str) -> None:
    """At each phase boundary the timeline's layers are the phase table's tenants, to the byte: FSDP2's shards, their
    gradients and Adam's DTensor state included (each rank holds half of every tensor: every dimension 0 is even)."""
    build = {"fsdp": mlp, "sac under fsdp": wrapped_blocks, "sac": lambda: blocks("sac")}[model]
    sharded = {"strategy": "fsdp", "world_size": 2} if "fsdp" in model else {}
    predicted = predict(build, (torch.Size([B, D]),), loss_fn=mean_square, steps=2, **sharded)
    timeline = timeline_of(predicted)
    assert [name for name, _, _ in timeline.phases] == list(PHASES)
    for (name, _, _), layers in zip(timeline.phases, timeline.phase_layers, strict=True):
        assert {t: layers[t] for t in LAYERS[:-1]} == predicted.phases[name].tenants_bytes, name
    blocks_held = 1 if model == "fsdp" else 2
    weights = blocks_held * PARAMS // (2 if sharded else 1)
    steps_bytes = blocks_held * 4 * FP32  # Adam's step counter, one fp32 scalar per parameter tensor
    assert timeline.phase_layers[-1]["weights"] == weights
    assert timeline.phase_layers[-1]["optimizer_state"] == 2 * weights + steps_bytes
    if "sac" in model:
        assert timeline.phase_layers[1]["activations"] == SAC_ACTIVATIONS


def test_the_selective_cache_reader_fails_soft() -> None:
    """A frame of another layout (another torch) gives nothing, never an error."""
    assert selective_cache(None) == []
    assert selective_cache(object()) == []
    broken = type("Frame", (), {"recompute_fn": staticmethod(lambda: None), "saved_args": []})()
    assert selective_cache(broken) == []
