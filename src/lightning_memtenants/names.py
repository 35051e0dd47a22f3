"""The names a report is made of: tenants, phases and named parts, each a ``Literal`` type with its values.

Every other module takes these names from here, so a typo is a type error and, at run time, a
``KeyError`` or a ``ValueError`` rather than a new part that nobody reads.
"""

from __future__ import annotations

from typing import Literal, get_args

Tenant = Literal["weights", "gradients", "optimizer_state", "activations"]
Phase = Literal["batch_start", "before_backward", "after_backward", "before_optimizer_step", "batch_end"]
# The loop a report belongs to: Lightning's ``trainer.state.stage`` names, training's included.
Stage = Literal["train", "validate", "test", "predict"]
Part = Literal["autocast_cache", "grad_scaler", "ddp_buckets", "cublas_workspace", "allocator_rounding"]
# What the monitor measures, each of which can fail and be disabled on its own (a named part as well).
Measurement = Literal["census", "activations", "memory source", "fixed cost", "peak explanation"]

TENANTS: tuple[Tenant, ...] = get_args(Tenant)
PHASES: tuple[Phase, ...] = get_args(Phase)
STAGES: tuple[Stage, ...] = get_args(Stage)
EVALUATION_STAGES: tuple[Stage, ...] = ("validate", "test", "predict")
# Each loop's name in words, in tags (``memtenants/validation/...``) and in sentences.
LOOP_NAMES: dict[Stage, str] = {"train": "training", "validate": "validation", "test": "test", "predict": "predict"}
FIXED_TENANTS: tuple[Tenant, ...] = ("weights", "gradients", "optimizer_state")

# What runs in the window that ends at each phase boundary.
WINDOWS: dict[Phase, str] = {
    "batch_start": "before the batch (data loading, validation)",
    "before_backward": "the forward pass",
    "after_backward": "backward",
    "before_optimizer_step": "between backward and the optimizer step",
    "batch_end": "the optimizer step",
}
# An evaluation batch has two boundaries; the window that ends at ``batch_end`` is the loop's step (its forward).
EVALUATION_WINDOWS: dict[Phase, str] = {
    "batch_start": "before the batch (data loading)",
    "batch_end": "the {loop} step",
}
# Short names for the same windows, used where a phase is reported as "where it failed".
WINDOW_NAMES: dict[Phase, str] = {
    "batch_start": "between_batches",
    "before_backward": "forward",
    "after_backward": "backward",
    "before_optimizer_step": "gradient_processing",
    "batch_end": "optimizer_step",
}
# Named parts of the desk outside the four tenants, each measured, never guessed; the two marked "(predicted)"
# exist only in a dry run, where the model of the CUDA allocator gives them.
PARTS: dict[Part, str] = {
    "autocast_cache": "half copies of weights made by autocast in forward and saved for backward",
    "grad_scaler": "the GradScaler's scale, growth tracker and found-inf flags",
    "ddp_buckets": "DDP's gradient buckets, where gradients are not views into them",
    "cublas_workspace": "cuBLAS workspaces in allocated memory, one per thread that multiplies (predicted)",
    "allocator_rounding": "the CUDA caching allocator's rounding of every block up to 512 bytes (predicted)",
}
