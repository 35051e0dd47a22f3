"""What a GPU runs where the CPU runs something else: attention kernels, dropout masks and autocast's op lists.

A prediction for a GPU runs the step on fake CPU tensors, so torch's dispatcher picks the CPU's
kernels. Three choices differ on CUDA, and each changes what autograd keeps for backward:

- **Attention.** ``scaled_dot_product_attention`` on CUDA picks one of four kernels by PyTorch's own
  rules (:func:`sdpa_kernel`). The fused ones (flash, memory-efficient, cuDNN) keep the output and a
  float32 log-sum-exp per query, never an ``s*s`` matrix, and draw dropout from a philox seed and
  offset instead of a mask. The CPU runs the math path whenever dropout is on, which keeps the
  softmax and a float mask of ``s*s`` each.
- **Dropout.** CUDA's ``dropout`` is the fused ``native_dropout``, which keeps a 1-byte bool mask;
  the CPU keeps a mask of the input's dtype.
- **Autocast.** CUDA casts by its own op lists (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
  ``AT_FORALL_FP32_SET_OPT_DTYPE`` and ``AT_FORALL_PROMOTE`` in ATen's ``autocast_mode.h``):
  layer norm, softmax and the losses run in float32 there, not on the CPU.

:class:`CudaKernels` makes a fake step take CUDA's choices. It is a ``TorchFunctionMode``, entered
only for the dry run's own step; nothing else in the process sees it.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_memtenants.core.storage import tensors_in
from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.predict.kernels import CTC_FUNCTIONS, known_ctc_loss
from lightning_memtenants.predict.values import PredictionError

KERNELS = ("flash", "efficient", "cudnn", "math")
# torch._C._SDPBackend's values, as torch._C._get_sdp_priority_order() lists them
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
_HALF = (torch.float16, torch.bfloat16)


def _dims_ok(*tensors: Tensor) -> bool:
    return all(t.dim() == 4 for t in tensors)


def _sm(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= capability <= high


def _heads_ok(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, same_kv_heads: bool) -> bool:
    """``check_batch_size_and_num_heads_dense``: equal batches; equal heads, or grouped-query heads where allowed."""
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if enable_gqa:
        if same_kv_heads and k.size(-3) != v.size(-3):
            return False
        return q.size(-3) % k.size(-3) == 0 and q.size(-3) % v.size(-3) == 0
    return q.size(-3) == k.size(-3) == v.size(-3)


def _last_stride_ok(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, ignore_singleton: bool) -> bool:
    """``check_last_dim_stride_equals_1_dense``: on a GPU the mask's last dimension too."""
    ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_singleton:
        ok = ok or q.size(-1) == 1
    return ok and (mask is None or mask.stride(-1) == 1)


def _gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """``minimum_gemm_alignment``: the head dimension's multiple for the memory-efficient kernel."""
    half = dtype in _HALF
    tensor_cores = capability[0] >= 8 or (capability[0] >= 7 and half)
    alignment = 4 if capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _mask_shape_ok(q: Tensor, k: Tensor, mask: Tensor | None) -> bool:
    """``check_attn_mask_shape`` (cuDNN): a 2-d or 4-d mask that broadcasts to (batch, heads, L, S)."""
    if mask is None:
        return True
    if mask.requires_grad:
        return False

    def fits(size: int, target: int) -> bool:
        return size in (target, 1)

    if not (fits(mask.size(-2), q.size(2)) and fits(mask.size(-1), k.size(2))):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and fits(mask.size(0), q.size(0)) and fits(mask.size(1), q.size(1))


