"""The transformer check: measured activations per layer against Korthikanti et al. (2022).

Their count for one layer, with 16-bit activations and dropout, is ``s*b*h*(34 + 5*a*s/h)``
bytes (sequence s, batch b, hidden h, heads a). Real models differ for known reasons: fused
attention keeps no ``a*s*s`` score matrix, fp32 doubles every 2-byte term, and without
dropout there are no masks. The check measures each layer under fake tensors and sorts
every saved tensor into one of the formula's terms, so each difference has its bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memtenants._private import TorchDispatchMode
from lightning_memtenants.core.census import is_param_cast
from lightning_memtenants.core.storage import batch_tensors, storage_key
from lightning_memtenants.predict.cluster import blocks_of
from lightning_memtenants.predict.fake import (
    PRECISIONS,
    check_precision,
    fake_batch,
    fake_module,
    fake_session,
    forward_context,
)
from lightning_memtenants.units import MiB

_FUSED_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
)
_HIDDEN_NAMES = ("n_embd", "hidden_size", "d_model", "embed_dim")
_HEAD_NAMES = ("n_head", "num_heads", "num_attention_heads", "nhead")


def korthikanti_bytes(seq_len: int, batch_size: int, hidden: int, heads: int) -> int:
    """Activation bytes of one transformer layer: ``s*b*h*34 + 5*a*s*s*b`` (16-bit, with dropout).

    The count of Korthikanti et al. (2022), the figure people plan with; :func:`activation_check`
    sets a model's measured layers beside it.

    Args:
        seq_len: the sequence length ``s``.
        batch_size: the batch size ``b``.
        hidden: the hidden size ``h``.
        heads: the number of attention heads ``a``.

    Returns:
        The formula's bytes for one layer.
    """
    return 34 * seq_len * batch_size * hidden + 5 * heads * seq_len * seq_len * batch_size


@dataclass(frozen=True)
class Term:
    """One term of the formula beside the bytes a layer saved for it, and why they differ.

    Args:
        name: the term ("hidden activations", "dropout masks", "attention scores"...).
        formula_bytes: what the formula counts for it, per layer.
        measured_bytes: what the mean layer saved for it.
        detail: the reason for the difference, in words.
    """

    name: str
    formula_bytes: int
    measured_bytes: int
    detail: str


@dataclass(frozen=True)
class _Saved:
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    made_by: str  # "dropout", "weight cast" or ""


@dataclass
class ActivationCheck:
    """Per-layer activations beside the formula, term by term.

    Each saved tensor of a layer is sorted into the formula's terms by its shape and by the
    operator that made it (dropout masks), so the terms' measured bytes add up to the layer's,
    and every difference from the formula has its bytes and its reason.

    Args:
        per_layer_bytes: bytes each layer saved for backward, in order.
        formula_bytes: :func:`korthikanti_bytes` for the measured shape.
        seq_len: ``s``, read from the batch.
        batch_size: ``b``, read from the batch.
        hidden: ``h``.
        heads: ``a``.
        terms: the formula's terms beside the mean layer's bytes for each.
    """

    per_layer_bytes: list[int]
    formula_bytes: int
    seq_len: int
    batch_size: int
    hidden: int
    heads: int
    terms: list[Term] = field(default_factory=list)

    @property
    def mean_layer_bytes(self) -> float:
        """The mean of ``per_layer_bytes``."""
        return sum(self.per_layer_bytes) / max(len(self.per_layer_bytes), 1)

    @property
    def ratio(self) -> float:
        """Measured over the formula, for the mean layer."""
        return self.mean_layer_bytes / self.formula_bytes

    @property
    def explained_bytes(self) -> int:
        """The mean layer's bytes that fall into a term of the formula (everything but ``other``)."""
        return sum(t.measured_bytes for t in self.terms if t.name != "other")

    def summary(self) -> str:
        """The check as a table: the totals and ratio, then a line per term with its reason."""
        lines = [
            f"activations per layer: measured {self.mean_layer_bytes / MiB:.2f} MiB, Korthikanti et al."
            f" s*b*h*(34 + 5*a*s/h) = {self.formula_bytes / MiB:.2f} MiB"
            f" (s={self.seq_len}, b={self.batch_size}, h={self.hidden}, a={self.heads}); ratio {self.ratio:.2f}",
            f"{'term':<24}{'formula MiB':>12}{'measured MiB':>14}  why",
        ]
        for t in self.terms:
            lines.append(f"{t.name:<24}{t.formula_bytes / MiB:>12.3f}{t.measured_bytes / MiB:>14.3f}  {t.detail}")
        return "\n".join(lines)


