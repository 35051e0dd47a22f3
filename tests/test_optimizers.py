"""Formulas per optimizer, implementation and precision: Adafactor, foreach/fused temporaries, the GradScaler,
autocast's half copies of weights, activation checkpointing, sharded strategies."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import SEED_P, SEED_WEIGHTS, plain_step
from seed_mlp import seed_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memtenants import TenantMonitor
from lightning_memtenants.analysis.formulas import (
    StateSpec,
    deepspeed_estimator_bytes,
    deepspeed_zero_bytes,
    expected_fixed_cost,
    explain_fixed_cost,
    fsdp_fixed_cost_bytes,
    fsdp_gathered_bytes,
    grad_scaler_bytes,
    optimizer_implementation,
    sharded_state_bytes,
    step_temporaries_bytes,
    zero_partition,
    zero_state_bytes,
)
from lightning_memtenants.core.census import ActivationTracker, checkpointed_regions, take_census
from lightning_memtenants.core.tracker import LiveTensorTracker


def meta_seed_step(dtype: torch.dtype, factory) -> tuple[dict[str, int], object]:
    """One step of the article's model on the meta device: exact bytes, no memory, no time."""
    with torch.device("meta"):
        model = seed_model().to(dtype)
    optimizer = factory(model.parameters())
    model(torch.randn(2, 1024, device="meta", dtype=dtype)).float().pow(2).mean().backward()
    optimizer.step()
    return take_census(model, [optimizer]), expected_fixed_cost(model, [optimizer])


def test_seed_bf16_true_adam_spot_check() -> None:
    measured, expected = meta_seed_step(torch.bfloat16, torch.optim.Adam)
    assert measured["weights"] == expected.weights_bytes == 50_350_080 == 2 * SEED_P
    assert measured["gradients"] == expected.gradients_bytes == 50_350_080
    assert measured["optimizer_state"] == expected.optimizer_state_bytes == 100_700_160 + 24


def test_seed_fp32_sgd_momentum_spot_check() -> None:
    measured, expected = meta_seed_step(torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert measured["optimizer_state"] == expected.optimizer_state_bytes == 100_700_160 == SEED_WEIGHTS


def test_seed_adamw_amsgrad_spot_check() -> None:
    measured, expected = meta_seed_step(torch.float32, lambda ps: torch.optim.AdamW(ps, amsgrad=True))
    assert measured["optimizer_state"] == expected.optimizer_state_bytes == 302_100_480 + 24 == 12 * SEED_P + 24


def test_adafactor_state_is_factored_not_proportional_to_p() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 50), nn.Tanh(), nn.Linear(50, 2))
    kernel = nn.Parameter(torch.randn(3, 4, 5))  # factored over its last two dimensions, 3 times
    optimizer = torch.optim.Adafactor([*model.parameters(), kernel])
    (model(torch.randn(4, 30)).sum() + kernel.sum()).backward()
    optimizer.step()
    measured = take_census(model, [optimizer])
    # weights: row (50) + column (30) factors; biases: a full-size variance; the kernel: 3 x (4 + 5); 5 steps:
    # 864 bytes, where Adam's two moments of the model's 1,652 parameters alone would take 8 x 1,652
    state = (50 + 30) * 4 + 50 * 4 + (2 + 50) * 4 + 2 * 4 + 3 * (4 + 5) * 4 + 5 * 4
    assert measured["optimizer_state"] == expected_fixed_cost(model, [optimizer]).optimizer_state_bytes == state
    assert explain_fixed_cost(expected_fixed_cost(model, [optimizer]), measured, model, [optimizer]) == [
        "some optimizer parameters are not in the module and are not counted as weights"
    ]


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 32))


IMPLEMENTATIONS = {
    "single-tensor": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


FUSED = ("Adam", "AdamW", "Adagrad", "SGD")  # the optimizers torch 2.13 has fused kernels for


NAMES = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta", "Adagrad", "RMSprop", "Adafactor", "SGD")
# temporaries of torch's step: the single-tensor loop makes k tensors the size of one parameter at a time (k x the
# largest), foreach makes k lists the size of all parameters (k x their total), fused none; momentum SGD none
SINGLE_TENSOR_K = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 1, "Adadelta": 2, "Adagrad": 1}
SINGLE_TENSOR_K |= {"RMSprop": 1, "Adafactor": 1, "SGD": 0}
FOREACH_K = {name: 2 if name in ("Adadelta", "Adagrad") else 0 if name == "SGD" else 1 for name in NAMES}