def prefers_cudnn(capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> bool:
    """Whether PyTorch tries cuDNN attention first on this GPU (``check_prefer_cudnn_attention``).

    It does on Hopper and datacenter Blackwell (sm_90, sm_100, sm_103) with cuDNN newer than 9.15,
    which the CUDA 13 builds of PyTorch ship, unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``.

    Args:
        capability: the GPU's compute capability.
        environ: the environment to read; ``None`` for ``os.environ``.

    Returns:
        True where cuDNN leads the kernel order.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in ("1", "true", "on", "yes"):
        return False
    return capability[0] in (9, 10) and capability[1] in (0, 3)


def priority_order(capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> list[str]:
    """The kernels in the order PyTorch tries them: the user's order if set, else the GPU's default.

    Args:
        capability: the GPU's compute capability.
        environ: the environment to read; ``None`` for ``os.environ``.

    Returns:
        Kernel names from :data:`KERNELS`, first tried first.
    """
    order = [_BACKEND_NAMES[b] for b in torch._C._get_sdp_priority_order() if b in _BACKEND_NAMES]
    if order == ["flash", "efficient", "math", "cudnn"] and prefers_cudnn(capability, environ):
        order = ["cudnn", "flash", "efficient", "math"]
    return order


def sdpa_kernel(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    capability: tuple[int, int],
    *,
    enable_gqa: bool = False,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` runs for these inputs on this GPU.

    The rules are PyTorch's ``select_sdp_backend`` and the ``can_use_*_attention`` filters in
    ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` and ``sdp_utils_cpp.h`` (read at
    PyTorch's main branch, December 2026), for dense tensors: the ``torch.backends.cuda.enable_*_sdp``
    switches, the priority order, then per kernel its architectures, dtypes, head dimensions, mask
    and layout. Nested tensors and ROCm are not modelled.

    Args:
        query: (batch, heads, L, head_dim).
        key: (batch, kv_heads, S, head_dim).
        value: (batch, kv_heads, S, value_dim).
        attn_mask: the mask as given, or None.
        dropout_p: the dropout probability.
        is_causal: the causal flag.
        capability: the GPU's compute capability.
        enable_gqa: grouped-query attention allowed.
        environ: the environment to read; ``None`` for ``os.environ``.

    Returns:
        One of :data:`KERNELS`.

    Raises:
        RuntimeError: where no kernel is allowed, as CUDA raises ("No available kernel").
    """
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    dense = _dims_ok(query, key, value)
    nonzero = dense and query.size(-2) > 0 and key.size(-2) > 0
    dq, dk, dv = query.size(-1), key.size(-1), value.size(-1)

    def flash() -> bool:
        if not (torch.backends.cuda.flash_sdp_enabled() and dense and attn_mask is None and nonzero):
            return False
        if not (dq == dk == dv and dq <= 256 and _sm(capability, (8, 0), (12, 1))):
            return False
        consumer = _sm(capability, (8, 6), (8, 9)) or _sm(capability, (12, 0), (12, 1))
        if grad and consumer and not (dq <= 192 or (dropout_p == 0 and dq > 224)):
            return False
        if is_causal and query.size(-2) != key.size(-2):
            return False
        return (
            query.dtype in _HALF
            and _heads_ok(query, key, value, enable_gqa, same_kv_heads=True)
            and _last_stride_ok(query, key, value, None, ignore_singleton=True)
        )

    def efficient() -> bool:
        if not (torch.backends.cuda.mem_efficient_sdp_enabled() and dense and _sm(capability, (5, 0), (12, 1))):
            return False
        align = _gemm_alignment(query.dtype, capability)
        if not (dq == dk and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
            return False
        if capability[0] >= 8:  # storage offsets aligned to the GEMM's bytes
            unit = align * query.element_size()
            if any(t.numel() and (t.storage_offset() * t.element_size()) % unit for t in (query, key, value)):
                return False
        if not (nonzero and _last_stride_ok(query, key, value, attn_mask, ignore_singleton=False)):
            return False
        if not _heads_ok(query, key, value, enable_gqa, same_kv_heads=True):
            return False
        return query.dtype in ((torch.float16, torch.float32, torch.bfloat16)[: 3 if capability[0] >= 8 else 2])

    def cudnn() -> bool:
        if not (torch.backends.cuda.cudnn_sdp_enabled() and dense and nonzero):
            return False
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            return False
        if query.dtype not in (_HALF if capability[0] >= 8 else (torch.float16,)):
            return False
        if not (_mask_shape_ok(query, key, attn_mask) and _sm(capability, (8, 0), (12, 1))):
            return False
        if dropout_p * 16.0 != math.floor(dropout_p * 16.0):
            return False
        if not _last_stride_ok(query, key, value, None, ignore_singleton=True):
            return False
        if not _heads_ok(query, key, value, enable_gqa, same_kv_heads=False):
            return False
        if query.size(0) > 65535 or query.size(1) > 65535:
            return False
        hopper = (capability[0] == 9 and capability[1] == 0) or capability[0] == 10
        limit = 192 if hopper and dq == 192 and dv == 128 else 128
        if not (dq <= limit and dv <= limit and dq % 8 == 0 and dv % 8 == 0):
            return False
        return key.size(2) != 1 and not (dropout_p != 0 and query.size(2) == 1)

    checks: dict[str, Callable[[], bool]] = {
        "flash": flash,
        "efficient": efficient,
        "cudnn": cudnn,
        "math": torch.backends.cuda.math_sdp_enabled,
    }
    for kernel in priority_order(capability, environ):
        if checks[kernel]():
            return kernel
    raise RuntimeError(
        "scaled_dot_product_attention has no available kernel on this GPU for these inputs: every kernel"
        " that torch.backends.cuda.enable_*_sdp allows refuses them, so CUDA would raise here"
    )


def _bool_to_float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``convert_boolean_attn_mask``: True takes part (0), False does not (-inf), in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero, minus = (torch.scalar_tensor(v, dtype=dtype, device=mask.device) for v in (0.0, -math.inf))
    return torch.where(mask, zero, minus)


def _efficient_mask(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """``preprocess_mask``: expanded to 4-d, its last dimension padded to 16, for the memory-efficient kernel."""
    mask = mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    last = mask.size(-1)
    if last % 16:
        return F.pad(mask, (0, 16 - last % 16))[..., :last]
    if mask.stride(0) % 16 or mask.stride(1) % 16 or mask.stride(2) % 16:
        return mask.contiguous()
    return mask


def _math_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """ATen's ``_scaled_dot_product_attention_math`` step by step, with CUDA's dropout (a bool mask)."""
    origin = query.dtype
    if origin in _HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        query, key, value = query.float(), key.float(), value.float()
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.size(-1)))
    if enable_gqa and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    q = query * factor
    if is_causal:
        mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        mask = _bool_to_float_mask(mask, q.dtype)
    attn = torch.matmul(q, key.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    weights = attn.to(origin)  # returned beside the output and dropped by the caller; made first, as in ATen
    out = torch.matmul(attn, value).to(origin)
    del weights
    return out


def cuda_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    capability: tuple[int, int],
    chosen: Callable[[str], None] | None = None,
) -> Tensor:
    """``scaled_dot_product_attention`` as CUDA runs it: the kernel of :func:`sdpa_kernel`, through torch's own op.

    The fused kernels are called as ``torch.ops.aten._scaled_dot_product_*_attention``, whose fake
    kernels give the outputs and saved tensors CUDA's kernels give.

    Args:
        query: as for ``F.scaled_dot_product_attention``.
        key: as for ``F.scaled_dot_product_attention``.
        value: as for ``F.scaled_dot_product_attention``.
        attn_mask: as for ``F.scaled_dot_product_attention``.
        dropout_p: as for ``F.scaled_dot_product_attention``.
        is_causal: as for ``F.scaled_dot_product_attention``.
        scale: as for ``F.scaled_dot_product_attention``.
        enable_gqa: as for ``F.scaled_dot_product_attention``.
        capability: the GPU's compute capability.
        chosen: told the kernel's name, for the report's notes.

    Returns:
        The attention's output.
    """
    kernel = sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, capability, enable_gqa=enable_gqa)
    if chosen is not None:
        chosen(kernel)
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if kernel == "flash":
        size = query.size(-1)
        if scale is None:
            scale = 1.0 / math.sqrt(size)
        pad = (8 - size % 8) % 8
        if pad:  # pad_last_dim<8>: the flash kernel wants head dimensions in multiples of 8
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        attention = torch.ops.aten._scaled_dot_product_flash_attention
        out = attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
        return out[..., :size] if pad else out
    mask = _bool_to_float_mask(attn_mask, query.dtype)
    if kernel == "efficient":
        if key.size(-3) != query.size(-3):  # grouped-query heads: torch's kernel (and its fake) wants them repeated
            key, value = (t.repeat_interleave(query.size(-3) // t.size(-3), -3) for t in (key, value))
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        attention = torch.ops.aten._scaled_dot_product_efficient_attention
        return attention(query, key, value, mask, grad, dropout_p, is_causal, scale=scale)[0]
    if kernel == "cudnn":
        attention = torch.ops.aten._scaled_dot_product_cudnn_attention
        return attention(query, key, value, mask, grad, dropout_p, is_causal, False, scale=scale)[0]
    return _math_attention(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


def cuda_dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """``dropout`` as CUDA runs it: ``native_dropout`` (a bool mask) where ATen's ``is_fused_kernel_acceptable``.

    In-place dropout and ``p`` of 0 or 1 take the same path as on the CPU.

    Args:
        input: the tensor.
        p: the probability of an element to be zeroed.
        training: apply dropout if True.
        inplace: as for ``F.dropout``.

    Returns:
        The result, as ``F.dropout`` returns it.
    """
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    return F.dropout(input, p, training, inplace)


# CUDA's autocast op lists (ATen's autocast_mode.h, torch 2.13), by the names torch functions carry.
LOWER = frozenset(
    (
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
    )
)
FP32 = frozenset(
    (
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "rms_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "upsample_nearest1d",
        "_upsample_nearest_exact1d",
        "upsample_nearest2d",
        "_upsample_nearest_exact2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
        "cross_entropy",
        "cross_entropy_loss",
    )
)
FP32_SET_DTYPE = frozenset(
    (
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "sum",
        "norm",
    )
)
PROMOTE = frozenset(
    (
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "vdot",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    )
)
_DUNDERS = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    return _DUNDERS.get(name, name)


def _floating(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _map(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return fn(value) if _floating(value) else value
    if isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) for v in value):
        return type(value)(_map(v, fn) for v in value)
    return value


class CudaKernels(TorchFunctionMode):
    """Makes a fake step take CUDA's attention kernel, dropout and autocast casts (see the module's docstring).

    Autocast is CUDA's while the step's autocast is on (``torch.is_autocast_enabled("cpu")``: the dry
    run's forward opens it, and a ``torch.autocast(..., enabled=False)`` in the model closes it); the CPU's
    own casts are switched off meanwhile, so that only CUDA's lists apply. The weights it casts are
    forgotten, as torch's ``autocast.__exit__`` clears its cache, when the outermost autocast exits: the
    forward's, and each checkpointed region's own in backward's recomputation. torch's Python functions
    (``F.multi_head_attention_forward``, ``F.interpolate``) run with this mode on, so that the calls
    inside them are seen too.

    Args:
        capability: the GPU's compute capability.
        tracker: the dry run's tracker; the fused kernels' philox seed and offset are marked host memory in it.

    Attributes:
        kernels: how many attention calls ran each kernel, for the notes.
        recurrent: how many LSTM, GRU and RNN calls ran, which CUDA runs in cuDNN (see :func:`recurrent_note`).
    """

    def __init__(self, capability: tuple[int, int], tracker: LiveTensorTracker | None = None) -> None:
        super().__init__()
        self.capability = capability
        self.tracker = tracker
        self.kernels: dict[str, int] = {}
        self.recurrent = 0
        self._cache: dict[int, tuple[Tensor, Tensor]] = {}
        self._bodies: dict[Any, Any] = {}
        self._depth = 0
        self._outer_nesting = 0
        self._thread = 0
        self._decrement: Callable[[], int] = torch.autocast_decrement_nesting

    def clear_cache(self) -> None:
        """Forget the weights cast so far, as leaving ``torch.autocast`` does."""
        self._cache.clear()

    def __enter__(self) -> CudaKernels:
        if self._depth == 0:  # no mode sees autocast's exit, so the one call its __exit__ makes is wrapped
            self._outer_nesting = torch.autocast_increment_nesting() - 1
            torch.autocast_decrement_nesting()
            self._thread = threading.get_ident()
            self._decrement = torch.autocast_decrement_nesting
            torch.autocast_decrement_nesting = self._decrement_nesting
        self._depth += 1
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            self._depth -= 1
            if self._depth == 0:
                torch.autocast_decrement_nesting = self._decrement
                self.clear_cache()

    def _decrement_nesting(self) -> int:
        """``autocast.__exit__``'s call, which clears the cast cache when no autocast is left open."""
        nesting = self._decrement()
        if nesting <= self._outer_nesting and threading.get_ident() == self._thread:
            self.clear_cache()
        return nesting

    def _chosen(self, kernel: str) -> None:
        self.kernels[kernel] = self.kernels.get(kernel, 0) + 1

    def _cast(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """``cached_cast``: a float32 leaf weight cast to the lower dtype is cast once per autocast region."""
        if tensor.dtype == dtype:
            return tensor
        cacheable = (
            dtype != torch.float32
            and tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not tensor._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return tensor.to(dtype)
        hit = self._cache.get(id(tensor))
        if hit is not None and hit[0] is tensor:
            return hit[1]
        cast = tensor.to(dtype)
        self._cache[id(tensor)] = (tensor, cast)
        return cast

    def _autocast(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        lower = torch.get_autocast_dtype("cpu")
        if name in LOWER:
            to = lower
        elif name in FP32:
            to = torch.float32
        elif name in FP32_SET_DTYPE:
            first = next((a for a in args if isinstance(a, Tensor)), None)
            if first is not None and _floating(first) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        elif name in PROMOTE:
            found = [t.dtype for t in tensors_in((args, kwargs)) if _floating(t)]
            to = torch.float32 if torch.float32 in found else lower
        else:
            return args, kwargs
        return tuple(_map(a, lambda t: self._cast(t, to)) for a in args), {
            k: _map(v, lambda t: self._cast(t, to)) for k, v in kwargs.items()
        }

    def __torch_function__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = _name(func)
        autocast = torch.is_autocast_enabled("cpu")
        if autocast and name == "binary_cross_entropy":
            raise PredictionError(
                "torch.nn.functional.binary_cross_entropy is unsafe to autocast, and CUDA's autocast refuses it:"
                " use binary_cross_entropy_with_logits (torch.nn.BCEWithLogitsLoss)"
            )
        if autocast:
            args, kwargs = self._autocast(name, tuple(args), kwargs)
        if name in _RECURRENT:
            self.recurrent += 1
        body = None if func in _OURS else self._body(func)
        with _no_cpu_autocast(autocast):
            if body is not None:
                with self:  # the calls inside torch's own Python function come back here
                    return body(*args, **kwargs)
            if func in CTC_FUNCTIONS:
                return known_ctc_loss(func, args, kwargs, cuda=True)
            if func is F.scaled_dot_product_attention:
                return cuda_sdpa(*args, **kwargs, capability=self.capability, chosen=self._chosen)
            if func in (F.dropout, torch.dropout) and len(args) >= 1:
                return cuda_dropout(*args, **kwargs)
            return func(*args, **kwargs)

    def _body(self, func: Any) -> Any:
        """A copy of torch's Python function that does not hand itself back to the modes, or None for any other."""
        if not isinstance(func, types.FunctionType):
            return None
        if func.__module__ != "torch.nn.functional" and func not in _BACKWARD:
            return None
        if func in (F.layer_norm, F.group_norm, F.softmax, F.log_softmax, F.rms_norm, F.cross_entropy):
            return None
        body = self._bodies.get(func)
        if body is None:
            scope = dict(func.__globals__)
            for check in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
                scope[check] = _never
            closure = func.__closure__
            if closure is not None and func.__code__.co_freevars[-2:] == ("if_false", "if_true"):
                # torch._jit_internal.boolean_dispatch (F.max_pool2d and its kin): its two branches are functional's
                # own functions, which would hand themselves back to the modes, and come back here, for ever
                branches = [self._body(cell.cell_contents) or cell.cell_contents for cell in closure[-2:]]
                closure = (*closure[:-2], *(types.CellType(branch) for branch in branches))
            body = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, closure)
            body.__kwdefaults__ = func.__kwdefaults__
            self._bodies[func] = body
        return body


_OURS = (F.scaled_dot_product_attention, F.dropout, torch.dropout, *CTC_FUNCTIONS)
# backward, which torch hands to the modes and then runs without them: a checkpointed region recomputes inside it
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def _never(*args: Any) -> bool:
    return False


def _no_cpu_autocast(on: bool) -> Any:
    """While CUDA's casts apply, the CPU's own autocast must not cast again."""
    if not on:
        return contextlib.nullcontext()
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def fused_attention_rewrite(tracker: LiveTensorTracker) -> Callable[[Any, Any, Any, Any], Any]:
    """The tracker's ``rewrite`` for a CUDA target: the fused kernels' scratch memory and host tensors.

    - The fused attention kernels return a philox seed and offset; an eager CUDA run keeps them on the
      host (torch's "Note [Seed and Offset]"), so they are never counted.
    - Flash attention's backward (FlashAttention-2's ``mha_bwd``) allocates, for the length of the
      kernel, a float32 ``dq_accum`` of (batch, round128(L), heads, round32(head_dim)) and a float32
      ``softmax_d`` of (batch, heads, round128(L)), and with grouped-query heads an expanded dK and dV.

    Args:
        tracker: the dry run's tracker.

    Returns:
        A ``rewrite(func, args, kwargs, out)`` hook.
    """

    def rewrite(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        name = func._overloadpacket.__name__
        if name in _SEEDS and isinstance(out, tuple):
            for index in _SEEDS[name]:
                if isinstance(out[index], Tensor):
                    tracker.host(out[index])
        elif name == "_scaled_dot_product_flash_attention_backward" and isinstance(out, tuple):
            for tensor in out:
                if isinstance(tensor, Tensor):
                    tracker.add(tensor)
            query, key = args[1], args[2]
            b, h, length, dim = query.shape
            rounded = -(-length // 128) * 128
            scratch = [
                torch.empty(b, rounded, h, -(-dim // 32) * 32, dtype=torch.float32),
                torch.empty(b, h, rounded, dtype=torch.float32),
            ]
            if key.size(1) != h:
                scratch += [torch.empty(b, key.size(2), h, dim, dtype=query.dtype) for _ in range(2)]
            for tensor in scratch:
                tracker.add(tensor)
            del scratch
        elif name == "_ctc_loss_backward" and isinstance(out, Tensor):
            tracker.add(out)
            scratch = ctc_backward_scratch(args[1], args[6])
            for tensor in scratch:
                tracker.add(tensor)
            del scratch
        return out

    return rewrite


def ctc_backward_scratch(log_probs: Tensor, log_alpha: Tensor) -> list[Tensor]:
    """What CUDA's CTC backward (``ctc_loss_backward_gpu_template``, ``LossCTC.cu``) allocates besides the gradient.

    The two lengths and the targets' offsets copied to the device (int64, one per sample) and ``log_beta``,
    the size of ``log_alpha``. A large problem (``2 T + 24 N / 10 + 2 C / 10 > 450``) also reduces the blanks'
    ``log_alpha + log_beta`` (batch, time, longest target + 1) with ``logsumexp``, which keeps its maximum, the
    shifted copy and its result alive together. All of it is freed when the kernel returns.

    Args:
        log_probs: the log-probabilities (time, batch, classes).
        log_alpha: the forward's ``log_alpha`` (batch, time, 2 x longest target + 1).

    Returns:
        The scratch tensors, as fakes of the right sizes.
    """
    steps, batch, classes = log_probs.shape
    scratch = [log_probs.new_empty(batch, dtype=torch.long) for _ in range(3)]
    scratch.append(torch.empty_like(log_alpha))
    if 2 * steps + (24 * batch) // 10 + (2 * classes) // 10 > 450:
        blanks = log_alpha.size(2) // 2 + 1
        scratch += [log_alpha.new_empty(batch, steps, blanks) for _ in range(2)]  # the sum and its shifted copy
        scratch += [log_alpha.new_empty(batch, steps, 1) for _ in range(2)]  # the maximum and the result
    return scratch


# outputs of the fused attention kernels that are the philox seed and offset
_SEEDS = {
    "_scaled_dot_product_flash_attention": (6, 7),
    "_scaled_dot_product_efficient_attention": (2, 3),
    "_scaled_dot_product_cudnn_attention": (6, 7),
}


_RECURRENT = frozenset(("lstm", "gru", "rnn_tanh", "rnn_relu"))


def recurrent_note(count: int, gpu: Any) -> str:
    """The report's sentence on recurrent layers, which a GPU target does not model.

    CUDA runs ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` in cuDNN (``_cudnn_rnn``), which keeps the layer's input,
    its output and a reserve space whose size only ``cudnnGetRNNTrainingReserveSize`` knows; torch has no fake
    kernel for its backward. The dry run keeps the CPU's tensors instead (oneDNN's, or the native path's).

    Args:
        count: the recurrent calls in the step.
        gpu: the target (its ``name``).

    Returns:
        One sentence.
    """
    return (
        f"{count} LSTM/GRU/RNN call(s) predicted with the CPU's kernel's saved tensors: on {gpu.name} cuDNN runs"
        " them (_cudnn_rnn) and keeps a reserve space this prediction does not model"
    )


def attention_note(kernels: Mapping[str, int], gpu: Any) -> str:
    """The report's sentence on which attention kernels the prediction ran, and what each keeps.

    Args:
        kernels: calls per kernel name.
        gpu: the target (its ``name``).

    Returns:
        One sentence.
    """
    ran = ", ".join(f"{name} x{count}" for name, count in sorted(kernels.items()))
    kept = []
    if set(kernels) - {"math"}:
        kept.append("the fused kernels keep the output and a float32 log-sum-exp per query, never an s*s matrix")
    if "math" in kernels:
        kept.append("the math path keeps the s*s softmax and a 1-byte dropout mask")
    return (
        f"attention as CUDA runs it on {gpu.name} (PyTorch's kernel choice): {ran}; {'; '.join(kept)};"
        " autocast follows CUDA's op lists"
    )
