"""Fixed-cost formulas: what weights, gradients and optimizer state should cost.

The formula is computed from the optimizer classes and hyperparameters, the parameters'
real dtypes and which parameters are trainable, and then checked against the census, so
that every byte of difference gets a sentence that explains it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memtenants._private import default_foreach, local_tensor, scaler_tensors
from lightning_memtenants.checks import world_size as check_world_size
from lightning_memtenants.core.storage import HostState, local_optimizer


@dataclass(frozen=True)
class StateSpec:
    """Per-parameter optimizer state: full-size tensors and fp32 scalar counters."""

    full_size: tuple[str, ...]
    scalars: tuple[str, ...] = ()
    lazy: bool = True
    factored: bool = False

    def param_bytes(self, param: Tensor, state: dict | None = None, host: Collection[str] = ()) -> int:
        """State bytes of one parameter: full-size tensors, or Adafactor's row and column factors.

        Scalar counters take the dtype of the tensors already in ``state`` (an optimizer stepped
        inside a float64 default-dtype context makes float64 ``step`` counters), else the default's.
        The entries named in ``host`` live in host memory (a GPU run's ``step`` counters) and cost nothing.

        Args:
            param: the parameter (a DTensor counts its local shard).
            state: the optimizer's state for this parameter, if it has any yet.
            host: names of the state entries kept in host memory.

        Returns:
            The parameter's optimizer state in bytes.
        """
        scalars = sum(_scalar_size((state or {}).get(name)) for name in self.scalars if name not in host)
        param = local_tensor(param)
        if self.factored and param.dim() > 1:
            rows, cols = param.shape[-2], param.shape[-1]
            outer = param.numel() // (rows * cols)
            return outer * (rows + cols) * param.element_size() + scalars
        return len([name for name in self.full_size if name not in host]) * _nbytes(param) + scalars


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


@dataclass(frozen=True)
class OptimizerKind:
    """What the package knows of one optimizer class: its state layout and its step's temporaries.

    ``temporaries`` is what one step allocates and frees again, measured on CPU with torch 2.13
    (``tests/test_optimizers.py``): a multiple of the largest parameter for the single-tensor loop,
    and of all parameters for ``foreach``; ``fused`` kernels allocate nothing the size of a parameter.
    ``adam_like`` marks the optimizers whose two moments SGD without momentum would save.
    """

    spec: Callable[[dict], StateSpec]
    temporaries: tuple[int, int]
    adam_like: bool = False


OPTIMIZERS: dict[type[Optimizer], OptimizerKind] = {
    torch.optim.Adam: OptimizerKind(_adam, (2, 1), adam_like=True),
    torch.optim.AdamW: OptimizerKind(_adam, (2, 1), adam_like=True),
    torch.optim.SGD: OptimizerKind(_sgd, (0, 0)),
    torch.optim.RMSprop: OptimizerKind(_rmsprop, (1, 1)),
    torch.optim.Adagrad: OptimizerKind(lambda group: StateSpec(("sum",), ("step",), lazy=False), (1, 2)),
    torch.optim.Adadelta: OptimizerKind(lambda group: StateSpec(("square_avg", "acc_delta"), ("step",)), (2, 2)),
    torch.optim.Adamax: OptimizerKind(lambda group: StateSpec(("exp_avg", "exp_inf"), ("step",)), (1, 1), True),
    torch.optim.NAdam: OptimizerKind(
        lambda group: StateSpec(("exp_avg", "exp_avg_sq"), ("step", "mu_product")), (2, 1), adam_like=True
    ),
    torch.optim.RAdam: OptimizerKind(lambda group: StateSpec(("exp_avg", "exp_avg_sq"), ("step",)), (2, 1), True),
}
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    # Adafactor keeps a row and a column factor (shape[-1] = 1, shape[-2] = 1) for every parameter of two or
    # more dimensions and a full-size ``variance`` for the others: its state is not proportional to P.
    OPTIMIZERS[torch.optim.Adafactor] = OptimizerKind(
        lambda group: StateSpec(("variance",), ("step",), factored=True), (1, 1)
    )


def optimizer_kind(optimizer: Optimizer) -> OptimizerKind | None:
    """What is known of this optimizer's class (a ZeroRedundancyOptimizer's local one), or None.

    Args:
        optimizer: any optimizer.

    Returns:
        The class's :class:`OptimizerKind`, or None for a class we do not know.
    """
    return OPTIMIZERS.get(type(local_optimizer(optimizer)))


def state_spec(optimizer: Optimizer, group: dict) -> StateSpec | None:
    """The state layout of a known optimizer class, or None for one we do not know.

    Args:
        optimizer: the optimizer (not a wrapper: its own class is looked up).
        group: one of its parameter groups, whose hyperparameters decide the layout.

    Returns:
        The group's :class:`StateSpec`, or None.
    """
    kind = OPTIMIZERS.get(type(optimizer))
    return None if kind is None else kind.spec(group)


def scalar_bytes() -> int:
    """Size of an optimizer's scalar counters: fp32 unless the default dtype is fp64."""
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def _scalar_size(value: object) -> int:
    return value.element_size() if isinstance(value, Tensor) else scalar_bytes()