@pytest.mark.parametrize(
    ("name", "implementation"),
    [(n, i) for i in IMPLEMENTATIONS for n in NAMES if i != "fused" or n in FUSED],
)
def test_step_temporaries_follow_the_implementation(name: str, implementation: str) -> None:
    model = small()
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {}
    optimizer = getattr(torch.optim, name)(model.parameters(), **kwargs, **IMPLEMENTATIONS[implementation])
    assert optimizer_implementation(optimizer) == implementation
    gc.collect()  # nothing of earlier tests' is collected during the measured step
    for _ in range(2):  # the second step: the state exists, what remains are the temporaries
        model(torch.randn(4, 64)).pow(2).mean().backward()
        roots = [*model.parameters(), *(p.grad for p in model.parameters())]
        roots += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        with LiveTensorTracker("cpu") as tracker:
            tracker.register(roots)
            optimizer.step()
            allocated, peak = tracker.read()
        optimizer.zero_grad(set_to_none=False)
    temporaries = peak - allocated
    expected = step_temporaries_bytes(optimizer)
    largest, total = 256 * 128 * 4, sum(p.numel() * 4 for p in model.parameters())
    if implementation == "foreach" or expected == 0:
        assert temporaries == expected
    else:  # the single-tensor loop: k x the largest parameter, and at most a bias-sized temporary next to it
        assert expected <= temporaries <= expected + 4096
    if implementation == "foreach":
        assert expected == FOREACH_K[name] * total
    elif implementation == "single-tensor":
        assert expected == SINGLE_TENSOR_K[name] * largest
    else:
        assert expected == 0


def test_default_implementation_is_torch_s_choice_on_cpu() -> None:
    model = small()
    assert optimizer_implementation(torch.optim.Adam(model.parameters())) == "single-tensor"
    assert optimizer_implementation(torch.optim.Adam(model.parameters(), foreach=False)) == "single-tensor"
    assert optimizer_implementation(torch.optim.Adam(model.parameters(), differentiable=True)) == "single-tensor"
    with torch.device("meta"):
        meta = small()
    # meta tensors are no foreach device, so torch's default stays single-tensor there too
    assert optimizer_implementation(torch.optim.Adam(meta.parameters())) == "single-tensor"


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_peak_explanation_names_the_implementation(implementation: str) -> None:
    model = small()
    optimizer = torch.optim.Adam(model.parameters(), **IMPLEMENTATIONS[implementation])
    monitor = TenantMonitor(model, [optimizer], source="auto")
    for _ in range(2):
        report, _ = plain_step(monitor, model, optimizer, torch.randn(2, 64))
    assert f"Adam ({implementation})" in report.peak_explanation
    if implementation == "foreach":
        total = sum(p.numel() * 4 for p in model.parameters())
        assert report.peak_phase == "batch_end"
        assert f"expects {total / 2**20:.2f} MiB" in report.peak_explanation
    else:
        # the fused kernel makes no temporaries: the peak is in backward, where gradients appear beside activations
        assert report.peak_phase == "after_backward"
        assert report.peak_explanation.endswith("the optimizer step (Adam (fused)) stayed below it")


def test_grad_scaler_state_and_unscale_on_cpu() -> None:
    model = small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 64)).float().pow(2).mean()
    scaler.scale(loss).backward()
    assert grad_scaler_bytes(scaler) == 4 + 4  # scale (fp32) and growth tracker (int32), made by scale()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    before = take_census(model, [optimizer])["gradients"]
    scaler.unscale_(optimizer)
    assert take_census(model, [optimizer])["gradients"] == before == grads  # unscale_ works in place
    assert grad_scaler_bytes(scaler) == 4 + 4 + 4  # and adds one found-inf flag for this optimizer
    scaler.step(optimizer)
    scaler.update()
    assert grad_scaler_bytes(scaler) == 8


def test_autocast_copies_of_weights_are_told_apart_from_activations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    tracker = ActivationTracker()
    tracker.params = frozenset(id(p) for p in model.parameters())
    x = torch.randn(8, 6)
    tracker.ignore([x])
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        loss = model(x).float().pow(2).mean()
    tracker.observe(loss)
    # the first layer's input needs no gradient, so its weight's copy is not kept; the next two are
    assert tracker.cast_bytes() == (32 * 16 + 1 * 32) * 2
    # activations: the bf16 copy of x and the two Tanh outputs (bf16), the fp32 output that pow keeps
    assert tracker.live_bytes() == (8 * 6 + 8 * 16 + 8 * 32) * 2 + 8 * 4
    loss.backward()
    assert tracker.cast_bytes() == tracker.live_bytes() == 0


