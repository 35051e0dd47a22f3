from __future__ import annotations

import pytest
import torch
from conftest import SEED_P, SEED_WEIGHTS
from seed_mlp import seed_model
from torch import nn

from lightning_memtenants.analysis.formulas import expected_fixed_cost, explain_fixed_cost
from lightning_memtenants.core.census import take_census

# Two weight matrices and two biases: 3*5 + 5 + 5*2 + 2 = 32 parameters in 4 tensors.
P, TENSORS = 32, 4


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    dtype = next(model.parameters()).dtype
    model(torch.randn(4, 3, dtype=dtype)).float().pow(2).mean().backward()
    optimizer.step()
    return take_census(model, [optimizer])


# (optimizer factory, full-size state tensors per parameter, fp32 scalars per parameter tensor)
CASES = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), 0, 0),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1, 0),
    "sgd-nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), 1, 0),
    "adam": (lambda ps: torch.optim.Adam(ps), 2, 1),
    "adam-amsgrad": (lambda ps: torch.optim.Adam(ps, amsgrad=True), 3, 1),
    "adamw": (lambda ps: torch.optim.AdamW(ps), 2, 1),
    "adamw-amsgrad": (lambda ps: torch.optim.AdamW(ps, amsgrad=True), 3, 1),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps), 1, 1),
    "rmsprop-centered-momentum": (lambda ps: torch.optim.RMSprop(ps, centered=True, momentum=0.9), 3, 1),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps), 1, 1),
    "adadelta": (lambda ps: torch.optim.Adadelta(ps), 2, 1),
    "adamax": (lambda ps: torch.optim.Adamax(ps), 2, 1),
    "nadam": (lambda ps: torch.optim.NAdam(ps), 2, 2),
    "radam": (lambda ps: torch.optim.RAdam(ps), 2, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_formula_is_exact_after_the_first_step(name: str) -> None:
    factory, full, scalars = CASES[name]
    model = small_model()
    optimizer = factory(model.parameters())
    measured = one_step(model, optimizer)
    expected = expected_fixed_cost(model, [optimizer])
    assert expected.weights_bytes == measured["weights"] == 4 * P
    assert expected.gradients_bytes == measured["gradients"] == 4 * P
    assert expected.optimizer_state_bytes == measured["optimizer_state"] == full * 4 * P + scalars * 4 * TENSORS
    assert explain_fixed_cost(expected, measured, model, [optimizer]) == []


def test_seed_model_adam_is_16p_plus_24() -> None:
    model = seed_model()
    optimizer = torch.optim.Adam(model.parameters())
    expected = expected_fixed_cost(model, [optimizer])
    assert expected.total_bytes == 16 * SEED_P + 24 == 402_800_664
    assert expected.optimizer_state_bytes == 201_400_344
    assert expected.weights_bytes == expected.gradients_bytes == SEED_WEIGHTS


def test_lazy_state_before_the_first_step_is_explained() -> None:
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    measured = take_census(model, [optimizer])
    expected = expected_fixed_cost(model, [optimizer])
    assert measured["optimizer_state"] == 0
    assert explain_fixed_cost(expected, measured, model, [optimizer]) == [
        "optimizer state is 0 before the first step: Adam creates it lazily"
    ]


def test_adagrad_state_is_eager() -> None:
    model = small_model()
    optimizer = torch.optim.Adagrad(model.parameters())
    assert (
        take_census(model, [optimizer])["optimizer_state"]
        == expected_fixed_cost(model, [optimizer]).optimizer_state_bytes
    )


def test_frozen_layer() -> None:
    model = small_model()
    model[0].requires_grad_(False)  # 15 + 5 = 20 frozen parameters
    optimizer = torch.optim.Adam(model.parameters())
    measured = one_step(model, optimizer)
    expected = expected_fixed_cost(model, [optimizer])
    assert measured["weights"] == expected.weights_bytes == 4 * P
    assert measured["gradients"] == expected.gradients_bytes == 4 * 12
    assert measured["optimizer_state"] == expected.optimizer_state_bytes == 8 * 12 + 4 * 2
    assert explain_fixed_cost(expected, measured, model, [optimizer]) == [
        "20 frozen parameters have no gradient and no optimizer state"
    ]


def test_tied_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    measured = take_census(model, [optimizer])
    expected = expected_fixed_cost(model, [optimizer])
    assert measured["weights"] == measured["gradients"] == measured["optimizer_state"] == 160
    assert expected.total_bytes == 480
    assert explain_fixed_cost(expected, measured, model, [optimizer]) == [
        "tied weights counted once: 1.weight is 0.weight (40 parameters)"
    ]


def test_parameter_groups_with_different_options() -> None:
    model = small_model()
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "momentum": 0.9}, {"params": model[2].parameters()}], lr=0.1
    )
    measured = one_step(model, optimizer)
    assert measured["optimizer_state"] == expected_fixed_cost(model, [optimizer]).optimizer_state_bytes == 4 * 20


def test_unused_parameters_are_explained() -> None:
    model = small_model()
    spare = nn.Linear(2, 2)  # 6 parameters that never take part in the loss
    both = nn.ModuleList([model, spare])
    optimizer = torch.optim.SGD(both.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    measured = take_census(both, [optimizer])
    expected = expected_fixed_cost(both, [optimizer])
    assert expected.gradients_bytes - measured["gradients"] == 6 * 4
    assert explain_fixed_cost(expected, measured, both, [optimizer]) == [
        "6 trainable parameters have no gradient: they took no part in the loss"
    ]


def test_unknown_optimizer_is_measured_per_parameter() -> None:
    class Twice(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["copy"] = p.grad.clone()
                    self.state[p]["copy2"] = p.grad.clone()

    model = small_model()
    optimizer = Twice(model.parameters())
    measured = one_step(model, optimizer)
    expected = expected_fixed_cost(model, [optimizer])
    assert measured["optimizer_state"] == 8 * P
    assert expected.optimizer_state_bytes == 0
    assert explain_fixed_cost(expected, measured, model, [optimizer]) == [
        "unknown optimizer Twice: measured 8.0 bytes per parameter"
    ]


def test_dtypes_come_from_the_tensors() -> None:
    model = small_model().to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters())
    measured = one_step(model, optimizer)
    expected = expected_fixed_cost(model, [optimizer])
    assert measured["weights"] == expected.weights_bytes == 2 * P
    assert measured["optimizer_state"] == expected.optimizer_state_bytes == 4 * P + 4 * TENSORS