def _nbytes(tensor: Tensor) -> int:
    """numel x element size of this rank's part: a DTensor's (FSDP2's) local shard."""
    tensor = local_tensor(tensor)
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


def expected_fixed_cost(
    module: nn.Module, optimizers: Sequence[Optimizer] = (), host_state: HostState | None = None
) -> FixedCost:
    """The formula: numel x element size of every weight, gradient and optimizer state tensor.

    For fp32 Adam this is 16 bytes per trainable parameter plus 4 bytes of ``step`` per
    parameter tensor. ``host_state`` names the state entries each optimizer keeps on the host
    (as the census is told): they are left out, as they are of the measured tenant.

    Args:
        module: the model whose parameters and buffers are counted.
        optimizers: the optimizers whose state is counted.
        host_state: for each optimizer, the names of the state entries it keeps on the host.

    Returns:
        The expected :class:`FixedCost`, with the optimizers we do not know and the notes on tied and frozen weights.
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
    for given in optimizers:
        host = host_state(given) if host_state is not None else ()
        optimizer = local_optimizer(given)
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
                    state += spec.param_bytes(p, optimizer.state.get(p), host)
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
    """One plain sentence for each way the census differs from the formula (and its notes).

    Args:
        expected: the formula's figures, from :func:`expected_fixed_cost`.
        measured: the census's bytes by tenant (``weights``, ``gradients`` and ``optimizer_state``).
        module: the model, to find the parameters that have no gradient.
        optimizers: the optimizers, to find parameters that are not in the module.

    Returns:
        The sentences, the formula's notes first; empty where census and formula agree.
    """
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


def optimizer_implementation(optimizer: Optimizer) -> str:
    """Which implementation ``step()`` runs: ``single-tensor``, ``foreach`` or ``fused``.

    An explicit ``fused``/``foreach`` flag in the parameter group wins; when both are ``None`` the
    choice is torch's own default (``_default_to_fused_or_foreach``: foreach on CUDA, single-tensor on CPU).

    Args:
        optimizer: any optimizer; a ZeroRedundancyOptimizer's local one is read.

    Returns:
        ``"single-tensor"``, ``"foreach"`` or ``"fused"``.
    """
    optimizer = local_optimizer(optimizer)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if group.get("fused"):
        return "fused"
    if group.get("foreach"):
        return "foreach"
    if "foreach" not in group or group.get("foreach") is False or group.get("differentiable"):
        return "single-tensor"
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return "foreach" if default_foreach(params) else "single-tensor"


def step_temporaries_bytes(optimizer: Optimizer) -> int:
    """The optimizer step's temporaries for the implementation that runs; 0 for an optimizer we do not know.

    Args:
        optimizer: any optimizer.

    Returns:
        The bytes one step allocates and frees again (0 for ``fused`` or with no trainable parameters).
    """
    kind = optimizer_kind(optimizer)
    implementation = optimizer_implementation(optimizer)
    if kind is None or implementation == "fused":
        return 0
    sizes = [_nbytes(p) for g in local_optimizer(optimizer).param_groups for p in g["params"] if p.requires_grad]
    if not sizes:
        return 0
    single, foreach = kind.temporaries
    return foreach * sum(sizes) if implementation == "foreach" else single * max(sizes)


def grad_scaler_bytes(scaler: object) -> int:
    """Bytes a ``GradScaler`` holds: its ``scale`` and growth tracker, and ``found_inf`` per optimizer and device.

    The per-optimizer ``found_inf`` flags exist from ``unscale_`` until ``update()``; an fp16 scaler thus
    holds 4 + 4 bytes between steps and 4 more per optimizer while it steps.

    Args:
        scaler: a ``torch.amp.GradScaler``.

    Returns:
        The bytes of the state tensors it holds now.
    """
    return sum(_nbytes(t) for t in scaler_tensors(scaler))


def sharded_state_bytes(total_bytes: int, world_size: int) -> int:
    """The even share of ``total_bytes`` on one of ``world_size`` ranks (ZeRO, FSDP): ceil(total / N).

    Args:
        total_bytes: the unsharded size in bytes.
        world_size: the number of ranks.

    Returns:
        One rank's share in bytes, rounded up.

    Raises:
        ValueError: if ``world_size`` is not an int of at least 1.
    """
    check_world_size(world_size)
    return -(-total_bytes // world_size)


def zero_partition(param_groups: Sequence[Sequence[Tensor]], world_size: int) -> list[list[Tensor]]:
    """The parameters each rank owns under ZeroRedundancyOptimizer, by torch's own greedy rule.

    Within each group, largest first, every tensor goes to the rank with the fewest numbers so far
    (the first such rank on ties); sizes carry over from group to group. Tensors are not split,
    so a rank's share is near P/N only when no tensor dominates.

    Args:
        param_groups: the parameters of each parameter group.
        world_size: the number of ranks.

    Returns:
        The parameters each rank owns, one list per rank.

    Raises:
        ValueError: if ``world_size`` is not an int of at least 1.
    """
    check_world_size(world_size)
    sizes = [0] * world_size
    ranks: list[list[Tensor]] = [[] for _ in range(world_size)]
    for group in param_groups:
        for param in sorted(group, key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            ranks[rank].append(param)
            sizes[rank] += param.numel()
    return ranks


def zero_state_bytes(param_groups: Sequence[Sequence[Tensor]], world_size: int, spec: StateSpec) -> list[int]:
    """Optimizer state per rank under ZeroRedundancyOptimizer: ``spec`` applied to each rank's partition.

    For Adam, about 8P/N + 4 bytes per owned tensor on every rank; together exactly one full state.

    Args:
        param_groups: the parameters of each parameter group (frozen ones are left out).
        world_size: the number of ranks.
        spec: the optimizer's state layout.

    Returns:
        The optimizer state in bytes of each rank.

    Raises:
        ValueError: if ``world_size`` is not an int of at least 1.
    """
    trainable = [[p for p in group if p.requires_grad] for group in param_groups]
    return [sum(spec.param_bytes(p) for p in owned) for owned in zero_partition(trainable, world_size)]


def fsdp_fixed_cost_bytes(
    params: int,
    world_size: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    state_bytes_per_param: int = 8,
    gathered_params: int = 0,
    gathered_bytes: int | None = None,
) -> int:
    """FSDP's fixed cost per rank: sharded weights, gradients and optimizer state, plus the gathered unit.

    With fp32 Adam that is 16P/N, plus the unsharded parameters of the FSDP unit gathered for
    forward and backward (``gathered_params`` numbers of ``param_bytes`` each, or ``gathered_bytes``).

    Args:
        params: the number of parameters, P.
        world_size: the number of ranks, N.
        param_bytes: bytes per weight.
        grad_bytes: bytes per gradient.
        state_bytes_per_param: bytes of optimizer state per parameter.
        gathered_params: parameters of the gathered FSDP unit.
        gathered_bytes: the gathered unit's bytes, in place of ``gathered_params``.

    Returns:
        The fixed cost of one rank in bytes.

    Raises:
        ValueError: if ``world_size`` is not an int of at least 1.
    """
    per_param = param_bytes + grad_bytes + state_bytes_per_param
    gathered = gathered_params * param_bytes if gathered_bytes is None else gathered_bytes
    return sharded_state_bytes(per_param * params, world_size) + gathered


def fsdp_gathered_bytes(module: nn.Module) -> int:
    """Unsharded bytes of the largest FSDP2 unit (a ``fully_shard`` module): what one all-gather brings in.

    A unit owns the parameters under it that no nested unit owns; a DTensor's ``numel`` is its global size.

    Args:
        module: the model, with ``fully_shard`` applied to some of its modules.

    Returns:
        The largest unit's unsharded bytes; 0 where there is no FSDP2 unit.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return 0
    largest = 0
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
        own = sum(p.numel() * p.element_size() for p in unit.parameters() if id(p) not in nested)
        largest = max(largest, own)
    return largest