def test_activation_checkpointing_is_detected_without_recomputing() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(3))
    x = torch.randn(4, 16)

    def forward(mode: str) -> torch.Tensor:
        h = x
        for i, block in enumerate(blocks):
            # the first block is not checkpointed: reentrant checkpointing needs inputs that require grad
            plain = mode == "none" or i == 0
            h = block(h) if plain else checkpoint(block, h, use_reentrant=mode == "reentrant")
        return h.pow(2).mean()

    sizes = {}
    for mode in ("none", "reentrant", "non-reentrant"):
        monitor = TenantMonitor(blocks, source=None)
        monitor.phase("batch_start", batch=x)
        loss = forward(mode)
        monitor.phase("before_backward", output=loss)
        sizes[mode] = monitor.last_phase().tenants_bytes["activations"]
        loss.backward()
        monitor.phase("after_backward")
        report = monitor.end_step()
        regions = checkpointed_regions(forward(mode))
        assert regions == (0 if mode == "none" else 2)
        sentences = [n for n in report.notes if n.startswith("activation checkpointing")]
        assert sentences == (
            []
            if mode == "none"
            else [
                "activation checkpointing: 2 checkpointed region(s) keep only their inputs for backward and"
                " recompute the rest, so the activations tenant is smaller than the forward's"
            ]
        )
    # 4 x 16 fp32 numbers (256 bytes) each: without checkpointing every block keeps its Tanh output and its
    # output (the next block's or pow's input); the two checkpointed blocks keep only their inputs, and the last
    # output stays for pow, so their Tanh outputs are not kept
    out = 4 * 16 * 4
    assert sizes == {"none": 6 * out, "reentrant": 4 * out, "non-reentrant": 4 * out}


def test_zero_partition_follows_torch_s_greedy_rule() -> None:
    # the module of tests/test_ddp.py: Linear(32, 64), Tanh, Linear(64, 16)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    params = list(model.parameters())
    owned = zero_partition([params], 2)
    assert [[tuple(p.shape) for p in rank] for rank in owned] == [[(64, 32)], [(16, 64), (64,), (16,)]]
    adam = StateSpec(("exp_avg", "exp_avg_sq"), ("step",))
    # what each rank measured in the 2-process run (tests/test_ddp.py): 16,388 and 8,844 bytes
    assert zero_state_bytes([params], 2, adam) == [8 * 2048 + 4, 8 * (1024 + 64 + 16) + 3 * 4]
    assert (
        sum(zero_state_bytes([params], 4, adam))
        == expected_fixed_cost(model, [torch.optim.Adam(params)]).optimizer_state_bytes
    )


def test_sharded_formulas() -> None:
    # fp32 Adam under FSDP: 16P/N per rank, plus the largest unit gathered unsharded for forward and backward
    assert fsdp_fixed_cost_bytes(SEED_P, 1) == 16 * SEED_P
    assert fsdp_fixed_cost_bytes(SEED_P, 4) == 4 * SEED_P
    assert fsdp_fixed_cost_bytes(SEED_P, 4, gathered_params=4096 * 4096 + 4096) == 4 * SEED_P + 4 * (4096 * 4097)
    assert fsdp_fixed_cost_bytes(SEED_P, 2, param_bytes=2, grad_bytes=2, state_bytes_per_param=4) == 4 * SEED_P
    assert fsdp_gathered_bytes(nn.Linear(3, 5)) == 0  # no fully_shard unit; tests/test_ddp.py measures a sharded one
    assert sharded_state_bytes(10, 3) == 4
    with pytest.raises(ValueError, match="world_size"):
        sharded_state_bytes(10, 0)
    # DeepSpeed ZeRO with fp16 mixed-precision Adam (paper): 16P, 4P + 12P/N, 2P + 14P/N, 16P/N
    p, n = 7_500_000_000, 64
    assert [deepspeed_zero_bytes(s, p, n) for s in range(4)] == [120e9, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    # DeepSpeed's own estimator has the same shape with rounder constants: 4P + 16P/N, 4 L + 18P/N
    assert deepspeed_estimator_bytes(2, p, n) == 4 * p + 16 * p // n
    assert deepspeed_estimator_bytes(3, p, n, largest_layer_params=10**8) == 4 * 10**8 + 18 * p // n
    assert deepspeed_zero_bytes(2, p, n) < deepspeed_estimator_bytes(2, p, n)
    with pytest.raises(ValueError, match="stage"):
        deepspeed_zero_bytes(4, p, n)