class _OpNames(TorchDispatchMode):
    """Records operator names and the masks dropout draws (kept, fake and so free, so their ids stay unique)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.masks: dict[int, Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        self.names.add(name)
        out = func(*args, **(kwargs or {}))
        mask = args[0] if name == "bernoulli_" else out[1] if name == "native_dropout" else None
        if mask is not None:
            self.masks[storage_key(mask)] = mask
        return out


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

    A layer's real activations differ from the published formula for known reasons (fused
    attention, fp32, no dropout); measuring each saved tensor tells which, at no memory cost.

    Args:
        model: the model, or a zero-argument callable building it (built under fake tensors).
        batch: as for :func:`~lightning_memtenants.predict.dryrun.predict`: tensors, shapes or a callable.
        precision: a Lightning precision name (see :data:`~lightning_memtenants.predict.fake.PRECISIONS`).
        loss_fn: ``loss_fn(model, batch)`` to run instead of ``training_step`` or the forward.
        layers: the layers to measure; by default the model's blocks, its repeated layers (``cluster.named_blocks``).
        hidden: the hidden size; by default read from the usual attribute names (``n_embd``, ``hidden_size``...).
        heads: the number of heads; by default read from ``n_head``, ``num_heads``...

    ``s`` and ``b`` are the shape of the batch's first tensor.

    Returns:
        The per-layer bytes beside the formula, term by term.

    Raises:
        ValueError: if ``precision`` is not known, the model has no list of layers, or ``hidden``
            and ``heads`` can be neither read nor were given.
    """
    param_dtype, autocast_dtype = PRECISIONS[check_precision(precision)]
    with fake_session() as mode:
        fake = fake_module(model, mode, param_dtype)
        fake.train()
        blocks = layers if layers is not None else blocks_of(fake)
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
        faked = fake_batch(batch, fake, param_dtype)
        first = batch_tensors(faked)[0]
        batch_size, seq_len = int(first.shape[0]), int(first.shape[1]) if first.dim() > 1 else 1
        forward = forward_context(param_dtype, autocast_dtype)
        saved, ops = _measure(fake, faked, blocks, forward, loss_fn)
    formula = korthikanti_bytes(seq_len, batch_size, hidden, heads)
    per_layer = [sum(t.nbytes for t in layer) for layer in saved]
    check = ActivationCheck(per_layer, formula, seq_len, batch_size, hidden, heads)
    check.terms = _terms(saved, check, ops.names)
    return check


def _measure(
    module: nn.Module,
    batch: Any,
    blocks: list[nn.Module],
    forward: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], Tensor] | None,
) -> tuple[list[list[_Saved]], _OpNames]:
    """The new storages saved for backward while each block runs; parameters and the batch excluded."""
    excluded = {storage_key(t) for t in (*module.parameters(), *module.buffers(), *batch_tensors(batch))}
    params = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    current: list[int] = []
    saved: list[list[_Saved]] = [[] for _ in blocks]
    ops = _OpNames()

    def pack(tensor: Tensor) -> Tensor:
        key = storage_key(tensor)
        if current and key not in excluded and key not in seen:
            seen.add(key)
            if is_param_cast(tensor, params):
                made_by = "weight cast"
            else:
                made_by = "dropout" if key in ops.masks or tensor.dtype == torch.bool else ""
            nbytes = int(tensor.untyped_storage().nbytes())
            saved[current[-1]].append(_Saved(nbytes, tensor.dtype, tuple(tensor.shape), made_by))
        return tensor

    def enter(index: int) -> Callable[..., None]:
        return lambda *_: current.append(index)

    def leave(*_: Any) -> None:
        current.pop()

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.register_forward_hook(leave))
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
    return saved, ops


_TERMS = (
    "hidden activations",
    "dropout masks",
    "attention scores",
    "attention mask",
    "per-token values",
    "weight casts",
    "other",
)


