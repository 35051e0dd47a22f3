"""What Lightning's precision plugin and strategy add to the desk: sentences for the report and named parts.

Everything is read from the objects Lightning built (the plugin, its scaler, the DDP wrapper), never from
the precision string the user typed: the dtypes come from the tensors, the buckets from DDP itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memtenants._private import ddp_bucket_sizes
from lightning_memtenants.analysis.formulas import fsdp_gathered_bytes, grad_scaler_bytes


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def param_dtypes(module: nn.Module) -> str:
    """The parameters' dtypes as read from the tensors, e.g. ``float32`` or ``bfloat16, float32``.

    Args:
        module: the model.

    Returns:
        The distinct dtypes, sorted and joined by commas; ``"none"`` for a module without parameters.
    """
    return ", ".join(sorted({_dtype_name(p.dtype) for p in module.parameters()})) or "none"


def precision_notes(plugin: Any, module: nn.Module, device_type: str) -> list[str]:
    """Sentences on what the precision plugin does to the fixed cost and the activations.

    Args:
        plugin: Lightning's precision plugin (``trainer.precision_plugin``).
        module: the model, whose parameters' dtypes are read.
        device_type: the device trained on (on CPU, 16-mixed runs as bf16-mixed).

    Returns:
        The sentences; none for 32-true without a GradScaler.
    """
    precision = str(getattr(plugin, "precision", ""))
    dtypes = param_dtypes(module)
    notes: list[str] = []
    if precision in ("16-mixed", "bf16-mixed"):
        half = "bfloat16" if precision == "bf16-mixed" else "float16"
        cache = _autocast_cache_enabled(plugin)
        how = (
            "with its cache off (Lightning passes cache_enabled=False), so every use of a weight makes a half copy"
            if cache is False
            else "with its cache on, so each weight is cast once per forward and kept until autocast exits"
        )
        notes.append(
            f"{precision}: weights, gradients and optimizer state stay {dtypes}; autocast computes in {half} {how};"
            " the copies that autograd keeps for backward are the autocast_cache part"
        )
        if precision == "bf16-mixed" and device_type == "cpu":
            notes.append(
                "on CPU, Lightning runs a requested 16-mixed as bf16-mixed (fp16 autocast needs a GradScaler it"
                " does not make on CPU), so there is no GradScaler"
            )
    elif precision in ("16-true", "bf16-true", "64-true"):
        notes.append(
            f"{precision}: parameters are {dtypes}, and so are their gradients and optimizer state (read from"
            " the tensors); the optimizers' step counters keep their own dtype"
        )
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        notes.append(
            "GradScaler: its scale and growth tracker (8 bytes), and one found-inf flag per optimizer from"
            " unscale_ to update(), are the grad_scaler part; unscale_ divides the gradients in place"
        )
    return notes


def sharding_notes(module: nn.Module, world_size: int) -> list[str]:
    """The FSDP sentence, where parameters are DTensors (FSDP2 through ModelParallelStrategy, or FSDP on GPU).

    Args:
        module: the model.
        world_size: the number of ranks the parameters are sharded over.

    Returns:
        One sentence, or none where no parameter is a DTensor.
    """
    if not any(is_dtensor(p) for p in module.parameters()):
        return []
    gathered = fsdp_gathered_bytes(module)
    return [
        "FSDP: weights, gradients and optimizer state are this rank's shards (DTensor local tensors, about"
        f" 1/{world_size} of each: 16P/N for fp32 Adam); the unsharded parameters are gathered one unit at a time"
        " inside forward and backward, so they show in the window peaks, not at the phase boundaries"
        + (
            f"; the largest unit is {gathered:,} bytes unsharded, held about twice while gathered (FSDP2's"
            " all-gather buffer and the parameters copied out of it)"
            if gathered
            else ""
        )
    ]


def _autocast_cache_enabled(plugin: Any) -> bool | None:
    """Whether the plugin's autocast caches its casts (MixedPrecision: no; FSDPPrecision: yes), if it says."""
    for name in ("autocast_context_manager", "forward_context"):
        make = getattr(plugin, name, None)
        if make is None:
            continue
        try:
            context = make()
        except Exception:  # building the context needs a device this process lacks: we cannot tell
            return None
        try:
            with warnings.catch_warnings(), context:  # autocast for a device this process lacks warns
                warnings.simplefilter("ignore")
                return torch.is_autocast_cache_enabled()
        except Exception:  # entering it needs what this process lacks: we cannot tell
            return None
    return None


def scaler_part(plugin: Any) -> Callable[[], int] | None:
    """A reader of the GradScaler's bytes (the ``grad_scaler`` part), or None where the plugin has none.

    Args:
        plugin: Lightning's precision plugin.

    Returns:
        A function that returns the scaler's bytes now, or None.
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is None:
        return None
    return lambda: grad_scaler_bytes(scaler)


def ddp_bucket_bytes(model: Any) -> int | None:
    """Bytes of DDP's gradient buckets, from DDP's own logging data; None if ``model`` is not DDP.

    Args:
        model: the strategy's model (``trainer.strategy.model``).

    Returns:
        The buckets' total bytes, or None.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    return sum(ddp_bucket_sizes(model))


def ddp_notes_and_part(model: Any, measure: Callable[[], bool]) -> tuple[list[str], Callable[[], int] | None]:
    """The buckets sentence and, where buckets are separate from the gradients, a reader of their bytes.

    With ``gradient_as_bucket_view=True`` each ``.grad`` is a view into its bucket, so the buckets are
    the gradients tenant and cost nothing more; otherwise they are a second copy of the gradients,
    reported as the ``ddp_buckets`` part. DDP rebuilds its buckets after the first step, so the size is
    re-read only where ``measure()`` says so.

    Args:
        model: the strategy's model (``trainer.strategy.model``).
        measure: whether the current step is measured (the reader re-reads the buckets' size then).

    Returns:
        The sentences (none where ``model`` is not DDP) and the ``ddp_buckets`` reader, or None where the
        buckets are no extra memory.
    """
    total = ddp_bucket_bytes(model)
    if total is None:
        return [], None
    if model.gradient_as_bucket_view:
        return [
            "DDP: gradients are views into its gradient buckets (gradient_as_bucket_view=True), so the buckets"
            " are the gradients tenant and cost nothing more"
        ], None
    cache = [total]

    def read() -> int:
        if measure():
            cache[0] = ddp_bucket_bytes(model) or 0
        return cache[0]

    return [
        "DDP: gradient buckets are a second copy of the gradients (gradient_as_bucket_view=False), reported as"
        " the ddp_buckets part; gradient_as_bucket_view=True would save them"
    ], read


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2, tensor parallel): its bytes on this rank are its local shard.

    Args:
        tensor: any object.

    Returns:
        True for a DTensor; False also where torch was built without distributed.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)