def deepspeed_zero_bytes(stage: int, params: int, world_size: int, *, largest_layer_params: int = 0) -> int:
    """Model states per GPU under DeepSpeed ZeRO with fp16 mixed-precision Adam (the ZeRO paper, K = 12).

    fp16 weights (2P) and gradients (2P), and fp32 master weights with Adam's two moments (12P):
    stage 0 keeps all 16P; stage 1 shards the 12P; stage 2 also the gradients; stage 3 everything,
    plus the largest layer gathered in fp16 (2 bytes per parameter).

    Args:
        stage: the ZeRO stage, 0 to 3.
        params: the number of parameters, P.
        world_size: the number of ranks, N.
        largest_layer_params: parameters of the largest layer (stage 3 only).

    Returns:
        The model states of one GPU in bytes.

    Raises:
        ValueError: if ``stage`` is not 0, 1, 2 or 3, or ``world_size`` is not an int of at least 1.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    check_world_size(world_size)
    if stage == 0:
        return 16 * params
    if stage == 1:
        return 4 * params + sharded_state_bytes(12 * params, world_size)
    if stage == 2:
        return 2 * params + sharded_state_bytes(14 * params, world_size)
    return sharded_state_bytes(16 * params, world_size) + 2 * largest_layer_params


def deepspeed_estimator_bytes(stage: int, params: int, world_size: int, *, largest_layer_params: int = 0) -> int:
    """DeepSpeed's own ``estimate_zero{2,3}_model_states_mem_needs`` per-GPU figure, without offload.

    Stage 2: 4P + 16P/N; stage 3: 4 x largest layer + 18P/N. Its constants are rounder than the
    paper's (it counts fp32 gradients and a full-precision gathered layer), so it sits above ours.

    Args:
        stage: the ZeRO stage, 2 or 3.
        params: the number of parameters, P.
        world_size: the number of ranks, N.
        largest_layer_params: parameters of the largest layer (stage 3 only).

    Returns:
        DeepSpeed's estimate of one GPU's model states in bytes.

    Raises:
        ValueError: if ``world_size`` is not an int of at least 1, or ``stage`` is not 2 or 3.
    """
    check_world_size(world_size)
    if stage == 2:
        return 4 * params + int(16 * params / world_size)
    if stage == 3:
        return 4 * largest_layer_params + int(18 * params / world_size)
    raise ValueError(f"stage must be 2 or 3 (DeepSpeed has estimators for these only), got {stage!r}")
