"""Where torch's fake kernels return other dtypes than the CPU's own: a dry run puts the CPU's dtypes back.

A fake tensor's shape and dtype come from torch's meta kernels, which follow the CUDA kernels in a few
places where the CPU's differ. The saved tensors of a normalization layer under autocast are the ones
that matter: the CPU keeps the batch statistics of a bfloat16 input in float32 when the layer's
weights are float32 ("mixed type", ``is_mixed_type`` and ``param_scalar_type`` in ATen's
``layer_norm.cpp``, ``group_norm.cpp`` and ``Normalization.cpp``), where the meta kernels keep them
in the input's dtype; and the meta kernel of the group norm's backward returns the input's gradient
in float32 where the CPU returns the input's dtype. Each was measured against a real CPU step.

The CPU's LSTM runs oneDNN's (``mkldnn_rnn_layer``, one call per layer and direction, where ATen's
``use_mkldnn`` in ``RNN.cpp`` allows: oneDNN on, CPU tensors, float32 or bfloat16) and keeps for backward a
``uint8`` workspace whose size torch's meta kernel leaves at 0. :func:`onednn_lstm_workspace` is oneDNN's
own sum (``set_workspace_sizes`` and ``set_offsets`` in ``src/cpu/rnn/rnn_utils``), measured exact against
real CPU steps. The meta kernel of its backward returns one tensor as the gradient of both biases, where
the CPU returns two.

CTC loss has no fake kernel at all: its ``log_alpha`` is (batch, time, 2 x longest target + 1), and the longest
target is a value. A dry run keeps the batch's integer tensors real (:mod:`.values`), so
:func:`known_ctc_loss` reads the lengths, hands them to torch as the lists its fast path makes of them
(``ctc_loss`` in ATen's ``LossCTC.cpp``), and makes the loss and ``log_alpha`` the kernel allocates
(:class:`CtcOutputs`). :class:`CpuKernels` does so in a prediction for the CPU; ``CudaKernels`` in one
for a GPU, with the CUDA kernel's own scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_memtenants._private import FakeTensor, FakeTensorMode, TorchDispatchMode, unset_fake
from lightning_memtenants.predict.values import PredictionError, is_known

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


_PAGE = 4096


def _good_ld(dim: int, size: int) -> int:
    """oneDNN's ``get_good_ld``: a leading dimension 64-byte aligned and not a multiple of 256 (4K aliasing)."""
    per_line = 64 // size
    ld = -(-dim // per_line) * per_line
    return ld + per_line if ld % 256 == 0 else ld


def onednn_lstm_workspace(steps: int, batch: int, input_size: int, hidden: int, size: int, c_size: int) -> int:
    """The bytes of the workspace oneDNN's LSTM keeps for backward, for one layer and one direction in training.

    oneDNN lays out, each part starting on a 4096-byte page: the gates (steps x batch x 4 hidden), the hidden
    states, the layer and cell states of (layers + 1) x (steps + 1) rows, and the float32 gradients of the
    states; the workspace ends on a page.

    Args:
        steps: the sequence's length.
        batch: the batch size.
        input_size: the layer's input features.
        hidden: the hidden size.
        size: the bytes of an element of the input (4 for float32, 2 for bfloat16).
        c_size: the bytes of an element of the cell state.

    Returns:
        The workspace's bytes, as ``mkldnn_rnn_layer`` returns it.
    """
    rows = 2 * (steps + 1) * batch  # (layers + 1) * directions * (steps + 1) * batch, one layer and direction a call
    accumulate = _good_ld(max(input_size, hidden), 4) * 4  # the gradients accumulate in float32
    parts = (
        steps * batch * _good_ld(4 * hidden, size) * size,  # ws_gates
        steps * batch * _good_ld(hidden, size) * size,  # ws_ht
        rows * _good_ld(max(input_size, hidden), size) * size,  # ws_states_layer (the iteration's share it)
        rows * hidden * c_size,  # ws_states_iter_c
        rows * accumulate,  # ws_diff_states_layer
        rows * accumulate,  # ws_diff_states_iter
        rows * hidden * 4,  # ws_diff_states_iter_c
    )
    offset = 0
    for part in parts:
        offset = -(-offset // _PAGE) * _PAGE + part
    return -(-offset // _PAGE) * _PAGE  # ws_grid_comp, empty for an LSTM, starts on a page


def _lstm_workspace(args: Any, out: Any) -> Any:
    """``mkldnn_rnn_layer``'s outputs with the workspace oneDNN allocates in training."""
    source, cx = args[0], args[6]
    train = args[15] if len(args) > 15 else True
    if not (train and isinstance(out, tuple) and len(out) == 4 and out[3].numel() == 0):
        return out
    # ATen's mkldnn_rnn hands every layer its input sequence first, whatever ``batch_first`` says
    steps, batch, hidden = source.size(0), source.size(1), int(args[10])
    c_size = cx.element_size() if isinstance(cx, Tensor) else source.element_size()
    size = onednn_lstm_workspace(steps, batch, source.size(-1), hidden, source.element_size(), c_size)
    return (*out[:3], torch.empty(size, dtype=torch.uint8, device=out[3].device))


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
    if name == "mkldnn_rnn_layer":
        return _lstm_workspace(args, out)
    if name == "mkldnn_rnn_layer_backward" and isinstance(out, tuple) and out[3] is out[4]:
        # the meta kernel hands one tensor back as both biases' gradient, which autograd then clones for
        # each; the CPU's kernel returns two tensors, which autograd keeps as they are
        return (*out[:4], torch.empty_like(out[4]), *out[5:])
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


def grouped_mm_output(
    mat_a: Tensor, mat_b: Tensor, offs: Tensor | None, out_dtype: torch.dtype | None
) -> tuple[list[int], list[int], torch.dtype]:
    """The output ``aten._grouped_mm`` allocates, as its CPU and CUDA kernels do, under the active fake mode.

    torch's meta kernel (``_meta_grouped_mm_common``) checks what the CUDA fast path needs, bfloat16 inputs,
    where the CPU kernel and CUDA's fallback multiply float32 and float16 too (transformers' mixtures of
    experts call it with float32 weights under ``32-true`` and ``bf16-mixed``); and it pads the rows to 16
    bytes only on a CUDA build, where both real kernels always do (``create_grouped_gemm_output_tensor``).
    This is the output of both: the shape of ``_create_grouped_mm_output_tensor``, the dtype ``out_dtype`` or
    ``mat_a``'s, each row padded to a multiple of 16 bytes.

    Args:
        mat_a: the left operand, 2-D or 3-D.
        mat_b: the right operand, 2-D or 3-D.
        offs: the groups' end offsets (int32), for a 2-D operand.
        out_dtype: the requested output dtype, or ``None``.

    Returns:
        The output's shape, strides and dtype.

    Raises:
        RuntimeError: as the real kernels, for operands whose dimensions do not fit.
    """
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check(
        mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
        lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and mat_b.dim()={mat_b.dim()}",
    )
    if not (a_2d and b_2d):
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    groups = offs.size(0) if offs is not None else 0
    if a_2d and b_2d:
        size = [groups, mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    align = max(1, 16 // dtype.itemsize)
    padded = -(-size[-1] // align) * align
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return size, stride, dtype


_GROUPED_MM = torch.ops.aten._grouped_mm.default


class KernelFakeMode(FakeTensorMode):
    """The dry runs' ``FakeTensorMode``: torch's, except where its meta kernel refuses what the real kernels run.

    ``aten._grouped_mm`` (forward and backward) gets :func:`grouped_mm_output`; every other operator is torch's
    own. One ``is`` test per operator, inside the mode that already handles it (no second dispatch mode).
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> KernelFakeMode:
        """The mode itself: a deep copy of a fake tensor (``copy.deepcopy`` of a model, of a known tensor's twin)
        stays in the dry run's mode.

        torch's own copies the mode, and with it its converter's ``StorageWeakRef`` keys without taking their weak
        references: each copy frees them again, a storage is freed while still referenced and the process crashes
        (once an AOT trace has lifted a constant, as the Philox state's ``torch.tensor(())``).
        """
        return self

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _GROUPED_MM:
            kwargs = kwargs or {}
            a, b, *rest = args
            offs = rest[0] if rest else kwargs.get("offs")
            out_dtype = rest[2] if len(rest) > 2 else kwargs.get("out_dtype")
            size, stride, dtype = grouped_mm_output(a, b, offs, out_dtype)
            made = {"dtype": dtype, "device": a.device}
            return super().dispatch(torch.ops.aten.empty_strided.default, types, (size, stride), made)
        return super().dispatch(func, types, args, kwargs)


# F.ctc_loss (nn.CTCLoss calls it) and torch.ctc_loss (which F.ctc_loss calls)
CTC_FUNCTIONS = (F.ctc_loss, torch.ctc_loss)
_CTC_LENGTHS = ((2, "input_lengths"), (3, "target_lengths"))


def _lengths(value: Any, name: str) -> Any:
    """The CTC lengths as Python ints, where the dry run knows them."""
    if not isinstance(value, Tensor):
        return value  # already a sequence of ints, as torch accepts
    if isinstance(value, FakeTensor) or not is_known(value):
        raise PredictionError(
            f"ctc_loss's {name} must be known to a dry run, as its log_alpha is sized by them: pass real integer"
            " tensors in the batch (or Python ints), not shapes, nor lengths computed from a float input or the"
            " model's outputs (Hugging Face's *ForCTC models compute them from the batch's attention_mask: give one)"
        )
    with unset_fake():
        listed = value.tolist()
    return [int(v) for v in listed] if isinstance(listed, list) else [int(listed)]


class CtcOutputs(TorchDispatchMode):
    """Makes CTC loss's outputs as its kernel allocates them, which no fake kernel can; entered for one call.

    - ``aten._ctc_loss`` (the CPU's and CUDA's own kernel): the loss (batch) and ``log_alpha`` (batch, time,
      2 x longest target + 1), in the log-probabilities' dtype (``ctc_loss_allocate_outputs`` in
      ``LossCTC.cpp``, ``ctc_loss_gpu_template`` in ``LossCTC.cu``). CUDA's kernel first copies the two
      lengths and the targets' offsets to the device (three int64 tensors of the batch's size), freed when it
      returns.
    - ``aten._cudnn_ctc_loss`` (cuDNN's, ``cudnn/LossCTC.cpp``): the gradient, computed in the forward and
      kept for backward (the log-probabilities' size, float32), and the loss. cuDNN's workspace
      (``cudnnGetCTCLossWorkspaceSize_v8``) is not modelled.

    Args:
        longest: the longest target.
        cuda: whether the target is a GPU.
    """

    def __init__(self, longest: int, cuda: bool = False) -> None:
        super().__init__()
        self.longest = longest
        self.cuda = cuda

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _NATIVE_CTC:
            log_probs = args[0]
            steps, batch = log_probs.size(0), log_probs.size(1)
            scratch = [log_probs.new_empty(batch, dtype=torch.long) for _ in range(3)] if self.cuda else []
            log_alpha = log_probs.new_empty(batch, steps, 2 * self.longest + 1)
            loss = log_probs.new_empty(batch)
            del scratch
            return loss, log_alpha
        if func is torch.ops.aten._cudnn_ctc_loss.Tensor:
            log_probs = args[0]
            grad = torch.empty_like(log_probs, memory_format=torch.contiguous_format)
            return log_probs.new_empty(log_probs.size(1)), grad
        return func(*args, **(kwargs or {}))


_NATIVE_CTC = (torch.ops.aten._ctc_loss.Tensor, torch.ops.aten._ctc_loss.default)


def _cudnn_ctc(log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, blank: int) -> bool:
    """``_use_cudnn_ctc_loss_tensor``: cuDNN's CTC on a GPU, for int32 targets and lengths (``cudnn/LossCTC.cpp``)."""
    if not (torch.backends.cudnn.enabled and blank == 0 and isinstance(targets, Tensor)):
        return False
    if not all(isinstance(t, Tensor) and t.dtype == torch.int32 for t in (input_lengths, target_lengths)):
        return False
    if not (targets.dim() == 1 and targets.dtype == torch.int32 and targets.is_contiguous()):
        return False
    if not (isinstance(log_probs, Tensor) and log_probs.dtype == torch.float32 and log_probs.dim() == 3):
        return False
    inputs, targets_ = _lengths(input_lengths, "input_lengths"), _lengths(target_lengths, "target_lengths")
    return all(t < 256 and t <= i for i, t in zip(inputs, targets_, strict=False))


def known_ctc_loss(func: Any, args: Sequence[Any], kwargs: dict[str, Any], cuda: bool = False) -> Tensor:
    """``func`` (one of :data:`CTC_FUNCTIONS`) with the outputs its kernel allocates, the lengths read.

    torch's own ``ctc_loss`` runs around the kernel (its reduction divides by the target lengths clamped to 1,
    which the division keeps). On a GPU target where cuDNN's conditions hold (int32 targets and lengths, blank
    0, float32, targets shorter than 256 and than their inputs, ``torch.backends.cudnn.enabled``), cuDNN's
    kernel and ``ctc_loss_impl``'s reduction around it run instead, as CUDA's ``ctc_loss`` does.

    Args:
        func: ``F.ctc_loss`` or ``torch.ctc_loss``.
        args: its positional arguments.
        kwargs: its keyword arguments.
        cuda: whether the target is a GPU (CUDA's kernels and their scratch).

    Returns:
        The loss, as ``func`` returns it.

    Raises:
        PredictionError: where a length is not known to the dry run (a shape, or computed from the model).
        ValueError: for a ``reduction`` that ``F.ctc_loss`` does not know.
    """
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction", "zero_infinity")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    log_probs, targets, blank = given.get("log_probs"), given.get("targets"), given.get("blank", 0)
    input_lengths, target_lengths = given.get("input_lengths"), given.get("target_lengths")
    _lengths(input_lengths, "input_lengths")
    longest = max(_lengths(target_lengths, "target_lengths"), default=0)
    with CtcOutputs(longest, cuda):
        if not (cuda and _cudnn_ctc(log_probs, targets, input_lengths, target_lengths, blank)):
            return func(*args, **kwargs)
        reduction = given.get("reduction", "mean")
        if isinstance(reduction, str):
            if reduction not in _REDUCTIONS:
                raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
            reduction = _REDUCTIONS[reduction]
        zero_infinity = given.get("zero_infinity", False)
        loss = torch.ops.aten._cudnn_ctc_loss.Tensor(
            log_probs, targets, input_lengths, target_lengths, blank, True, zero_infinity
        )[0]
        if reduction == 1:
            return (loss / target_lengths.clamp_min(1)).mean()
        return loss.sum() if reduction == 2 else loss


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


class CpuKernels(TorchFunctionMode):
    """A prediction for the CPU: CTC loss with the lengths the dry run knows (:func:`known_ctc_loss`).

    Entered only for the dry run's own step; nothing else in the process sees it.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in CTC_FUNCTIONS:
            return known_ctc_loss(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))
