"""The transformer check: measured activations per layer against Korthikanti et al. (2022).

Their count for one layer, with 16-bit activations and dropout, is ``s*b*h*(34 + 5*a*s/h)``
bytes (sequence s, batch b, hidden h, heads a). Real models differ for known reasons: fused
attention keeps no ``a*s*s`` score matrix, fp32 doubles every 2-byte term, and without
dropout there are no masks. The check measures each layer under fake tensors and says
which of these reasons apply, with their bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memtenants.census import batch_tensors, storage_key
from lightning_memtenants.report import MiB

_FUSED_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
)
_HIDDEN_NAMES = ("n_embd", "hidden_size", "d_model", "embed_dim")
_HEAD_NAMES = ("n_head", "num_heads", "num_attention_heads", "nhead")


def korthikanti_bytes(seq_len: int, batch_size: int, hidden: int, heads: int) -> int:
    """Activation bytes of one transformer layer: ``s*b*h*34 + 5*a*s*s*b`` (16-bit, with dropout)."""
    return 34 * seq_len * batch_size * hidden + 5 * heads * seq_len * seq_len * batch_size


@dataclass
class ActivationCheck:
    """Per-layer activations beside the formula, and the reasons they differ."""

    per_layer_bytes: list[int]
    formula_bytes: int
    seq_len: int
    batch_size: int
    hidden: int
    heads: int
    reasons: list[str] = field(default_factory=list)
    explained_bytes: int = 0

    @property
    def mean_layer_bytes(self) -> float:
        return sum(self.per_layer_bytes) / max(len(self.per_layer_bytes), 1)

    @property
    def ratio(self) -> float:
        """Measured over the formula, for the mean layer."""
        return self.mean_layer_bytes / self.formula_bytes

    def summary(self) -> str:
        lines = [
            f"activations per layer: measured {self.mean_layer_bytes / MiB:.2f} MiB, Korthikanti et al."
            f" s*b*h*(34 + 5*a*s/h) = {self.formula_bytes / MiB:.2f} MiB"
            f" (s={self.seq_len}, b={self.batch_size}, h={self.hidden}, a={self.heads}); ratio {self.ratio:.2f}",
        ]
        lines.extend(f"- {reason}" for reason in self.reasons)
        return "\n".join(lines)


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def activation_check(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    *,
    precision: str = "32-true",
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    layers: list[nn.Module] | None = None,
    hidden: int | None = None,
    heads: int | None = None,
) -> ActivationCheck:
    """Measure the activations each transformer layer saves for backward, under fake tensors.

    ``layers`` defaults to the longest ``nn.ModuleList`` in the model (its blocks), ``hidden``
    and ``heads`` to the usual attribute names (``n_embd``/``hidden_size``, ``n_head``/``num_heads``),
    and ``s``, ``b`` to the shape of the batch's first tensor.
    """
    from lightning_memtenants.dryrun import PRECISIONS, _fake_batch, _fake_mode, _fake_module, _forward_context

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    param_dtype, autocast_dtype = PRECISIONS[precision]
    mode = _fake_mode()
    with mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        fake = _fake_module(model, mode, param_dtype)
        fake.train()
        blocks = layers if layers is not None else _longest_module_list(fake)
        if layers is not None and isinstance(model, nn.Module):
            index = {id(m): i for i, m in enumerate(model.modules())}
            fake_modules = list(fake.modules())
            blocks = [fake_modules[index[id(layer)]] for layer in layers]
        if not blocks:
            raise ValueError("layers: the model has no nn.ModuleList of layers; pass layers=[...]")
        hidden = hidden or _find_attribute(fake, _HIDDEN_NAMES)
        heads = heads or _find_attribute(fake, _HEAD_NAMES)
        if hidden is None or heads is None:
            raise ValueError("hidden and heads could not be read from the model; pass hidden=... and heads=...")
        fake_batch = _fake_batch(batch, fake, param_dtype)
        first = batch_tensors(fake_batch)[0]
        batch_size, seq_len = int(first.shape[0]), int(first.shape[1]) if first.dim() > 1 else 1
        forward = _forward_context(param_dtype, autocast_dtype)
        per_layer, dtypes, shapes, ops = _measure(fake, fake_batch, blocks, forward, loss_fn)
    formula = korthikanti_bytes(seq_len, batch_size, hidden, heads)
    check = ActivationCheck(per_layer, formula, seq_len, batch_size, hidden, heads)
    check.reasons, check.explained_bytes = _reasons(check, dtypes, shapes, ops, blocks[0], fake)
    return check


def _measure(
    module: nn.Module,
    batch: Any,
    blocks: list[nn.Module],
    forward: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], Tensor] | None,
) -> tuple[list[int], dict[torch.dtype, int], list[tuple[int, ...]], set[str]]:
    """Bytes of new storages saved for backward while each block runs; parameters and the batch excluded."""
    excluded = {storage_key(t) for t in (*module.parameters(), *module.buffers(), *batch_tensors(batch))}
    seen: set[int] = set()
    current: list[int] = []
    per_layer = [0] * len(blocks)
    dtypes: dict[torch.dtype, int] = {}
    shapes: list[tuple[int, ...]] = []

    def pack(tensor: Tensor) -> Tensor:
        key = storage_key(tensor)
        if current and key not in excluded and key not in seen:
            seen.add(key)
            nbytes = int(tensor.untyped_storage().nbytes())
            per_layer[current[-1]] += nbytes
            dtypes[tensor.dtype] = dtypes.get(tensor.dtype, 0) + nbytes
            shapes.append(tuple(tensor.shape))
        return tensor

    def enter(index: int) -> Callable[..., None]:
        return lambda *_: current.append(index)

    def leave(*_: Any) -> None:
        current.pop()

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.register_forward_hook(leave))
    ops = _OpNames()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops, forward():
            if loss_fn is not None:
                loss_fn(module, batch)
            elif callable(getattr(module, "training_step", None)):
                module.training_step(batch, 0)  # type: ignore[operator]
            else:
                module(*batch) if isinstance(batch, (tuple, list)) else module(batch)
    finally:
        for handle in handles:
            handle.remove()
    return per_layer, dtypes, shapes, ops.names


def _reasons(
    check: ActivationCheck,
    dtypes: dict[torch.dtype, int],
    shapes: list[tuple[int, ...]],
    ops: set[str],
    block: nn.Module,
    module: nn.Module,
) -> tuple[list[str], int]:
    """The reasons measured and formula differ, and the formula adjusted by each of them."""
    s, b, h, a = check.seq_len, check.batch_size, check.hidden, check.heads
    sbh = s * b * h
    reasons = []
    total = sum(dtypes.values()) or 1
    itemsize = max(dtypes, key=lambda d: dtypes[d]).itemsize if dtypes else 2
    explained = 32 * sbh * itemsize // 2
    if itemsize != 2:
        share = sum(n for d, n in dtypes.items() if d.itemsize == itemsize) / total
        reasons.append(
            f"{share:.0%} of the saved bytes are {itemsize}-byte floats where the formula assumes 2 bytes:"
            f" its 32*s*b*h bytes of tensors ({32 * sbh / MiB:.2f} MiB) become {explained / MiB:.2f} MiB"
        )
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())
    if dropout:
        explained += 2 * sbh
    else:
        reasons.append(
            f"no dropout: the formula's 2*s*b*h bytes of dropout masks ({2 * sbh / MiB:.2f} MiB) are not kept"
        )
    fused = sorted(name for name in ops if name.startswith(_FUSED_ATTENTION))
    if any(len(shape) == 4 and shape[-2:] == (s, s) for shape in shapes):
        explained += 4 * a * s * s * b * itemsize // 2 + (a * s * s * b if dropout else 0)
    else:
        how = f"fused attention ({', '.join(fused)})" if fused else "the attention implementation"
        reasons.append(
            f"{how} stores no a*s*s score matrix, softmax or attention-dropout mask:"
            f" the formula's 5*a*s*s*b term ({5 * a * s * s * b / MiB:.2f} MiB per layer) is absent"
        )
    if fused:
        explained += 4 * a * s * b
        reasons.append(f"fused attention keeps a 4-byte log-sum-exp per head and token: {4 * a * s * b:,} bytes")
    norms = sum(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in block.modules())
    if norms:
        stats = norms * 2 * min(itemsize, 4) * s * b
        explained += stats
        reasons.append(f"{norms} norm layer(s) keep a mean and an inverse deviation per token: {stats:,} bytes")
    reasons.append(
        f"with these adjustments the formula gives {explained:,} bytes per layer;"
        f" measured {round(check.mean_layer_bytes):,} ({check.mean_layer_bytes / explained:.3f}x)"
    )
    return reasons, explained


def _longest_module_list(module: nn.Module) -> list[nn.Module]:
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _find_attribute(module: nn.Module, names: tuple[str, ...]) -> int | None:
    hparams = getattr(module, "hparams", None)
    for source in (hparams, getattr(module, "config", None), *module.modules()):
        if source is None:
            continue
        for name in names:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None