def _term_of(saved: _Saved, s: int, b: int, h: int, a: int) -> str:
    """Which of the formula's terms a saved tensor belongs to, by its shape and its maker."""
    elements = saved.nbytes // saved.dtype.itemsize
    scores = saved.shape[-2:] == (s, s) and elements % (a * s * s * b) == 0
    if saved.made_by == "weight cast":
        return "weight casts"
    if saved.made_by == "dropout" and (scores or elements % (s * b * h) == 0):
        return "attention mask" if scores else "dropout masks"
    if scores:
        return "attention scores"
    if elements % (s * b * h) == 0:
        return "hidden activations"
    if elements % (s * b) == 0:
        return "per-token values"
    return "other"


def _dtypes(items: list[_Saved], unit: int) -> str:
    """``12 float32, 4 bfloat16``: how many ``unit``-sized tensors' worth of each dtype."""
    by_dtype: dict[torch.dtype, int] = {}
    for item in items:
        by_dtype[item.dtype] = by_dtype.get(item.dtype, 0) + item.nbytes // item.dtype.itemsize
    return ", ".join(f"{_count(n / unit)} {str(d).removeprefix('torch.')}" for d, n in by_dtype.items())


def _count(value: float) -> str:
    return f"{round(value):,}" if value == round(value) else f"{value:.3g}"


def _terms(saved: list[list[_Saved]], check: ActivationCheck, ops: set[str]) -> list[Term]:
    """The formula split into its terms, each beside what the mean layer saved for it."""
    s, b, h, a = check.seq_len, check.batch_size, check.hidden, check.heads
    sbh, assb = s * b * h, a * s * s * b
    groups: dict[str, list[_Saved]] = {name: [] for name in _TERMS}
    for layer in saved:
        for item in layer:
            groups[_term_of(item, s, b, h, a)].append(item)
    layers = max(len(saved), 1)
    measured = {name: round(sum(t.nbytes for t in items) / layers) for name, items in groups.items()}
    fused = sorted(name for name in ops if name.startswith(_FUSED_ATTENTION))
    attention = f"fused attention ({', '.join(fused)})" if fused else "this attention"

    hidden = groups["hidden activations"]
    detail = f"{_dtypes(hidden, sbh * layers) or 'no'} values of s*b*h; the formula counts 16 at 2 bytes"
    if len({t.dtype for t in hidden}) > 1:
        detail += "; autocast runs each operator in its own dtype, so both are kept"
    masks = groups["dropout masks"]
    mask_detail = (
        f"{_dtypes(masks, sbh * layers)} masks of s*b*h; the formula counts 2 at 1 byte"
        if masks
        else "no dropout in this layer: the formula's 2 one-byte masks are not kept"
    )
    scores = groups["attention scores"]
    score_detail = (
        f"{_dtypes(scores, assb * layers)} tensors of a*s*s*b; the formula counts 2 (scores, softmax) at 2 bytes"
        if scores
        else f"{attention} keeps no a*s*s score matrix or softmax"
    )
    attn_mask = groups["attention mask"]
    attn_detail = (
        f"{_dtypes(attn_mask, assb * layers)} masks of a*s*s*b; the formula counts 1 at 1 byte"
        if attn_mask
        else f"{attention} keeps no attention-dropout mask"
    )
    tokens = groups["per-token values"]
    token_detail = f"{_dtypes(tokens, s * b * layers)} values per token (norm statistics, attention log-sum-exp)"
    token_detail += "; not in the formula"
    terms = [
        Term("hidden activations", 32 * sbh, measured["hidden activations"], detail),
        Term("dropout masks", 2 * sbh, measured["dropout masks"], mask_detail),
        Term("attention scores", 4 * assb, measured["attention scores"], score_detail),
        Term("attention mask", assb, measured["attention mask"], attn_detail),
        Term("per-token values", 0, measured["per-token values"], token_detail if tokens else "none saved"),
    ]
    if groups["weight casts"]:
        casts = groups["weight casts"]
        detail = f"autocast's {_dtypes(casts, layers)} values of weights cast for matmuls; not in the formula"
        terms.append(Term("weight casts", 0, measured["weight casts"], detail))
    if groups["other"]:
        shapes = sorted({(t.shape, str(t.dtype).removeprefix("torch.")) for t in groups["other"]})
        listed = "; ".join(f"{dtype} {list(shape)}" for shape, dtype in shapes[:4])
        terms.append(Term("other", 0, measured["other"], f"not of a formula term's shape: {listed}"))
    return terms


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
