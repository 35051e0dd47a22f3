"""Where torch's fake kernels return other dtypes than the CPU's own: a dry run puts the CPU's dtypes back.

A fake tensor's shape and dtype come from torch's meta kernels, which follow the CUDA kernels in a few
places where the CPU's differ. The saved tensors of a normalization layer under autocast are the ones
that matter: the CPU keeps the batch statistics of a bfloat16 input in float32 when the layer's
weights are float32 ("mixed type", ``is_mixed_type`` and ``param_scalar_type`` in ATen's
``layer_norm.cpp``, ``group_norm.cpp`` and ``Normalization.cpp``), where the meta kernels keep them
in the input's dtype; and the meta kernel of the group norm's backward returns the input's gradient
in float32 where the CPU returns the input's dtype. Each was measured against a real CPU step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_REDUCED = (torch.bfloat16, torch.float16)
# operator name -> (indices of the arguments that are the layer's float tensors, indices of the statistics returned)
_STATISTICS = {
    "native_batch_norm": ((1, 2, 3, 4), (1, 2)),
    "_native_batch_norm_legit": ((1, 2, 3, 4), (1, 2)),
    "_native_batch_norm_legit_no_training": ((1, 2, 3, 4), (1, 2)),
    "_batch_norm_with_update": ((1, 2, 3, 4), (1, 2)),
    "native_layer_norm": ((2, 3), (1, 2)),
    "native_group_norm": ((1, 2), (1, 2)),
}


def _mixed(args: Any, params: tuple[int, ...]) -> bool:
    """A reduced-precision input with a float32 weight, bias or running statistic: ATen's "mixed type"."""
    first = args[0] if args else None
    if not isinstance(first, Tensor) or first.dtype not in _REDUCED:
        return False
    return any(isinstance(args[i], Tensor) and args[i].dtype == torch.float32 for i in params if i < len(args))


def cpu_kernels(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``func``'s outputs with the CPU's dtypes (see the module's docstring).

    A dry run's tracker calls it on every operator's outputs (its ``rewrite``), before it counts them and
    autograd saves them.

    Args:
        func: the operator that ran.
        args: its positional arguments.
        kwargs: its keyword arguments.
        out: what it returned.

    Returns:
        ``out``, or a copy with the statistics' dtype the CPU gives.
    """
    name = func._overloadpacket.__name__
    rule = _STATISTICS.get(name)
    if rule is not None and isinstance(out, tuple) and _mixed(args, rule[0]):
        fixed = list(out)
        for index in rule[1]:
            if isinstance(fixed[index], Tensor) and fixed[index].dtype != torch.float32:
                fixed[index] = torch.empty_like(fixed[index], dtype=torch.float32)
        return tuple(fixed)
    if name == "native_group_norm_backward" and isinstance(out, tuple) and isinstance(out[0], Tensor):
        source = args[1]
        if isinstance(source, Tensor) and out[0].dtype != source.dtype:
            return (torch.empty_like(out[0], dtype=source.dtype), *out[1:])
    return out
