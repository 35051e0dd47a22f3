"""What a CUDA device adds to a step that a fake run on the CPU does not see, modelled from its mechanisms.

A prediction for a GPU (``target="cuda"``, an A100, or ``target="A6000"``, ``"sm_90"``...) runs the
step on fake tensors (they need no GPU) and adds what CUDA itself does, each as a named part of the
report:

- the caching allocator rounds every block up to 512 bytes (``allocator_rounding``);
- cuBLAS keeps a workspace per handle, in allocated memory, from the first matrix multiply on
  a thread; autograd runs backward on its own device thread, so training holds two
  (``cublas_workspace``). The size depends on the architecture and ``CUBLAS_WORKSPACE_CONFIG``;
- on CUDA an optimizer left to choose runs ``foreach`` (one temporary per parameter list),
  and its ``step`` counters live on the host unless ``capturable`` or ``fused``: the census and
  the fixed-cost formula are told so (:func:`host_state_names`) and leave them out.

What is outside ``memory_allocated`` is listed in the notes, never added: the CUDA context, the
libraries' own code and handles. Which kernels a GPU runs where the CPU runs others (attention,
dropout, autocast's op lists) is :mod:`lightning_memtenants.predict.cuda_kernels`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_memtenants._private import TorchDispatchMode
from lightning_memtenants.checks import brief
from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.predict.allocator import CachingAllocatorModel, round_block  # noqa: F401 (re-exported)

# Compute capability of the GPUs people rent, by the names they rent them under.
GPUS: dict[str, tuple[int, int]] = {
    "V100": (7, 0),
    "T4": (7, 5),
    "RTX2080TI": (7, 5),
    "A100": (8, 0),
    "A30": (8, 0),
    "A10": (8, 6),
    "A10G": (8, 6),
    "A40": (8, 6),
    "A6000": (8, 6),
    "RTX3090": (8, 6),
    "L4": (8, 9),
    "L40S": (8, 9),
    "RTX4090": (8, 9),
    "RTX6000ADA": (8, 9),
    "H100": (9, 0),
    "H200": (9, 0),
    "GH200": (9, 0),
    "B200": (10, 0),
    "RTX5090": (12, 0),
}
# ``torch.tensor(data)`` makes a CPU tensor unless told otherwise: on a GPU run that is host memory
HOST_OPS = frozenset({"lift_fresh.default", "lift_fresh_copy.default"})
# ops that reach cuBLAS (after autograd has decomposed linear and matmul)
_BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"})
OUTSIDE_ALLOCATOR = (
    "outside the allocator, so in neither these figures nor torch.cuda.memory_allocated: the CUDA context (by the"
    " GPU's SMs and the CUDA version, with lazy module loading) and NCCL's buffers (by strategy and world size);"
    " the footprint adds them to the reserved peak for the figure nvidia-smi shows"
)


@dataclass(frozen=True)
class CudaTarget:
    """The GPU a prediction is for, because what CUDA adds to a step depends on the architecture.

    Build it with :func:`resolve_gpu` (or :func:`resolve_target`), which checks the name.

    Args:
        name: the GPU's name as :data:`GPUS` spells it ("A6000"), or ``sm_XY`` for a bare capability.
        capability: the compute capability, ``(major, minor)``.
    """

    name: str
    capability: tuple[int, int]

    def workspace_bytes(self, environ: Mapping[str, str] | None = None) -> int:
        """The cuBLAS workspace per handle on this architecture; see :func:`cublas_workspace_bytes`.

        Args:
            environ: the environment to read ``CUBLAS_WORKSPACE_CONFIG`` from; ``None`` for ``os.environ``.

        Returns:
            Bytes per cuBLAS handle.
        """
        return cublas_workspace_bytes(self.capability, environ)


# Every compute capability NVIDIA has shipped since Maxwell, the oldest that current PyTorch builds for.
CAPABILITIES = frozenset(
    {(5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0)}
    | {(10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1)}
)


def resolve_gpu(gpu: str | None, name: str = "gpu") -> CudaTarget:
    """A GPU from its name ("A6000", case and spaces ignored) or compute capability ("8.6", "sm_86").

    Every way of naming a GPU goes through here, so a name is checked in one place.

    Args:
        gpu: the name, the capability as a string, or ``None`` for an A100.
        name: the argument ``gpu`` came from, for the error message.

    Returns:
        The target's name and compute capability.

    Raises:
        ValueError: if ``gpu`` is not a string naming a known GPU or a compute capability NVIDIA has shipped.
    """
    expected = f"{name} must be one of {sorted(GPUS)} or a compute capability like '8.6' or 'sm_90'"
    if gpu is None:
        return CudaTarget("A100", GPUS["A100"])
    if not isinstance(gpu, str):
        raise ValueError(f"{expected} (a string), got {gpu!r}")
    key = re.sub(r"[\s_-]", "", gpu).upper()
    if key in GPUS:
        return CudaTarget(key, GPUS[key])
    match = re.fullmatch(r"(?:SM)?(\d{1,2})\.(\d)|SM(\d{1,2})(\d)", key)
    if match:
        major, minor = (int(g) for g in (match.groups()[:2] if match.group(1) else match.groups()[2:]))
        if (major, minor) in CAPABILITIES:
            return CudaTarget(f"sm_{major}{minor}", (major, minor))
    raise ValueError(f"{expected}, got {gpu!r}")


TARGET_HELP = (
    f"'cpu', 'cuda' (an A100), or a GPU: a name in {sorted(GPUS)} or a compute capability like '8.6' or"
    " 'sm_90', also written 'cuda:A6000'"
)


def resolve_target(target: str, name: str = "target") -> CudaTarget | None:
    """The device a prediction is for, from one string: the CPU, or a GPU by name or compute capability.

    One argument says both "a GPU" and "which": ``"cuda"`` is an A100, ``"A6000"``,
    ``"cuda:A6000"``, ``"8.6"`` and ``"sm_86"`` name one (through :func:`resolve_gpu`).

    Args:
        target: ``"cpu"``, ``"cuda"``, a GPU's name or compute capability, or ``"cuda:"`` and either.
        name: the argument ``target`` came from, for the error message.

    Returns:
        ``None`` for the CPU, else the GPU.

    Raises:
        ValueError: naming ``name`` and what it accepts, for anything else (a GPU not known, a
            compute capability NVIDIA has not shipped, a value that is not a string).
    """
    if isinstance(target, str):
        key = target.strip().lower()
        if key == "cpu":
            return None
        if key == "cuda":
            return resolve_gpu(None, name)
        gpu = target.strip()[5:] if key.startswith("cuda:") else target
        try:
            return resolve_gpu(gpu, name)
        except ValueError:
            pass
    raise ValueError(f"{name} must be one of {TARGET_HELP}, got {brief(target)}")


def cublas_workspace_bytes(capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> int:
    """torch's cuBLAS workspace per handle: ``CUBLAS_WORKSPACE_CONFIG`` (":KiB:COUNT" pairs) or its default.

    The workspace is allocated memory that no tensor of the user's holds, so the census cannot see
    it; the default is 32 MiB on Hopper and Blackwell, else 4096 KiB x 2 + 16 KiB x 8 (8.125 MiB).

    Args:
        capability: the GPU's compute capability, ``(major, minor)``.
        environ: the environment to read ``CUBLAS_WORKSPACE_CONFIG`` from; ``None`` for ``os.environ``.

    Returns:
        Bytes per cuBLAS handle.
    """
    environ = os.environ if environ is None else environ
    config = environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if capability[0] in (9, 10, 12):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


class CublasWorkspaces(TorchDispatchMode):
    """Allocates a fake cuBLAS workspace at the first BLAS call of each thread, as torch's handle pool does.

    ``thread`` names the thread the step is on: ``"main"`` for forward and the optimizer,
    ``"autograd"`` while backward runs (set by the dry run at the phase boundaries).

    Args:
        tracker: the live-tensor tracker, which counts each workspace as allocated memory.
        workspace_bytes: bytes per workspace (:func:`cublas_workspace_bytes`).
    """

    def __init__(self, tracker: LiveTensorTracker, workspace_bytes: int) -> None:
        super().__init__()
        self.tracker = tracker
        self.workspace_bytes = workspace_bytes
        self.thread = "main"
        self.workspaces: dict[str, torch.Tensor] = {}

    @property
    def bytes(self) -> int:
        """The workspaces allocated so far, in 512-byte blocks."""
        return sum(round_block(int(w.untyped_storage().nbytes())) for w in self.workspaces.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.thread not in self.workspaces and func.__name__.split(".")[0] in _BLAS_OPS:
            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8)
            self.workspaces[self.thread] = workspace
            self.tracker.add(workspace)
        return func(*args, **(kwargs or {}))


def host_state_names(optimizer: Optimizer) -> frozenset[str]:
    """The state entries ``optimizer`` keeps in host memory on a GPU: its scalar counters, unless capturable or fused.

    torch makes them with ``torch.tensor(...)``, a CPU tensor, so they are in no CUDA figure; the
    dry run hands this to the monitor (``host_state``) so that the census and the fixed-cost formula
    both leave them out.

    Args:
        optimizer: an optimizer of the fake model.

    Returns:
        ``{"step", "mu_product"}`` (NAdam keeps both on the host) for an optimizer that keeps a step tensor and
        is neither capturable nor fused, else nothing.
    """
    groups = optimizer.param_groups
    if "capturable" not in optimizer.defaults or any(g.get("capturable") or g.get("fused") for g in groups):
        return frozenset()
    return _HOST_STEP


_HOST_STEP = frozenset({"step", "mu_product"})  # torch/optim: "Deliberately host `step` and `mu_product` on CPU"


def host_state_bytes(optimizers: list[Optimizer]) -> int:
    """Bytes of ``step`` counters that a GPU run keeps on the host (optimizers not capturable nor fused).

    Args:
        optimizers: the optimizers, after a step (before one they hold no state).

    Returns:
        The bytes of the counters that :func:`host_state_names` names, as they exist now.
    """
    total = 0
    for optimizer in optimizers:
        if not host_state_names(optimizer):
            continue
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                total += step.untyped_storage().nbytes()
    return total


def cuda_optimizer_defaults(optimizer: Optimizer) -> list[str]:
    """Make a fake optimizer choose what it would on a real GPU; the sentences say what was chosen.

    torch picks ``foreach`` on CUDA when the user left ``foreach`` and ``fused`` unset, but it
    does not recognise fake tensors as CUDA tensors, so the choice is made here instead.

    Args:
        optimizer: an optimizer of the fake model; its parameter groups are changed in place.

    Returns:
        The notes for the report: what was chosen, and where the step counters live.
    """
    notes = []
    for group in optimizer.param_groups:
        if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True
            note = f"{type(optimizer).__name__} runs foreach, torch's default on CUDA"
            if note not in notes:
                notes.append(note)
    capturable = any(g.get("capturable") or g.get("fused") for g in optimizer.param_groups)
    if "capturable" in optimizer.defaults and not capturable:  # the optimizers that keep a step tensor
        notes.append(
            f"{type(optimizer).__name__}'s step counters live on the host (not capturable or fused),"
            " so they are in no CUDA figure"
        )
    return notes
