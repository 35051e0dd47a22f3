"""Fixed-cost formulas: what weights, gradients and optimizer state should cost.

The formula is computed from the optimizer classes and hyperparameters, the parameters'
real dtypes and which parameters are trainable, and then checked against the census, so
that every byte of difference gets a sentence that explains it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


@dataclass(frozen=True)
class StateSpec:
    """Per-parameter optimizer state: full-size tensors and fp32 scalar counters."""

    full_size: tuple[str, ...]
    scalars: tuple[str, ...] = ()
    lazy: bool = True


def _adam(group: dict) -> StateSpec:
    extra = ("max_exp_avg_sq",) if group.get("amsgrad") else ()
    return StateSpec(("exp_avg", "exp_avg_sq", *extra), ("step",))


def _sgd(group: dict) -> StateSpec:
    return StateSpec(("momentum_buffer",) if group.get("momentum", 0) else ())


def _rmsprop(group: dict) -> StateSpec:
    full = ("square_avg",)
    if group.get("momentum", 0) > 0:
        full += ("momentum_buffer",)
    if group.get("centered"):
        full += ("grad_avg",)
    return StateSpec(full, ("step",))


_SPECS: tuple[tuple[type[Optimizer], object], ...] = (
    (torch.optim.Adam, _adam),
    (torch.optim.AdamW, _adam),
    (torch.optim.SGD, _sgd),
    (torch.optim.RMSprop, _rmsprop),
    (torch.optim.Adagrad, lambda group: StateSpec(("sum",), ("step",), lazy=False)),
    (torch.optim.Adadelta, lambda group: StateSpec(("square_avg", "acc_delta"), ("step",))),
    (torch.optim.Adamax, lambda group: StateSpec(("exp_avg", "exp_inf"), ("step",))),
    (torch.optim.NAdam, lambda group: StateSpec(("exp_avg", "exp_avg_sq"), ("step", "mu_product"))),
    (torch.optim.RAdam, lambda group: StateSpec(("exp_avg", "exp_avg_sq"), ("step",))),
)


def state_spec(optimizer: Optimizer, group: dict) -> StateSpec | None:
    """The state layout of a known optimizer class, or None for one we do not know."""
    for cls, spec in _SPECS:
        if type(optimizer) is cls:
            return spec(group)  # type: ignore[operator]
    return None


def scalar_bytes() -> int:
    """Size of an optimizer's scalar counters: fp32 unless the default dtype is fp64."""
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _unique(tensors: Iterator[Tensor]) -> list[Tensor]:
    seen: set[int] = set()
    out = []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


@dataclass(frozen=True)
class FixedCost:
    """Expected weights + gradients + optimizer state after an optimizer step, in bytes."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    unknown_optimizers: tuple[str, ...] = ()
    unknown_params: int = 0
    notes: tuple[str, ...] = field(default=())
    lazy_optimizers: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes


def expected_fixed_cost(module: nn.Module, optimizers: Sequence[Optimizer] = ()) -> FixedCost:
    """The formula: numel x element size of every weight, gradient and optimizer state tensor.

    For fp32 Adam this is 16 bytes per trainable parameter plus 4 bytes of ``step`` per
    parameter tensor.
    """
    params = _unique(module.parameters())
    buffers = _unique(module.buffers())
    weights = sum(_nbytes(t) for t in params + buffers)
    trainable = [p for p in params if p.requires_grad]
    gradients = sum(_nbytes(p) for p in trainable)

    notes: list[str] = []
    named = list(module.named_parameters(remove_duplicate=False))
    if len(named) > len(params):
        first: dict[int, str] = {}
        shared = []
        for name, p in named:
            if id(p) in first:
                shared.append(f"{name} is {first[id(p)]}")
            else:
                first[id(p)] = name
        tied = sum(p.numel() for name, p in named) - sum(p.numel() for p in params)
        notes.append(f"tied weights counted once: {', '.join(shared)} ({tied:,} parameters)")
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    if frozen:
        notes.append(f"{frozen:,} frozen parameters have no gradient and no optimizer state")

    state = 0
    unknown: list[str] = []
    unknown_params = 0
    lazy: list[str] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            spec = state_spec(optimizer, group)
            if spec is None:
                unknown.append(type(optimizer).__name__)
                unknown_params += sum(p.numel() for p in group["params"] if p.requires_grad)
                continue
            if spec.lazy and (spec.full_size or spec.scalars):
                lazy.append(type(optimizer).__name__)
            for p in group["params"]:
                if p.requires_grad:
                    state += len(spec.full_size) * _nbytes(p) + len(spec.scalars) * scalar_bytes()
    return FixedCost(
        weights_bytes=weights,
        gradients_bytes=gradients,
        optimizer_state_bytes=state,
        unknown_optimizers=tuple(dict.fromkeys(unknown)),
        unknown_params=unknown_params,
        notes=tuple(notes),
        lazy_optimizers=tuple(dict.fromkeys(lazy)),
    )


def explain_fixed_cost(
    expected: FixedCost,
    measured: dict[str, int],
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
) -> list[str]:
    """One plain sentence for each way the census differs from the formula (and its notes)."""
    sentences = list(expected.notes)
    grads = measured["gradients"]
    state = measured["optimizer_state"]
    if expected.unknown_optimizers:
        extra = state - expected.optimizer_state_bytes
        names = ", ".join(expected.unknown_optimizers)
        per_param = extra / max(expected.unknown_params, 1)
        sentences.append(f"unknown optimizer {names}: measured {per_param:.1f} bytes per parameter")
    elif state != expected.optimizer_state_bytes:
        if state == 0 and expected.lazy_optimizers:
            names = ", ".join(expected.lazy_optimizers)
            sentences.append(f"optimizer state is 0 before the first step: {names} creates it lazily")
        else:
            diff = state - expected.optimizer_state_bytes
            sentences.append(f"optimizer state differs from the formula by {diff:+,} bytes")
    if grads != expected.gradients_bytes:
        missing = [p for p in _unique(module.parameters()) if p.requires_grad and p.grad is None]
        if grads == 0:
            sentences.append("gradients are 0: none exist before the first backward or after zero_grad()")
        elif missing:
            count = sum(p.numel() for p in missing)
            sentences.append(f"{count:,} trainable parameters have no gradient: they took no part in the loss")
        else:
            diff = grads - expected.gradients_bytes
            sentences.append(f"gradients differ from the formula by {diff:+,} bytes")
    if measured["weights"] != expected.weights_bytes:
        diff = measured["weights"] - expected.weights_bytes
        sentences.append(f"weights differ from the formula by {diff:+,} bytes: some share or view a larger storage")
    if _optimizer_params_outside(module, optimizers):
        sentences.append("some optimizer parameters are not in the module and are not counted as weights")
    return sentences


def _optimizer_params_outside(module: nn.Module, optimizers: Sequence[Optimizer]) -> bool:
    inside = {id(p) for p in module.parameters()}
    return any(id(p) not in inside for opt in optimizers for g in opt.param_groups for p in g["params"])
